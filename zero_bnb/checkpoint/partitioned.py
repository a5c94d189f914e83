"""What the save/load protocol needs from a ZeRO optimizer wrapper, declared (no DeepSpeed import).

:class:`~zero_bnb.ds.aligned.BlockAligned` (DeepSpeed's ZeRO and BF16 wrappers, block-aligned)
implements it; the checkpoint code reaches DeepSpeed only through this interface.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from zero_bnb.core.layout import GroupGeometry
from zero_bnb.core.state_spec import OptimizerSpec, StateRule
from zero_bnb.format.manifest import ParamEntry

__all__ = ["PartitionedOptimizer"]


class PartitionedOptimizer(Protocol):
    """One rank's view of a ZeRO-partitioned optimizer whose partitions start on block boundaries."""

    #: The base (bitsandbytes or torch) optimizer that steps this rank's flat partitions.
    optimizer: torch.optim.Optimizer
    zero_bnb_spec: OptimizerSpec
    zero_bnb_rule: StateRule

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    #: Whether module weights are partitions refreshed from the masters after a load (ZeRO stage 3).
    module_weights_partitioned: bool

    @property
    def num_groups(self) -> int: ...

    def base_group_index(self, group_index: int) -> int:
        """The base optimizer's param group (hyper-parameters) that flat group ``group_index`` belongs to."""

    def base_group(self, group_index: int) -> dict[str, Any]:
        """The base optimizer's param group dict at :meth:`base_group_index` (live: writes change the optimizer)."""

    def geometry(self, group_index: int) -> GroupGeometry:
        """Block-aligned partition geometry of flat group ``group_index``."""

    def master_partition(self, group_index: int) -> torch.Tensor:
        """This rank's fp32 partition of the group (the tensor the base optimizer steps)."""

    def group_params(self, group_index: int) -> list[torch.nn.Parameter]:
        """The module parameters of the group, in flat order."""

    def param_entries(self, group_index: int, names: dict[torch.nn.Parameter, str]) -> tuple[ParamEntry, ...]:
        """The group's parameters (names, shapes, offsets)."""

    def trained_params(self) -> list[torch.nn.Parameter]:
        """Every module parameter the optimizer trains."""

    def cast_masters_into_module(self) -> None:
        """Set every trained module weight to its master weight cast to the module's dtype (each rank casts its
        partition, the ranks all-gather). Collective over the data-parallel group."""

    def state_precision(self, group_index: int) -> dict[str, Any] | None:
        """How bitsandbytes decides 8-bit vs fp32 state for the group (``None`` for other optimizers)."""

    def wrapper_scalars(self) -> dict[str, Any]:
        """The ZeRO wrapper's scalars to save (loss scaler, ...), as plain data."""

    def load_wrapper_scalars(self, plain: dict[str, Any]) -> None:
        """Restore what :meth:`wrapper_scalars` returned (rebuilding DeepSpeed's objects)."""

    def relink_state_views(self) -> None:
        """Point DeepSpeed's per-parameter views of the optimizer state at the state now in place (after a load)."""
