"""What differs between the DeepSpeed releases zero_bnb supports, asked in one place.

zero_bnb subclasses DeepSpeed's engine and ZeRO optimizers (:mod:`zero_bnb.ds.engine`,
:mod:`zero_bnb.ds.zero_optimizer`). Methods it overrides pass DeepSpeed's other arguments
through unchanged (``*args, **kwargs``), so signatures that grew between releases need nothing
here. What remains are attributes that exist only in some releases; each function below says
which, and answers for the others. The supported range itself is :data:`zero_bnb.versions.SUPPORTED`.

Local: no collectives.
"""

from __future__ import annotations

from typing import Any

__all__ = ["parameter_padding", "uses_muon"]


def parameter_padding(wrapper: Any) -> list[list[int]]:
    """Padding DeepSpeed's ZeRO optimizer inserted after each parameter, per flat group.

    ``zero_optimization.parameter_alignment`` (and ``round_robin_bit16_padding``) arrived in
    DeepSpeed 0.19.7; earlier releases never pad between parameters, so every entry is 0.
    """
    padding = getattr(wrapper, "round_robin_bit16_padding", None)
    if padding is None:
        return [[0] * len(group) for group in wrapper.round_robin_bit16_groups]
    return [list(group) for group in padding]


def uses_muon(wrapper: Any) -> bool:
    """Whether DeepSpeed's wrapper runs its Muon optimizer: ``BF16_Optimizer`` says so in ``_uses_muon`` (since
    DeepSpeed 0.19.8), the ZeRO stage-3 optimizer in ``use_muon`` (since 0.18.9); earlier releases have neither."""
    return bool(getattr(wrapper, "_uses_muon", False) or getattr(wrapper, "use_muon", False))
