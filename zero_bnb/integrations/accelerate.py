"""Accelerate glue: under optimizer offload, the user's optimizer reaches ``deepspeed.initialize`` unchanged.

With ``offload_optimizer`` in the DeepSpeed config and ``zero_force_ds_cpu_optimizer`` left at its
default (true), ``Accelerator._prepare_deepspeed`` (which Trainer also goes through) replaces the
client optimizer by ``accelerate.utils.map_pytorch_optim_to_deepspeed(optimizer)`` before
``deepspeed.initialize`` is called: a ``bnb.optim.AdamW8bit`` becomes an fp32 ``DeepSpeedCPUAdam``
with ``adamw_mode=False`` (Adam with L2 decay), silently. While zero_bnb builds the engine
(:func:`zero_bnb.enable`, or inside ``with zero_bnb.enabled()`` on this thread), that call returns
the optimizer as it is: :func:`zero_bnb.initialize` then sets ``zero_force_ds_cpu_optimizer: false``
so that DeepSpeed accepts it, or refuses an optimizer zero_bnb does not declare, naming the user's
class (not ``DeepSpeedCPUAdam``). Every call while zero_bnb is not routing this thread keeps
Accelerate's behaviour.

Installed by :mod:`zero_bnb.ds.substitute` when zero_bnb is enabled: at once if
``accelerate.accelerator`` is imported already (``from transformers import Trainer`` and ``import
accelerate`` import it), else right after it is imported (a finder on ``sys.meta_path`` that runs
the module and then patches it), so ``enable()`` never imports Accelerate itself (about a second).
Removed when zero_bnb is disabled. Local, no collectives.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["install_accelerate_patch", "remove_accelerate_patch"]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_MODULE = "accelerate.accelerator"
_TARGET = "map_pytorch_optim_to_deepspeed"
_ORIGINAL: dict[str, Any] = {}
#: Whether the patch is wanted now (between install and remove): what a module finishing its import decides by, not
#: whether the watcher is still on ``sys.meta_path`` (a disable and enable while another thread imports Accelerate
#: removed and did not re-add it, and the module ran unpatched).
_WANTED = False
#: Seconds a waiter gives a module another thread is importing to finish (then it warns).
_IMPORT_WAIT_S = 120.0


def _installed() -> bool:
    """Whether Accelerate is installed (asked without importing it)."""
    try:
        return importlib.util.find_spec("accelerate") is not None
    except ValueError:  # a half-imported or stubbed "accelerate" without a spec
        return False


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while zero_bnb is enabled and ``accelerate.accelerator`` is not imported: it finds
    that module with the finders after it and has its loader patch the module once it has run; it then leaves."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None):
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if not isinstance(loader, (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)):
            logger.warning("zero_bnb: %s is loaded by %r, which zero_bnb cannot follow: Accelerate may replace the "
                           "optimizer by DeepSpeedCPUAdam under offload; import accelerate before zero_bnb.enable()",
                           _MODULE, loader)
            with _LOCK:
                _stop_watching()
            return spec
        run = loader.exec_module  # this module's own loader object: its method is replaced for this module only

        def exec_module(module: ModuleType) -> None:
            run(module)
            with _LOCK:
                _stop_watching()
                if _WANTED:
                    _patch(module)

        loader.exec_module = exec_module
        return spec


_WATCHER = _PatchOnImport()


def _stop_watching() -> None:
    while _WATCHER in sys.meta_path:
        sys.meta_path.remove(_WATCHER)


def _importing(module: ModuleType) -> bool:
    """Whether ``module`` is still being executed by an import on some thread."""
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False)) and not hasattr(module, _TARGET)


def _patch_when_imported(module: ModuleType) -> None:
    """Wait (on a daemon thread) for an import that another thread began without the watcher, then patch if still
    wanted."""
    import time

    deadline = time.monotonic() + _IMPORT_WAIT_S
    while _importing(module) and time.monotonic() < deadline:
        time.sleep(0.005)
    with _LOCK:
        if not _WANTED:
            return
        if hasattr(module, _TARGET):
            _patch(module)
        else:
            logger.warning("zero_bnb: %s did not finish importing within %.0f s; Accelerate may replace the "
                           "optimizer by DeepSpeedCPUAdam under offload: call zero_bnb.enable() again once it is "
                           "imported", _MODULE, _IMPORT_WAIT_S)


def install_accelerate_patch() -> None:
    """Make Accelerate's offload swap keep the user's optimizer while zero_bnb routes the call: now if
    ``accelerate.accelerator`` is imported, once it is if another thread is importing it, else once it is imported
    (idempotent, thread-safe)."""
    global _WANTED
    with _LOCK:
        _WANTED = True
        module = sys.modules.get(_MODULE)
        if module is None:
            if _WATCHER not in sys.meta_path and _installed():
                sys.meta_path.insert(0, _WATCHER)
        elif hasattr(module, _TARGET):
            _patch(module)
        elif _importing(module):  # being imported on another thread: patch once it has run
            threading.Thread(target=_patch_when_imported, args=(module,), name="zero_bnb-accelerate-patch",
                             daemon=True).start()
        # else: imported without the swap (an Accelerate that does not replace optimizers): nothing to patch


def _patch(module: ModuleType) -> None:
    """Replace ``module.map_pytorch_optim_to_deepspeed`` (once). Under ``_LOCK``."""
    if _TARGET in _ORIGINAL or not hasattr(module, _TARGET):
        return
    original = getattr(module, _TARGET)

    @functools.wraps(original)
    def keep_client_optimizer(optimizer, *args, **kwargs):
        from zero_bnb.ds.substitute import is_enabled

        if is_enabled():
            logger.info(
                "zero_bnb: optimizer offload keeps %s (Accelerate would have replaced it by DeepSpeedCPUAdam)",
                type(optimizer).__name__,
            )
            return optimizer
        return original(optimizer, *args, **kwargs)

    keep_client_optimizer._zero_bnb_patch = True
    _ORIGINAL[_TARGET] = original
    setattr(module, _TARGET, keep_client_optimizer)
    accelerator = getattr(module, "Accelerator", None)
    if accelerator is not None and not getattr(accelerator.save_state, "_zero_bnb_patch", False):
        save_state = accelerator.save_state

        @functools.wraps(save_state)
        def save_state_after_pending(self, *args, **kwargs):
            from zero_bnb.checkpoint.background import wait_for_pending_saves

            # Accelerate deletes checkpoints beyond ProjectConfiguration(total_limit) before it saves: a pending
            # asynchronous save (zero_checkpoint_async) is committed first, so the newest complete one survives.
            wait_for_pending_saves()
            return save_state(self, *args, **kwargs)

        save_state_after_pending._zero_bnb_patch = True
        _ORIGINAL["save_state"] = save_state
        accelerator.save_state = save_state_after_pending


def remove_accelerate_patch() -> None:
    """Undo :func:`install_accelerate_patch` (a no-op when it is not installed)."""
    global _WANTED
    with _LOCK:
        _WANTED = False
        _stop_watching()
        original = _ORIGINAL.pop(_TARGET, None)
        module = sys.modules.get(_MODULE)
        if original is not None and module is not None and getattr(getattr(module, _TARGET, None), "_zero_bnb_patch", False):
            setattr(module, _TARGET, original)
        save_state = _ORIGINAL.pop("save_state", None)
        if save_state is not None and module is not None and getattr(
                getattr(getattr(module, "Accelerator", None), "save_state", None), "_zero_bnb_patch", False):
            module.Accelerator.save_state = save_state  # only where ours is still in place
