"""A saved checkpoint's groups in memory, every tensor whole (what a DP=1 rank would hold, no padding).

Used by the offline tools (inspect, export, conversion) and by regrouping a checkpoint into
another grouping of the same parameters. Local, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zero_bnb.checkpoint.restore import SavedState, gather_range
from zero_bnb.core import quant
from zero_bnb.core.kinds import is_partitioned, saved_ranges, whole_length
from zero_bnb.core.state_spec import OptimizerSpec, StateKind
from zero_bnb.format.manifest import MASTER_KEY, StateEntry

__all__ = ["FullGroup", "gather_full", "moments", "per_parameter"]


@dataclass
class FullGroup:
    """One flat parameter group, every tensor whole.

    ``state`` holds element-wise tensors of ``numel`` elements, block-wise ones of
    ``ceil(numel / block_size)`` blocks, replicated tensors and counters; ``states`` says
    which is which (as in a manifest).
    """

    numel: int
    params: tuple  # tuple[ParamEntry, ...]
    states: tuple[StateEntry, ...]
    fp32: torch.Tensor
    state: dict[str, Any]
    param_group: dict[str, Any]


def gather_full(saved: SavedState) -> list[FullGroup]:
    """Every group of ``saved`` (a verified zero_bnb or stock checkpoint) merged into whole tensors."""
    groups = []
    block_size = saved.manifest.block_size
    for index, entry in enumerate(saved.manifest.groups):
        record = saved.replicated.groups[index]
        fp32 = torch.empty(entry.numel, dtype=torch.float32)
        gather_range(saved, index, MASTER_KEY, entry.element_ranges, (0, entry.numel), fp32)
        state: dict[str, Any] = {}
        for item in entry.states:
            if is_partitioned(item.kind):
                length = whole_length(item.kind, entry.numel, block_size)
                state[item.key] = torch.empty(*item.lead, length, dtype=getattr(torch, item.dtype))
                ranges = saved_ranges(item.kind, entry.element_ranges, entry.block_ranges)
                gather_range(saved, index, item.key, ranges, (0, length), state[item.key])
            elif item.kind is StateKind.REPLICATED:
                state[item.key] = record.replicated[item.key]
            else:
                state[item.key] = record.counters[item.key]
        groups.append(FullGroup(entry.numel, entry.params, entry.states, fp32, state, dict(record.param_group)))
    return groups


def moments(group: FullGroup, spec: OptimizerSpec, block_size: int) -> dict[str, torch.Tensor]:
    """The group's moments as whole fp32 tensors under their universal names (``exp_avg``, ...).

    8-bit states are dequantized with their own ``absmax`` and map (exact: the values the
    optimizer itself would use).
    """
    result = {}
    for key, name in spec.moment_names.items():
        if key not in group.state:
            continue
        result[name] = quant.state_values(group.state, key, spec.triple_for(key), block_size)
    return result


def per_parameter(group: FullGroup, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Cut a whole flat tensor of ``group`` into its parameters, in their shapes (leading axes kept)."""
    return {p.name: flat[..., p.offset : p.offset + p.numel].reshape(*flat.shape[:-1], *p.shape)
            for p in group.params}
