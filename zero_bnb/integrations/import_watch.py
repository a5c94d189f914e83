"""Patch a front door's module as soon as it is imported, without importing it (Accelerate or transformers' Trainer
cost about a second each).

:func:`when_imported` runs ``patch(module)`` now if the module is imported, once another thread finishes importing
it, or right after it is first imported: a finder first on ``sys.meta_path`` finds the module with the finders after
it and has its loader call ``patch`` once the module has run, then leaves. ``patch`` decides itself whether it is
still wanted (the caller's lock and flag). Local, no collectives; thread-safe.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["stop_watching", "when_imported"]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
#: Seconds a waiter gives a module another thread is importing to finish (then it warns).
_IMPORT_WAIT_S = 120.0


def _installed(name: str) -> bool:
    """Whether the top-level package of ``name`` is installed (asked without importing it)."""
    try:
        return importlib.util.find_spec(name.split(".")[0]) is not None
    except ValueError:  # a half-imported or stubbed package without a spec
        return False


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while ``name`` is not imported: has its loader call ``patch`` once it has run."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _PatchOnImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if not isinstance(loader, (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)):
            logger.warning("zero_bnb: %s is loaded by %r, which zero_bnb cannot follow: import it before "
                           "zero_bnb.enable()", self.name, loader)
            stop_watching(self.name)
            return spec
        run = loader.exec_module  # this module's own loader object: its method is replaced for this module only

        def exec_module(module: ModuleType) -> None:
            run(module)
            stop_watching(self.name)
            self.patch(module)

        loader.exec_module = exec_module
        return spec


def _importing(module: ModuleType) -> bool:
    """Whether ``module`` is still being executed by an import on some thread."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _patch_when_imported(module: ModuleType, patch: Callable[[ModuleType], None],
                         ready: Callable[[ModuleType], bool]) -> None:
    deadline = time.monotonic() + _IMPORT_WAIT_S
    while _importing(module) and time.monotonic() < deadline:
        time.sleep(0.005)
    if not _importing(module) and ready(module):
        patch(module)
    else:
        logger.warning("zero_bnb: %s did not finish importing within %.0f s; call zero_bnb.enable() again once it "
                       "is imported", module.__name__, _IMPORT_WAIT_S)


def when_imported(name: str, patch: Callable[[ModuleType], None], ready: Callable[[ModuleType], bool]) -> None:
    """Call ``patch(module)`` for module ``name``: now if it is imported and ``ready(module)``, once another thread
    finishes importing it, or right after its first import (nothing if its package is not installed)."""
    with _LOCK:
        module = sys.modules.get(name)
        if module is None:
            if _installed(name) and not any(isinstance(f, _PatchOnImport) and f.name == name for f in sys.meta_path):
                sys.meta_path.insert(0, _PatchOnImport(name, patch))
            return
    if _importing(module):  # being imported on another thread: patch once it has run to its end
        threading.Thread(target=_patch_when_imported, args=(module, patch, ready), name=f"zero_bnb-patch-{name}",
                         daemon=True).start()
    elif ready(module):
        patch(module)


def stop_watching(name: str) -> None:
    """Remove the watcher of ``name`` (a no-op when there is none)."""
    with _LOCK:
        sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _PatchOnImport) and f.name == name)]
