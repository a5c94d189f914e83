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

Installed by :mod:`zero_bnb.integrations.substitute` when zero_bnb is enabled: at once if
``accelerate.accelerator`` is imported already (``from transformers import Trainer`` and ``import
accelerate`` import it), else right after it is imported (:mod:`zero_bnb.integrations.import_watch`),
so ``enable()`` never imports Accelerate itself (about a second). Idempotent: installing again puts
back what ``importlib.reload(accelerate.accelerator)`` replaced and leaves what is in place (no
double wrapping); :func:`missing_accelerate_patch` says what is not in place, and why. Removed when
zero_bnb is disabled. Local, no collectives.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from types import ModuleType
from typing import Any

from zero_bnb.integrations.accelerate_checkpoints import install_checkpoint_patch, missing_checkpoint_patch
from zero_bnb.integrations.import_watch import importing, stop_watching, unpatched_because, when_imported

__all__ = ["install_accelerate_patch", "missing_accelerate_patch", "remove_accelerate_patch"]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_MODULE = "accelerate.accelerator"
_TARGET = "map_pytorch_optim_to_deepspeed"
#: Whether the patch is wanted now (between install and remove): what a module finishing its import decides by, not
#: whether the watcher is still on ``sys.meta_path`` (a disable and enable while another thread imports Accelerate
#: removed and did not re-add it, and the module ran unpatched).
_WANTED = False


def _ready(module: ModuleType) -> bool:
    return hasattr(module, _TARGET)


def _patch_if_wanted(module: ModuleType) -> None:
    with _LOCK:
        if _WANTED:
            _patch(module)


def install_accelerate_patch() -> None:
    """Make Accelerate's offload swap keep the user's optimizer while zero_bnb routes the call: now if
    ``accelerate.accelerator`` is imported, once it is if another thread is importing it, else once it is imported
    (idempotent, thread-safe; called again, it re-installs what a reload of the module replaced)."""
    global _WANTED
    with _LOCK:
        _WANTED = True
    when_imported(_MODULE, _patch_if_wanted, _ready)  # outside _LOCK: a watcher patches under Python's import lock


def missing_accelerate_patch() -> list[str]:
    """What the installed patch should have changed in ``accelerate.accelerator`` and has not, as one entry naming
    the functions and why (:func:`zero_bnb.integrations.import_watch.unpatched_because`); empty while the patch is
    not wanted, the module is not imported (or still importing), or everything is in place. Changes nothing."""
    with _LOCK:
        wanted = _WANTED
    module = sys.modules.get(_MODULE)
    if not wanted or module is None or importing(module) or not _ready(module):
        return []
    lost = [] if _in_place(getattr(module, _TARGET)) else [f"{_MODULE}.{_TARGET}"]
    accelerator = getattr(module, "Accelerator", None)
    if accelerator is not None:
        lost += [f"{_MODULE}.Accelerator.{name}" for name in missing_checkpoint_patch(accelerator)]
    return [f"{', '.join(lost)}: {unpatched_because(_MODULE)}"] if lost else []


def _in_place(function: Any) -> bool:
    return getattr(function, "_zero_bnb_patch", False)


def _patch(module: ModuleType) -> None:
    """Replace ``module.map_pytorch_optim_to_deepspeed`` and wrap ``module.Accelerator``'s checkpoint calls, each
    unless already done. Under ``_LOCK``."""
    original = getattr(module, _TARGET, None)
    if original is not None and not _in_place(original):

        @functools.wraps(original)
        def keep_client_optimizer(optimizer, *args, **kwargs):
            from zero_bnb.ds.dispatch import is_enabled

            if is_enabled():
                logger.info(
                    "zero_bnb: optimizer offload keeps %s (Accelerate would have replaced it by DeepSpeedCPUAdam)",
                    type(optimizer).__name__,
                )
                return optimizer
            return original(optimizer, *args, **kwargs)

        keep_client_optimizer._zero_bnb_patch = True
        setattr(module, _TARGET, keep_client_optimizer)
    accelerator = getattr(module, "Accelerator", None)
    if accelerator is not None:
        install_checkpoint_patch(accelerator)  # stays installed: it acts on zero_bnb's checkpoints only


def remove_accelerate_patch() -> None:
    """Undo :func:`install_accelerate_patch` (a no-op when it is not installed)."""
    global _WANTED
    stop_watching(_MODULE)  # before _LOCK: the watcher's lock (Python's import lock) is always taken first
    with _LOCK:
        _WANTED = False
        module = sys.modules.get(_MODULE)
        current = getattr(module, _TARGET, None)
        if _in_place(current):
            setattr(module, _TARGET, current.__wrapped__)  # what this wrapper wraps: the module's own function
