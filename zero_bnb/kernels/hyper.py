"""The hyper-parameters of one blockwise 8-bit update and the per-step scalars derived from them.

The reference (:mod:`zero_bnb.kernels.reference`) and the fused kernel (:mod:`zero_bnb.kernels.fused`)
both take a :class:`StepScalars`, so the bias corrections and step size are rounded to float32 once, in
one place, and the two agree bit for bit. Local: no collectives.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "FAMILIES", "TWO_STATE", "Family", "StepScalars", "UpdateHyper", "step_scalars"]

#: Elements per quantization block (bitsandbytes' ``BLOCKSIZE_2STATE`` and ``BLOCKSIZE_1STATE``).
BLOCK = 256


class Family(enum.Enum):
    """The one table of the blockwise 8-bit update's families: bitsandbytes' ``optimizer_name`` (the value), the
    fused kernel's number for it, whether ``kOptimizerStatic8bit2StateBlockwise`` updates it (two moments, else the
    1-state kernel), and how many rows ``state1`` stacks (AdEMAMix: its fast and slow moments)."""

    ADAM = "adam"
    ADEMAMIX = "ademamix"
    MOMENTUM = "momentum"
    LION = "lion"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"

    @property
    def kernel(self) -> int:
        return list(Family).index(self)

    @property
    def two_state(self) -> bool:
        return self in (Family.ADAM, Family.ADEMAMIX)

    @property
    def rows(self) -> int:
        return 2 if self is Family.ADEMAMIX else 1

    @property
    def nonnegative(self) -> bool:
        """Whether its one moment is never negative (a sum of squares)."""
        return self in (Family.RMSPROP, Family.ADAGRAD)


#: bitsandbytes ``optimizer_name`` values of the blockwise 8-bit update, with their kernel number.
FAMILIES = {family.value: family.kernel for family in Family}
#: Families updated by ``kOptimizerStatic8bit2StateBlockwise`` (the others by the 1-state kernel).
TWO_STATE = tuple(family.value for family in Family if family.two_state)


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateHyper:
    """The arguments bitsandbytes passes to ``optimizer_update_8bit_blockwise`` (``gnorm_scale`` is always 1).

    Attributes:
        name: bitsandbytes' ``optimizer_name`` (a key of :data:`FAMILIES`).
        beta1, beta2, beta3, alpha, eps, lr, weight_decay: as in bitsandbytes (``beta3``/``alpha``:
            AdEMAMix's slow moment, after its schedule).
        skip_zeros: 1-state families leave elements whose gradient is exactly 0 untouched.
    """

    name: str
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    beta3: float = 0.0
    alpha: float = 0.0
    eps: float = 1e-8
    weight_decay: float = 0.0
    skip_zeros: bool = False

    def __post_init__(self) -> None:
        if self.name not in FAMILIES:
            raise ValueError(f"no fused 8-bit update for optimizer {self.name!r}; known: {sorted(FAMILIES)}")

    @property
    def family(self) -> Family:
        """The family :attr:`name` names."""
        return Family(self.name)


@dataclass(frozen=True, slots=True)
class StepScalars:
    """Float32 scalars of one step (each a Python float holding an exact float32 value)."""

    beta1: float
    beta2: float
    beta3: float
    alpha: float
    eps: float
    lr: float
    weight_decay: float
    one_minus_beta1: float
    one_minus_beta2: float
    one_minus_beta3: float
    correction1: float
    correction2: float
    step_size: float
    eps_hat: float
    decay: float
    step: int


def _f32(value: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32)


def step_scalars(hyper: UpdateHyper, step: int) -> StepScalars:
    """The float32 scalars of step ``step`` (1-based), computed as ``kOptimizerStatic8bit2StateBlockwise`` does.

    ``correction1 = 1 - beta1**step``, ``correction2 = sqrt(1 - beta2**step)``, ``step_size = -lr *
    correction2 / correction1``, ``eps_hat = correction2 * eps`` (eps scaled by the bias correction) and
    ``decay = 1 - lr * weight_decay``, each rounded to float32 (the CUDA kernel uses the faster, less exact
    ``__powf``/``__fdividef``: agreement with a GPU is within a few float32 ulps, not bitwise).
    """
    if step < 1:
        raise ValueError(f"step must be >= 1 (bitsandbytes counts from 1), got {step}")
    b1, b2, b3 = _f32(hyper.beta1), _f32(hyper.beta2), _f32(hyper.beta3)
    lr, eps, wd = _f32(hyper.lr), _f32(hyper.eps), _f32(hyper.weight_decay)
    one = _f32(1.0)
    correction1 = one - _f32(math.pow(float(b1), step))
    correction2 = torch.sqrt(one - _f32(math.pow(float(b2), step)))
    return StepScalars(
        beta1=float(b1), beta2=float(b2), beta3=float(b3), alpha=float(_f32(hyper.alpha)), eps=float(eps),
        lr=float(lr), weight_decay=float(wd),
        one_minus_beta1=float(one - b1), one_minus_beta2=float(one - b2), one_minus_beta3=float(one - b3),
        correction1=float(correction1), correction2=float(correction2),
        step_size=float((-lr * correction2) / correction1), eps_hat=float(correction2 * eps),
        decay=float(one - lr * wd), step=step,
    )
