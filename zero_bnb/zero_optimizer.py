"""DeepSpeed's ZeRO stage 1/2 optimizer with partitions that start on quantization blocks.

The only change to DeepSpeed's partitioning: each flat group is padded to a multiple of
``lcm(block_size, 2) * dp`` instead of ``2 * dp`` (see :mod:`zero_bnb.layout`). Everything
else (gradient reduction, the all-gather of updated weights, loss scaling) is DeepSpeed's.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from zero_bnb.checkpoint_format import ParamEntry
from zero_bnb.chunked import ChunkedUpdate
from zero_bnb.layout import DEEPSPEED_START_ALIGNMENT, GroupGeometry
from zero_bnb.state_spec import OptimizerSpec, StateRule

__all__ = ["BlockAlignedZeroOptimizer", "ZeroLayoutError"]

logger = logging.getLogger(__name__)


class ZeroLayoutError(ValueError):
    """A ZeRO setting would make the flat layout depend on the DP size."""


class BlockAlignedZeroOptimizer(DeepSpeedZeroOptimizer):
    """``DeepSpeedZeroOptimizer`` whose partitions hold whole quantization blocks.

    Constructed by :class:`zero_bnb.engine.ZeroBnbEngine` with DeepSpeed's own arguments plus
    the optimizer's declared state layout (``zero_bnb_spec``) and the user's replication rule
    (``zero_bnb_rule``). Construction is collective: all ranks of the data-parallel group must
    construct it, as with the DeepSpeed class.
    """

    def __init__(self, init_optimizer, *args, zero_bnb_spec: OptimizerSpec, zero_bnb_rule: StateRule, **kwargs):
        # Set before DeepSpeed's constructor runs: it calls flatten_dense_tensors_aligned.
        self.zero_bnb_spec = zero_bnb_spec
        self.zero_bnb_rule = zero_bnb_rule
        self._zero_bnb_dp = dist.get_world_size(group=kwargs.get("dp_process_group"))
        if callable(getattr(init_optimizer, "update_step", None)):  # bitsandbytes: partitions may exceed 2^31
            init_optimizer.update_step = ChunkedUpdate(init_optimizer, zero_bnb_spec)
        self._zero_bnb_flattening_params = True
        try:
            super().__init__(init_optimizer, *args, **kwargs)
        finally:
            self._zero_bnb_flattening_params = False
        self._check_layout()

    # -- DeepSpeed hook ---------------------------------------------------------------------

    def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False, param_padding=None):
        """Pad each flat parameter group to whole blocks per rank (DeepSpeed asks for ``2 * dp``).

        Only the parameter flattening in ``__init__`` is changed; DeepSpeed also calls this to
        pad the last rank's gradients to the partition size, which must stay as it is.
        """
        if not self._zero_bnb_flattening_params:
            return super().flatten_dense_tensors_aligned(
                tensor_list, alignment, use_cpu_data=use_cpu_data, param_padding=param_padding
            )
        block_alignment = math.lcm(self.zero_bnb_spec.block_size, DEEPSPEED_START_ALIGNMENT) * self._zero_bnb_dp
        return super().flatten_dense_tensors_aligned(
            tensor_list, math.lcm(alignment, block_alignment), use_cpu_data=use_cpu_data, param_padding=param_padding
        )

    # -- layout queries ---------------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return dist.get_rank(group=self.dp_process_group)

    @property
    def dp_size(self) -> int:
        """Size of the data-parallel group the groups are partitioned over."""
        return self._zero_bnb_dp

    @property
    def num_groups(self) -> int:
        return len(self.bit16_groups)

    def geometry(self, group_index: int) -> GroupGeometry:
        """Partition geometry of flat group ``group_index`` at the current DP size."""
        numel = sum(p.numel() for p in self.round_robin_bit16_groups[group_index])
        return GroupGeometry(numel=numel, dp=self.dp_size, block_size=self.zero_bnb_spec.block_size)

    def param_entries(self, group_index: int, names: dict[torch.nn.Parameter, str]) -> tuple[ParamEntry, ...]:
        """Name, shape and flat offset of every parameter of group ``group_index``."""
        return tuple(
            ParamEntry(names.get(param, f"<unnamed {index}>"), tuple(param.shape), offset)
            for index, (param, offset) in enumerate(
                zip(self.round_robin_bit16_groups[group_index], self.round_robin_bit16_offsets[group_index])
            )
        )

    def master_partition(self, group_index: int) -> torch.Tensor:
        """This rank's fp32 master-weight partition of group ``group_index`` (padding included).

        It is also the parameter the base optimizer keys its state by.
        """
        return self.single_partition_of_fp32_groups[group_index]

    def state_precision(self, group_index: int) -> dict[str, Any] | None:
        """How bitsandbytes decides 8-bit vs fp32 state for group ``group_index`` (``None`` for other optimizers).

        bitsandbytes keeps 8-bit state only for tensors of at least ``min_8bit_size`` elements,
        and under ZeRO the tensor is this rank's *partition*: the same group can be 8-bit at
        DP=2 and fp32 at DP=64. ``eight_bit_up_to_dp`` is the largest DP size that keeps it 8-bit.
        """
        base = self.optimizer
        if not callable(getattr(base, "get_config", None)):
            return None
        config = base.get_config(group_index, 0, base.param_groups[group_index])
        geometry = self.geometry(group_index)
        limit = config["min_8bit_size"]
        up_to = None
        if config["optim_bits"] == 8:
            up_to = max((dp for dp in range(1, 4097)
                         if GroupGeometry(geometry.numel, dp, geometry.block_size).partition_numel >= limit), default=None)
        return {
            "optim_bits": config["optim_bits"],
            "min_8bit_size": limit,
            "partition_numel": geometry.partition_numel,
            "eight_bit": config["optim_bits"] == 8 and geometry.partition_numel >= limit,
            "eight_bit_up_to_dp": up_to,
        }

    def _check_layout(self) -> None:
        if self.round_robin_gradients:
            raise ZeroLayoutError(
                "zero_optimization.round_robin_gradients=true reorders parameters by DP size, so a checkpoint "
                "could not be re-split at another DP size; set it to false for zero_bnb"
            )
        if any(any(padding) for padding in self.round_robin_bit16_padding):
            raise ZeroLayoutError(
                "zero_optimization.parameter_alignment=true inserts padding between parameters; set it to false "
                "for zero_bnb"
            )
        if self.has_moe_layers:
            raise ZeroLayoutError("mixture-of-experts layers are not supported by zero_bnb")
        if self.cpu_offload:
            raise ZeroLayoutError(
                "zero_optimization.offload_optimizer is not supported by zero_bnb yet; remove the offload section"
            )
        for index in range(self.num_groups):
            geometry = self.geometry(index)
            actual = self.bit16_groups_flat[index].numel()
            if actual != geometry.padded_numel or self.partition_size[index] != geometry.partition_numel:
                raise ZeroLayoutError(
                    f"flat group {index} has {actual} elements and partitions of {self.partition_size[index]}, but "
                    f"block-aligned partitioning expects {geometry.padded_numel} and {geometry.partition_numel}; "
                    f"this DeepSpeed version partitions differently from the supported range"
                )
        logger.debug(
            "block-aligned ZeRO partitions: %s",
            [(self.geometry(i).numel, self.geometry(i).partition_numel) for i in range(self.num_groups)],
        )
