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
                if _WATCHER in sys.meta_path:
                    _stop_watching()
                    _patch(module)

        loader.exec_module = exec_module
        return spec


_WATCHER = _PatchOnImport()


def _stop_watching() -> None:
    while _WATCHER in sys.meta_path:
        sys.meta_path.remove(_WATCHER)


def install_accelerate_patch() -> None:
    """Make Accelerate's offload swap keep the user's optimizer while zero_bnb routes the call: now if
    ``accelerate.accelerator`` is imported, else once it is (idempotent)."""
    with _LOCK:
        module = sys.modules.get(_MODULE)
        if module is not None:
            _patch(module)
        elif _WATCHER not in sys.meta_path and _installed():
            sys.meta_path.insert(0, _WATCHER)


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


def remove_accelerate_patch() -> None:
    """Undo :func:`install_accelerate_patch` (a no-op when it is not installed)."""
    with _LOCK:
        _stop_watching()
        original = _ORIGINAL.pop(_TARGET, None)
        module = sys.modules.get(_MODULE)
        if original is not None and module is not None and getattr(getattr(module, _TARGET, None), "_zero_bnb_patch", False):
            setattr(module, _TARGET, original)
