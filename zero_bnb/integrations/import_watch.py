"""Patch a front door's module as soon as it is imported, without importing it (Accelerate or transformers' Trainer
cost about a second each).

:func:`when_imported` runs ``patch(module)`` now if the module is imported, once another thread finishes importing
it, or right after it is first imported: a watcher, a finder first on ``sys.meta_path``, finds the module with the
finders after it and has its loader call ``patch`` once the module has run, then leaves.

An import hook put in front of the watcher later (a finder of its own that serves the module) hides that import
from it. The watcher does not rely on being first: every import any finder passes on to it looks for its module in
``sys.modules``, and a module found imported there is patched then (the watcher leaves); so does
:func:`when_imported` called again, which :func:`zero_bnb.enable` and every engine built through a front door do
(:mod:`zero_bnb.integrations.substitute`). :func:`unpatched_because` says why a module's patch is not in place, for the
messages of those callers.

``patch`` decides itself whether it is still wanted (the caller's lock and flag) and must be idempotent. It runs
with no lock of this module held; when the watcher finds the module imported past it, it runs under Python's import
lock (the watcher is then a finder being asked for another module), so ``patch`` must not wait for other threads
and should not import modules that are not imported yet. Local, no collectives; thread-safe: ``sys.meta_path`` is
changed only under Python's import lock, which the import system holds while it asks the finders, so an import on
another thread never sees the list change under it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType

import _imp

__all__ = ["importing", "stop_watching", "unpatched_because", "watching", "when_imported"]

logger = logging.getLogger(__name__)

#: Seconds a waiter gives a module another thread is importing to finish (then it warns).
_IMPORT_WAIT_S = 120.0


@contextmanager
def _import_lock() -> Iterator[None]:
    """Python's own (re-entrant) import lock: the one the import system holds while it iterates ``sys.meta_path``.

    The only lock of this module; taking it first, before any lock of a caller, keeps one order everywhere (a finder
    is called with it held)."""
    _imp.acquire_lock()
    try:
        yield
    finally:
        _imp.release_lock()


def _installed(name: str) -> bool:
    """Whether the top-level package of ``name`` is installed (asked without importing it)."""
    try:
        return importlib.util.find_spec(name.split(".")[0]) is not None
    except ValueError:  # a half-imported or stubbed package without a spec
        return False


def importing(module: ModuleType) -> bool:
    """Whether ``module`` is still being executed by an import on some thread."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _imported(name: str, ready: Callable[[ModuleType], bool]) -> ModuleType | None:
    """Module ``name`` when it is in ``sys.modules``, has finished importing and is ``ready``; else ``None``."""
    module = sys.modules.get(name)
    if module is None or importing(module) or not ready(module):
        return None
    return module


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A watcher: on ``sys.meta_path`` while ``name`` is not imported; has its loader call ``patch`` once it has run,
    or patches it at the next import passed on to it once another finder has imported it."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None], ready: Callable[[ModuleType], bool]) -> None:
        self.name = name
        self.patch = patch
        self.ready = ready

    def __repr__(self) -> str:
        return f"<zero_bnb import watcher for {self.name}>"

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None):
        if fullname != self.name:
            module = _imported(self.name, self.ready)
            return None if module is None else self._imported_past_me(module, fullname, path, target)
        spec = _find_with([f for f in list(sys.meta_path) if not isinstance(f, _PatchOnImport)], fullname, path,
                          target)
        if spec is None or spec.loader is None:
            return spec
        if not self._follow(spec.loader):
            # Stays: the module is patched at the next import passed on to this watcher, or by when_imported.
            logger.info("zero_bnb: %s is loaded by %r, which zero_bnb's import watcher cannot follow; it is patched "
                        "at the next import, or at zero_bnb.enable() or an engine's construction", self.name,
                        spec.loader)
        return spec

    def _follow(self, loader: object) -> bool:
        """Make ``loader`` call ``patch`` right after it runs this module (and then forget it); whether it could."""
        run = getattr(loader, "exec_module", None)
        if run is None or isinstance(loader, type):  # no exec_module, or a class serving many modules
            return False
        own = getattr(loader, "__dict__", {}).get("exec_module")  # an exec_module set on this loader object before
        watcher = self

        def exec_module(module: ModuleType) -> None:
            if module.__name__ != watcher.name:  # a loader serving several modules: the others pass through
                run(module)
                return
            try:
                run(module)
            finally:
                _unfollow(loader, exec_module, own)
            stop_watching(watcher.name)
            watcher.patch(module)

        try:
            loader.exec_module = exec_module  # this loader object only: its class's method is not touched
        except (AttributeError, TypeError):
            return False
        return True

    def _imported_past_me(self, module: ModuleType, fullname: str, path: Sequence[str] | None,
                          target: ModuleType | None):
        """``self.name`` was imported without this watcher (an import hook ahead of it served it): patch it now, and
        find ``fullname`` with the finders after this one, which leaves ``sys.meta_path`` while the import system is
        iterating it (the finder after it would be skipped)."""
        logger.info("zero_bnb: %s was imported by %r, past zero_bnb's import watcher (a finder ahead of it on "
                    "sys.meta_path); patching it now", self.name, getattr(module, "__loader__", None))
        with _import_lock():
            position = next((i for i, finder in enumerate(sys.meta_path) if finder is self), None)
            later = [] if position is None else list(sys.meta_path[position + 1:])
            stop_watching(self.name)
        self.patch(module)
        if position is None:  # not on sys.meta_path (any more): the import system's iteration is not shifted
            return None
        return _find_with(later, fullname, path, target)


def _unfollow(loader: object, wrapper: Callable[[ModuleType], None], own: object) -> None:
    """Give ``loader`` back the ``exec_module`` it had before ``wrapper`` (when ``wrapper`` is still in place)."""
    try:
        if loader.__dict__.get("exec_module") is wrapper:
            if own is None:
                del loader.exec_module
            else:
                loader.exec_module = own
    except (AttributeError, TypeError):
        pass


def _find_with(finders: Sequence[object], fullname: str, path: Sequence[str] | None, target: ModuleType | None):
    """The first spec ``finders`` give for ``fullname`` (``None`` when none does)."""
    for finder in finders:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _patch_when_imported(module: ModuleType, patch: Callable[[ModuleType], None],
                         ready: Callable[[ModuleType], bool]) -> None:
    deadline = time.monotonic() + _IMPORT_WAIT_S
    while importing(module) and time.monotonic() < deadline:
        time.sleep(0.005)
    if not importing(module) and ready(module):
        patch(module)
    else:
        logger.warning("zero_bnb: %s did not finish importing within %.0f s; call zero_bnb.enable() again once it "
                       "is imported", module.__name__, _IMPORT_WAIT_S)


def when_imported(name: str, patch: Callable[[ModuleType], None], ready: Callable[[ModuleType], bool]) -> None:
    """Call ``patch(module)`` for module ``name``: now if it is imported and ``ready(module)``, once another thread
    finishes importing it, or right after its first import (nothing if its package is not installed).

    Call it again to re-check: a module imported past a watcher (an import hook ahead of it) is patched now and its
    watcher leaves; ``patch`` itself puts back what a reload of the module replaced."""
    with _import_lock():
        module = sys.modules.get(name)
        if module is None:
            if not watching(name) and _installed(name):
                sys.meta_path.insert(0, _PatchOnImport(name, patch, ready))
            return
        stop_watching(name)  # imported: a watcher still waiting was passed by (another finder imported it)
    if importing(module):  # being imported on another thread: patch once it has run to its end
        threading.Thread(target=_patch_when_imported, args=(module, patch, ready), name=f"zero_bnb-patch-{name}",
                         daemon=True).start()
    elif ready(module):
        patch(module)


def watching(name: str) -> bool:
    """Whether a watcher still waits on ``sys.meta_path`` for the import of ``name``."""
    return any(isinstance(finder, _PatchOnImport) and finder.name == name for finder in list(sys.meta_path))


def unpatched_because(name: str) -> str:
    """Why the patch of imported module ``name`` is not in place (for messages): imported past the watcher, or
    replaced since it was patched."""
    if watching(name):
        loader = getattr(sys.modules.get(name), "__loader__", None)
        return (f"{name} was imported by {loader!r} without zero_bnb's import watcher seeing it (an import hook ahead "
                f"of it on sys.meta_path)")
    return f"replaced since zero_bnb patched {name} (importlib.reload({name}), or an assignment)"


def stop_watching(name: str) -> None:
    """Remove the watcher of ``name`` (a no-op when there is none)."""
    with _import_lock():
        if watching(name):
            sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _PatchOnImport) and f.name == name)]
