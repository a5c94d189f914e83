"""DeepSpeed's loss-scaler objects rebuilt from zero_bnb's plain records (:mod:`zero_bnb.format.wrapper_state`).

Local, no collectives.
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler

from zero_bnb.format.wrapper_state import LOSS_SCALER

__all__ = ["live_wrapper"]


def live_wrapper(wrapper: dict[str, Any]) -> dict[str, Any]:
    """The ZeRO wrapper's scalars with the loss scaler rebuilt as DeepSpeed's object.

    ``wrapper`` is a plain record as :func:`~zero_bnb.format.payload.read_replicated` returns it
    (already checked).
    """
    result = dict(wrapper)
    scaler = wrapper.get(LOSS_SCALER)
    if scaler is not None:
        cls = getattr(ds_loss_scaler, scaler["class"])
        instance = cls.__new__(cls)
        vars(instance).update(scaler["state"])
        result[LOSS_SCALER] = instance
    return result
