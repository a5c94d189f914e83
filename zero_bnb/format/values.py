"""Value checks of a checkpoint's payload: what a re-signed manifest or an edited file could still get wrong.

Checksums prove that files are the ones the manifest names; anyone can re-sign a manifest, so
values are checked too, before a load applies anything and in ``zero-bnb verify``: counters are
non-negative numbers, hyper-parameters finite and in the ranges the optimizers themselves accept,
quantization maps what bitsandbytes builds (256 sorted values in [-1, 1] holding an exact zero),
and master weights and float optimizer state finite wherever the manifest's ``non_finite`` does not
declare NaN/Inf. Each problem is one line naming the field and its value.

Local functions, no collectives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zero_bnb.core.kinds import non_finite_params
from zero_bnb.core.state_spec import SPECS, StateKind

__all__ = ["QMAP_SIZE", "counter_problem", "hyperparameter_problem", "qmap_keys", "qmap_problem",
           "same_quantized_state", "undeclared_non_finite"]

#: Entries of an 8-bit quantization map (one value per code).
QMAP_SIZE = 256
_NUMBER = (int, float)
_NUMERIC_HYPERPARAMETERS = ("lr", "eps", "weight_decay", "momentum", "alpha", "dampening", "min_8bit_size",
                            "percentile_clipping", "max_unorm", "t_alpha", "t_beta3")
#: Hyper-parameters the optimizers themselves refuse below zero ("Invalid learning rate: -1").
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "dampening", "alpha")


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def hyperparameter_problem(key: Any, value: Any) -> str | None:
    """Why a saved param-group entry cannot be what an optimizer holds (``None`` if it can)."""
    if not isinstance(key, str):
        return "has a non-string name"
    if key in _NUMERIC_HYPERPARAMETERS:
        if value is None:
            return None
        if not _is_number(value):
            return "must be a number"
        if not math.isfinite(value):
            return "must be finite"
        if key in _NON_NEGATIVE and value < 0:
            return "must be >= 0"
    if key == "betas":
        if not (isinstance(value, (tuple, list)) and all(b is None or _is_number(b) for b in value)):
            return "must be a tuple of numbers"
        if not all(b is None or 0.0 <= b < 1.0 for b in value):
            return "must hold numbers in [0, 1)"
    return None


def counter_problem(value: Any) -> str | None:
    """Why a saved counter (``step``) is not a non-negative whole count (``None`` if it is)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return f"is a {value.dtype} tensor of shape {tuple(value.shape)}, not one number"
        value = value.item()
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        return "must be a number >= 0"
    return None


def same_quantized_state(optimizer_spec: str) -> dict[str, frozenset[str]]:
    """:meth:`~zero_bnb.core.state_spec.OptimizerSpec.same_quantized_state` of the family named ``optimizer_spec``."""
    return next((spec.same_quantized_state() for spec in SPECS if spec.name == optimizer_spec), {})


def qmap_keys(optimizer_spec: str) -> frozenset[str]:
    """The state keys that are quantization maps in the optimizer family named ``optimizer_spec``."""
    return frozenset(triple.qmap for spec in SPECS if spec.name == optimizer_spec for triple in spec.quantized)


def qmap_problem(value: torch.Tensor) -> str | None:
    """Why ``value`` is not a quantization map as bitsandbytes builds it (``None`` if it is)."""
    if value.dim() != 1 or value.numel() != QMAP_SIZE or not value.is_floating_point():
        return f"is {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}; a map holds {QMAP_SIZE} floats"
    values = value.double()
    if not bool(torch.isfinite(values).all()) or bool((values.abs() > 1).any()):
        return "must hold finite values in [-1, 1]"
    if bool((values[1:] < values[:-1]).any()):
        return "must be sorted"
    if not bool((values == 0).any()):
        return "must hold an exact zero (the code of padding)"
    return None


def undeclared_non_finite(tensor: torch.Tensor, key: str, kind: StateKind, axis_range: tuple[int, int],
                          params: Sequence[Any], block_size: int, declared: Mapping[str, list[str]],
                          same_as: Mapping[str, frozenset[str]] | None = None) -> list[str]:
    """Parameters whose entries of ``tensor`` (state ``key``, or ``"fp32"``) hold NaN/Inf that ``declared``
    (the manifest's ``non_finite``) does not list; ``same_as[key]`` are keys whose declaration covers ``key``
    too (the codes, scale and values of one quantized state)."""
    covered = {key} | set((same_as or {}).get(key, ()))
    return [name for name in non_finite_params(tensor, kind, axis_range, params, block_size)
            if not covered & set(declared.get(name, ()))]
