"""What zero_bnb needs from a DeepSpeed optimizer wrapper, whichever class DeepSpeed builds.

:class:`BlockAligned` is mixed into DeepSpeed's ZeRO optimizer and its ``BF16_Optimizer``
(:mod:`zero_bnb.ds.zero_optimizer`). It changes one thing in their partitioning - each flat
group is padded to a multiple of ``lcm(block_size, 2) * dp`` instead of ``2 * dp``, so every
partition starts on a quantization block (:mod:`zero_bnb.core.layout`) - and gives the checkpoint
code one vocabulary: DP rank and size, group geometry, parameter offsets, the fp32 master
partition that keys the base optimizer's state, and bitsandbytes' precision decision.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from zero_bnb.core.layout import GroupGeometry, largest_dp_with_partition
from zero_bnb.core.state_spec import OptimizerSpec, StateRule, param_in_group
from zero_bnb.ds.loss_scaler import live_wrapper
from zero_bnb.format.manifest import ParamEntry
from zero_bnb.format.wrapper_state import WRAPPER_SCALARS, plain_wrapper

__all__ = ["BlockAligned", "ZeroLayoutError"]

#: Largest DP size :meth:`BlockAligned.state_precision` looks at.
_MAX_DP = 4096


class ZeroLayoutError(ValueError):
    """A ZeRO setting would make the flat layout depend on the DP size."""


class BlockAligned:
    """Mixin: block-aligned flat groups and the layout queries zero_bnb's checkpoints use.

    Subclasses call :meth:`_prepare_block_alignment` before DeepSpeed's constructor and
    implement :meth:`group_params`, :meth:`master_partition` and :meth:`_check_layout`.
    """

    zero_bnb_spec: OptimizerSpec
    zero_bnb_rule: StateRule
    optimizer: torch.optim.Optimizer
    dp_process_group: Any

    def _prepare_block_alignment(self, spec: OptimizerSpec, rule: StateRule, dp_group) -> None:
        self.zero_bnb_spec = spec
        self.zero_bnb_rule = rule
        self._zero_bnb_dp = dist.get_world_size(group=dp_group)

    def block_alignment(self, alignment: int) -> int:
        """The padding multiple to use where DeepSpeed asks for ``alignment`` (``2 * dp``)."""
        return math.lcm(alignment, GroupGeometry(0, self._zero_bnb_dp, self.zero_bnb_spec.block_size).alignment)

    # -- implemented per DeepSpeed class --------------------------------------------------------

    def group_params(self, group_index: int) -> list[torch.nn.Parameter]:
        """The module parameters of flat group ``group_index``, in flat order (no padding between)."""
        raise NotImplementedError

    def master_partition(self, group_index: int) -> torch.Tensor:
        """This rank's fp32 master-weight partition of group ``group_index`` (padding included).

        It is also the parameter the base optimizer keys its state by.
        """
        raise NotImplementedError

    def _check_layout(self) -> None:
        raise NotImplementedError

    # -- queries ------------------------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return dist.get_rank(group=self.dp_process_group)

    @dp_rank.setter
    def dp_rank(self, value: int) -> None:  # BF16_Optimizer assigns the same value in its constructor
        if value != dist.get_rank(group=self.dp_process_group):
            raise ZeroLayoutError(f"DeepSpeed set dp_rank={value}, but this process is rank {self.dp_rank}")

    @property
    def dp_size(self) -> int:
        """Size of the data-parallel group the groups are partitioned over."""
        return self._zero_bnb_dp

    #: Whether the module's weights are partitions refreshed from the masters (stage 3) rather than whole
    #: tensors in DeepSpeed's model file (stages 1 and 2).
    module_weights_partitioned = False

    @property
    def num_groups(self) -> int:
        return len(self.optimizer.param_groups)

    def base_group_index(self, group_index: int) -> int:
        """The base optimizer's param group that holds flat group ``group_index`` (the same index at stages 1/2)."""
        return group_index

    def base_group(self, group_index: int) -> dict[str, Any]:
        """The base optimizer's param group dict that holds flat group ``group_index`` (live, not a copy)."""
        return self.optimizer.param_groups[self.base_group_index(group_index)]

    def geometry(self, group_index: int) -> GroupGeometry:
        """Partition geometry of flat group ``group_index`` at the current DP size."""
        numel = sum(p.numel() for p in self.group_params(group_index))
        return GroupGeometry(numel=numel, dp=self.dp_size, block_size=self.zero_bnb_spec.block_size)

    def param_entries(self, group_index: int, names: dict[torch.nn.Parameter, str]) -> tuple[ParamEntry, ...]:
        """Name, shape and flat offset of every parameter of group ``group_index``."""
        entries, offset = [], 0
        for index, param in enumerate(self.group_params(group_index)):
            entries.append(ParamEntry(names.get(param, f"<unnamed {index}>"), tuple(param.shape), offset))
            offset += param.numel()
        return tuple(entries)

    def trained_params(self) -> list[torch.nn.Parameter]:
        """Every module parameter this optimizer trains."""
        return [param for index in range(self.num_groups) for param in self.group_params(index)]

    def cast_masters_into_module(self) -> None:
        """Set every trained module weight to its fp32 master weight cast to the module's dtype.

        Each rank casts its master partition into its slice of the flat 16-bit (or fp32) group that
        the module's parameters are views of, then the ranks all-gather the slices: what DeepSpeed's
        own step does after updating its partition (``update_lp_params``). The cast is a plain
        ``copy_``, so the result is bit-identical to ``master.to(module dtype)`` per parameter.

        Collective: every rank of the data-parallel group must call it.
        """
        self.update_lp_params()

    #: Whether bitsandbytes' 8-bit vs fp32 decision is made on the whole parameter (stage 3: the same at every DP
    #: size) rather than on this rank's partition (stages 1 and 2).
    precision_on_whole_parameter = False

    def state_precision(self, group_index: int) -> dict[str, Any] | None:
        """How bitsandbytes decides 8-bit vs fp32 state for group ``group_index`` (``None`` for other optimizers).

        bitsandbytes keeps 8-bit state only for tensors of at least ``min_8bit_size`` elements,
        and under ZeRO the tensor is this rank's *partition*: the same group can be 8-bit at
        DP=2 and fp32 at DP=64. ``eight_bit_up_to_dp`` is the largest DP size that keeps it 8-bit.
        Where the decision is made on the whole parameter (:attr:`precision_on_whole_parameter`), it holds at every
        DP size: ``eight_bit_up_to_dp`` is ``None`` and ``decided_on`` says ``"whole parameter"``.
        """
        base = self.optimizer
        get_config = getattr(base, "get_config", None)
        if self.precision_on_whole_parameter:  # bitsandbytes' own rule, beneath the whole-parameter override
            get_config = getattr(get_config, "zero_bnb_original", None)
        if not callable(get_config):
            return None
        base_index = self.base_group_index(group_index)
        with param_in_group(base, base_index, self.master_partition(group_index)):
            config = get_config(base_index, 0, self.base_group(group_index))
        geometry = self.geometry(group_index)
        limit = config["min_8bit_size"]
        eight_bit = config["optim_bits"] == 8
        record = {"optim_bits": config["optim_bits"], "min_8bit_size": limit,
                  "partition_numel": geometry.partition_numel}
        if self.precision_on_whole_parameter:
            return record | {"eight_bit": eight_bit and geometry.numel >= limit, "eight_bit_up_to_dp": None,
                             "decided_on": "whole parameter"}
        up_to = largest_dp_with_partition(geometry.numel, geometry.block_size, limit, _MAX_DP) if eight_bit else None
        return record | {"eight_bit": eight_bit and geometry.partition_numel >= limit, "eight_bit_up_to_dp": up_to}

    def wrapper_scalars(self) -> dict[str, Any]:
        """The ZeRO wrapper's scalars a resume must restore (fp16 loss scaling), as plain data."""
        return plain_wrapper({name: getattr(self, name) for name in WRAPPER_SCALARS if hasattr(self, name)})

    def load_wrapper_scalars(self, plain: dict[str, Any]) -> None:
        """Restore :meth:`wrapper_scalars`' record, rebuilding DeepSpeed's loss-scaler object."""
        for name, value in live_wrapper(plain).items():
            setattr(self, name, value)

    def relink_state_views(self) -> None:
        """Point DeepSpeed's per-parameter views of the optimizer state (``param._hp_mapping.optim_fragment``, which
        ``safe_get_full_optimizer_state`` reads) at the state a load just put in place.

        ZeRO-1/2 and BF16_Optimizer build those views once, at the first step, as narrows of the state tensors: a
        load that replaces the state left them on the replaced tensors, which stayed alive (2 B/param of 8-bit
        moments) and were read back as stale values. Where every partition has state the views are rebuilt on the
        new tensors; otherwise they are dropped and DeepSpeed builds them at the next step. Stage 3 keeps no such
        views. Local: no collectives.
        """
        if not getattr(self, "_hp_optimizer_states_linked", False):
            return  # not linked yet: DeepSpeed links at the next step, to whatever state is there then
        state = self.optimizer.state
        if all(self.master_partition(index) in state for index in range(self.num_groups)):
            self._hp_optimizer_states_linked = False
            self._lazy_init_hp_params_optimizer_state()
            return
        for group in getattr(self, "bit16_groups", None) or getattr(self, "bf16_groups", None) or []:
            for param in group:
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is not None:
                    mapping.optim_fragment = {}
        self._hp_optimizer_states_linked = False

    def _check_partitions(self, flat_numels: list[int], partition_sizes: list[int]) -> None:
        for index in range(self.num_groups):
            geometry = self.geometry(index)
            if flat_numels[index] != geometry.padded_numel or partition_sizes[index] != geometry.partition_numel:
                raise ZeroLayoutError(
                    f"flat group {index} has {flat_numels[index]} elements and partitions of {partition_sizes[index]}, "
                    f"but block-aligned partitioning expects {geometry.padded_numel} and {geometry.partition_numel}; "
                    f"this DeepSpeed version partitions differently from the supported range"
                )
