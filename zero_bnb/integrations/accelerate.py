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

Installed by :mod:`zero_bnb.ds.substitute` when zero_bnb is enabled (importing
``accelerate.accelerator`` if Accelerate is installed, about a second once); removed when it is
disabled. Local, no collectives.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import threading
from typing import Any

__all__ = ["install_accelerate_patch", "remove_accelerate_patch"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_TARGET = "map_pytorch_optim_to_deepspeed"
_ORIGINAL: dict[str, Any] = {}


def _accelerator_module():
    """``accelerate.accelerator``, imported if Accelerate is installed; ``None`` otherwise."""
    if "accelerate.accelerator" not in sys.modules:
        try:
            if importlib.util.find_spec("accelerate") is None:
                return None
        except ValueError:  # a half-imported or stubbed "accelerate" without a spec
            return None
        import accelerate.accelerator  # noqa: F401 - the module whose global name is replaced
    return sys.modules["accelerate.accelerator"]


def install_accelerate_patch() -> None:
    """Make Accelerate's offload swap keep the user's optimizer while zero_bnb routes the call (once)."""
    module = _accelerator_module()
    if module is None or not hasattr(module, _TARGET):
        return
    with _LOCK:
        if _TARGET in _ORIGINAL:
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
        original = _ORIGINAL.pop(_TARGET, None)
        module = sys.modules.get("accelerate.accelerator")
        if original is not None and module is not None and getattr(getattr(module, _TARGET, None), "_zero_bnb_patch", False):
            setattr(module, _TARGET, original)
