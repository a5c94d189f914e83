"""DeepSpeed's ZeRO optimizers with partitions that start on quantization blocks.

:class:`BlockAlignedZeroOptimizer` (ZeRO stages 1 and 2, fp32/bf16/fp16) and
:class:`BlockAlignedBF16Optimizer` (bf16 with fp32 gradient accumulation) differ from
DeepSpeed's classes only in the padding of their flat groups (see :mod:`zero_bnb.ds.aligned`).
Gradient reduction, the all-gather of updated weights and loss scaling are DeepSpeed's.
Construction is collective: all ranks of the data-parallel group must construct them, as
with the DeepSpeed classes.
"""

from __future__ import annotations

import logging

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from zero_bnb.core.state_spec import OptimizerSpec, StateRule
from zero_bnb.ds.aligned import BlockAligned, ZeroLayoutError
from zero_bnb.ds.versions import parameter_padding, uses_muon

__all__ = ["BlockAlignedBF16Optimizer", "BlockAlignedZeroOptimizer", "ZeroLayoutError"]

logger = logging.getLogger(__name__)


class BlockAlignedZeroOptimizer(BlockAligned, DeepSpeedZeroOptimizer):
    """``DeepSpeedZeroOptimizer`` whose partitions hold whole quantization blocks.

    Built by :class:`zero_bnb.ds.engine.ZeroBnbEngine` with DeepSpeed's own arguments plus the
    optimizer's declared state layout (``zero_bnb_spec``) and the user's replication rule
    (``zero_bnb_rule``).
    """

    def __init__(self, init_optimizer, *args, zero_bnb_spec: OptimizerSpec, zero_bnb_rule: StateRule, **kwargs):
        self._prepare_block_alignment(zero_bnb_spec, zero_bnb_rule, kwargs.get("dp_process_group"))
        # DeepSpeed's constructor calls flatten_dense_tensors_aligned for the parameters.
        self._zero_bnb_flattening_params = True
        try:
            super().__init__(init_optimizer, *args, **kwargs)
        finally:
            self._zero_bnb_flattening_params = False
        self._check_layout()

    def flatten_dense_tensors_aligned(self, tensor_list, alignment, *args, **kwargs):
        """Pad each flat parameter group to whole blocks per rank (DeepSpeed asks for ``2 * dp``).

        Only the parameter flattening in ``__init__`` is changed; DeepSpeed also calls this to
        pad the last rank's gradients to the partition size, which must stay as it is. The other
        arguments (``use_cpu_data``; ``param_padding`` since DeepSpeed 0.19.7) pass through as given.
        """
        if self._zero_bnb_flattening_params:
            alignment = self.block_alignment(alignment)
        return super().flatten_dense_tensors_aligned(tensor_list, alignment, *args, **kwargs)

    def group_params(self, group_index: int) -> list[torch.nn.Parameter]:
        return self.round_robin_bit16_groups[group_index]

    def master_partition(self, group_index: int) -> torch.Tensor:
        return self.single_partition_of_fp32_groups[group_index]

    def _check_layout(self) -> None:
        if self.round_robin_gradients:
            raise ZeroLayoutError(
                "zero_optimization.round_robin_gradients=true reorders parameters by DP size, so a checkpoint "
                "could not be re-split at another DP size; set it to false for zero_bnb"
            )
        if any(any(padding) for padding in parameter_padding(self)):
            raise ZeroLayoutError(
                "zero_optimization.parameter_alignment=true inserts padding between parameters; set it to false "
                "for zero_bnb"
            )
        if self.has_moe_layers:
            raise ZeroLayoutError("mixture-of-experts layers are not supported by zero_bnb")
        self._check_partitions([flat.numel() for flat in self.bit16_groups_flat], list(self.partition_size))
        logger.debug(
            "zero_bnb: block-aligned ZeRO partitions: %s",
            [(self.geometry(i).numel, self.geometry(i).partition_numel) for i in range(self.num_groups)],
        )


class BlockAlignedBF16Optimizer(BlockAligned, BF16_Optimizer):
    """DeepSpeed's ``BF16_Optimizer`` (bf16 weights, fp32 gradient accumulation) with block-aligned partitions."""

    def __init__(self, init_optimizer, *args, zero_bnb_spec: OptimizerSpec, zero_bnb_rule: StateRule, **kwargs):
        self._prepare_block_alignment(zero_bnb_spec, zero_bnb_rule, kwargs.get("dp_process_group"))
        super().__init__(init_optimizer, *args, **kwargs)
        self._check_layout()

    def _flatten_dense_tensors_aligned(self, tensor_list, alignment):
        return super()._flatten_dense_tensors_aligned(tensor_list, self.block_alignment(alignment))

    def group_params(self, group_index: int) -> list[torch.nn.Parameter]:
        return self.bf16_groups[group_index]

    def master_partition(self, group_index: int) -> torch.Tensor:
        return self.fp32_groups_flat_partition[group_index]

    def _check_layout(self) -> None:
        if self.has_moe_layers:
            raise ZeroLayoutError("mixture-of-experts layers are not supported by zero_bnb")
        if uses_muon(self):
            raise ZeroLayoutError("DeepSpeed's Muon optimizer is not supported by zero_bnb")
        if any(group is not self.dp_process_group for group in self.real_dp_process_group):
            raise ZeroLayoutError("per-group data-parallel process groups (MoE) are not supported by zero_bnb")
        self._check_partitions([flat.numel() for flat in self.bf16_groups_flat],
                               [flat.numel() // self.dp_size for flat in self.bf16_groups_flat])
