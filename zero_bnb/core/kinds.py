"""How each kind of optimizer state is split across ranks and merged back: the one place for it.

Element-wise state has one entry per element of the flat group; block-wise state one entry
per quantization block. Both run along the last axis (leading axes, such as AdEMAMix's two
moments in one ``state1``, are carried whole). Every other kind (replicated, counter) is not
split at all. Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero_bnb.core.layout import GroupGeometry, ceil_div
from zero_bnb.core.state_spec import StateKind

__all__ = ["PARTITIONED", "all_finite", "is_partitioned", "non_finite_params", "local_range", "saved_length", "saved_ranges", "to_axis", "whole_length"]

#: Kinds split along the partition axis (the last one); the others are saved once, whole.
PARTITIONED = frozenset({StateKind.ELEMENTWISE, StateKind.BLOCKWISE})


def is_partitioned(kind: StateKind) -> bool:
    """Whether state of ``kind`` is split across ranks along its last axis."""
    return kind in PARTITIONED


def _require(kind: StateKind) -> None:
    if kind not in PARTITIONED:
        raise ValueError(f"{kind.value} state is not split across ranks")


def to_axis(kind: StateKind, start: int, end: int, block_size: int) -> tuple[int, int]:
    """The element range ``[start, end)`` on ``kind``'s axis (blocks touched, for block-wise state)."""
    _require(kind)
    if kind is StateKind.ELEMENTWISE:
        return start, end
    return start // block_size, ceil_div(end, block_size)


def local_range(kind: StateKind, geometry: GroupGeometry, rank: int) -> tuple[int, int]:
    """The global range of ``kind``'s axis that ``rank`` holds real entries of."""
    _require(kind)
    return geometry.element_range(rank) if kind is StateKind.ELEMENTWISE else geometry.block_range(rank)


def saved_length(kind: StateKind, geometry: GroupGeometry, rank: int) -> int:
    """How many real (non-padding) entries of ``kind``'s axis ``rank`` saves."""
    start, end = local_range(kind, geometry, rank)
    return end - start


def whole_length(kind: StateKind, numel: int, block_size: int) -> int:
    """Entries of ``kind``'s axis for a whole group of ``numel`` elements."""
    _require(kind)
    return numel if kind is StateKind.ELEMENTWISE else ceil_div(numel, block_size)


def saved_ranges(kind: StateKind, element_ranges: Sequence[tuple[int, int]],
                 block_ranges: Sequence[tuple[int, int]]) -> Sequence[tuple[int, int]]:
    """The saved ranges (one per shard) on ``kind``'s axis, from a manifest group's two lists."""
    _require(kind)
    return element_ranges if kind is StateKind.ELEMENTWISE else block_ranges


_SCAN_CHUNK = 1 << 24


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN/Inf (scanned in chunks: no full-size temporary).

    A sum is one cheap pass and NaN/Inf always reach it, so a finite sum settles a chunk; only a
    chunk whose sum is not finite (NaN/Inf, or finite values overflowing) is checked element-wise.
    """
    if not tensor.is_floating_point():
        return True
    wide = torch.float32 if tensor.element_size() < 4 else None  # fp16/bf16 sums overflow in their own dtype
    return all(bool(torch.isfinite(chunk.sum(dtype=wide))) or bool(torch.isfinite(chunk).all())
               for chunk in tensor.reshape(-1).split(_SCAN_CHUNK))


def non_finite_params(tensor: torch.Tensor, kind: StateKind, axis_range: tuple[int, int], params: Sequence[Any],
                      block_size: int) -> list[str]:
    """Names of the parameters whose entries of ``tensor`` hold NaN/Inf.

    ``tensor`` holds the global range ``axis_range`` of ``kind``'s axis (its last one);
    ``params`` have ``name``, ``offset`` and ``numel`` in the flat group. One pass when all is finite.
    """
    if all_finite(tensor):
        return []
    first, last = axis_range
    found = []
    for param in params:
        start, end = to_axis(kind, param.offset, param.offset + param.numel, block_size)
        lo, hi = max(start, first), min(end, last)
        if lo < hi and not all_finite(tensor[..., lo - first : hi - first]):
            found.append(param.name)
    return found
