"""The ZeRO wrapper's own scalars (fp16 loss scaler, overflow flag, clipping) as plain data.

DeepSpeed pickles its loss-scaler object into its files. zero_bnb stores it as
``{"class": name, "state": {attribute: value}}`` with plain values only, so that its files
load with ``torch.load(weights_only=True)`` (:mod:`zero_bnb.format.unpickle`);
:mod:`zero_bnb.ds.loss_scaler` rebuilds the object where DeepSpeed needs one (restoring an
engine, writing a universal checkpoint).

Local functions, no collectives.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zero_bnb.errors import CheckpointFormatError

__all__ = ["LOSS_SCALER", "SCALER_CLASSES", "SCALER_MODULE", "WRAPPER_SCALARS", "check_plain", "plain_wrapper"]

#: Scalars of DeepSpeed's ZeRO wrapper that a resume must restore (fp16 loss scaling).
WRAPPER_SCALARS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")
LOSS_SCALER = "loss_scaler"

#: Where DeepSpeed defines the loss scalers a plain record may name (rebuilt by :mod:`zero_bnb.ds.loss_scaler`).
SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"
SCALER_CLASSES = ("LossScaler", "DynamicLossScaler")
_PLAIN = (bool, int, float, str, torch.dtype, type(None))
#: Loss-scaler attributes that divide or multiply gradients: a zero or negative value breaks every step.
_POSITIVE = frozenset({"cur_scale", "scale_factor", "scale_window"})


def _plain_scaler(scaler: Any) -> dict[str, Any]:
    name = type(scaler).__name__
    if name not in SCALER_CLASSES:
        raise CheckpointFormatError(
            f"the ZeRO wrapper's loss scaler is a {type(scaler).__module__}.{name}, which zero_bnb cannot store as "
            f"plain data (it knows {list(SCALER_CLASSES)} from {SCALER_MODULE})"
        )
    state = {key: value for key, value in vars(scaler).items() if isinstance(value, _PLAIN)}
    return {"class": name, "state": state}


def plain_wrapper(wrapper: dict[str, Any]) -> dict[str, Any]:
    """``wrapper`` with its loss scaler (a DeepSpeed object, or already plain) as plain data."""
    result = {}
    for name in WRAPPER_SCALARS:
        if name not in wrapper:
            continue
        value = wrapper[name]
        if name == LOSS_SCALER and value is not None and not isinstance(value, dict):
            value = _plain_scaler(value)
        result[name] = value
    return result


def check_plain(wrapper: Any, source: str) -> None:
    """Raise ``CheckpointFormatError`` unless ``wrapper`` is what :func:`plain_wrapper` returns."""
    if not isinstance(wrapper, dict) or not set(wrapper) <= set(WRAPPER_SCALARS):
        raise CheckpointFormatError(
            f"{source}: zero_wrapper must map some of {list(WRAPPER_SCALARS)} to plain values, got "
            f"{sorted(wrapper) if isinstance(wrapper, dict) else type(wrapper).__name__}; the file is not a zero_bnb file"
        )
    clip = wrapper.get("clip_grad")
    if clip is not None and not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip >= 0):
        raise CheckpointFormatError(f"{source}: zero_wrapper.clip_grad={clip!r:.60} must be a finite number >= 0")
    scaler = wrapper.get(LOSS_SCALER)
    if scaler is None:
        return
    if (not isinstance(scaler, dict) or scaler.get("class") not in SCALER_CLASSES
            or not isinstance(scaler.get("state"), dict)
            or not all(isinstance(k, str) and isinstance(v, _PLAIN) for k, v in scaler["state"].items())):
        raise CheckpointFormatError(
            f"{source}: zero_wrapper.loss_scaler must be {{'class': one of {list(SCALER_CLASSES)}, 'state': "
            f"{{name: plain value}}}}, got {scaler!r:.200}"
        )
    for key, value in scaler["state"].items():
        if isinstance(value, float) and not math.isfinite(value) or key in _POSITIVE and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise CheckpointFormatError(
                f"{source}: zero_wrapper.loss_scaler.state.{key}={value!r:.60} must be "
                f"{'a finite number > 0' if key in _POSITIVE else 'finite'}; the file was edited"
            )
