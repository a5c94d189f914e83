"""How each kind of optimizer state is split across ranks and merged back: the one place for it.

Element-wise state has one entry per element of the flat group; block-wise state one entry
per quantization block. Both run along the last axis (leading axes, such as AdEMAMix's two
moments in one ``state1``, are carried whole). Every other kind (replicated, counter) is not
split at all. Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from zero_bnb.core.layout import GroupGeometry, ceil_div
from zero_bnb.core.state_spec import StateKind

__all__ = ["PARTITIONED", "is_partitioned", "local_range", "saved_length", "saved_ranges", "to_axis", "whole_length"]

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
