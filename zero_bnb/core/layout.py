"""Block-aligned partition geometry of a ZeRO flat parameter group.

Pure arithmetic, no DeepSpeed and no distributed calls: every function here can run on
any process (or none) and is property-tested in ``tests/test_layout.py``.

ZeRO stage 1 flattens each parameter group into one 1-D buffer, pads it, and gives each of
the ``dp`` data-parallel ranks an equal, contiguous partition. Stock DeepSpeed pads the
buffer to a multiple of ``2 * dp`` elements only, so partitions start at arbitrary
offsets and an 8-bit optimizer's per-partition quantization blocks do not line up across
DP sizes. Here the buffer is padded to a multiple of ``block_size * dp`` (more exactly
``lcm(block_size, 2) * dp``), so every partition starts on a block boundary and block
``k`` always covers global elements ``[k * block_size, (k + 1) * block_size)``, whatever
the DP size. That is what makes 8-bit codes and their per-block ``absmax`` mergeable.

Two coordinate systems appear below:

* *element space* ``[0, numel)``: the real parameters of the group, in flat order;
* *block space* ``[0, num_blocks)``: one entry per quantization block of element space.

Padding lives past ``numel`` only; it never appears in a saved range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GroupGeometry",
    "Segment",
    "ceil_div",
    "largest_dp_with_partition",
    "plan_copy",
]

#: DeepSpeed aligns each partition start to 4 bytes, i.e. 2 elements of a 16-bit dtype.
DEEPSPEED_START_ALIGNMENT = 2


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ``a`` and positive ``b``, in exact integer arithmetic."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """Where each rank's partition of one flat parameter group lies.

    Attributes:
        numel: real elements of the group (sum of its parameters' ``numel``), no padding.
        dp: data-parallel world size the group is partitioned over.
        block_size: quantization block size of the optimizer state (256 for bitsandbytes
            >= 0.44). A partition always holds a whole number of blocks.
    """

    numel: int
    dp: int
    block_size: int

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"GroupGeometry.numel must be >= 0, got numel={self.numel}")
        if self.dp < 1:
            raise ValueError(f"GroupGeometry.dp must be >= 1, got dp={self.dp}")
        if self.block_size < 1:
            raise ValueError(f"GroupGeometry.block_size must be >= 1, got block_size={self.block_size}")

    @property
    def alignment(self) -> int:
        """The padded group size is a multiple of this: one whole block per rank, 4-byte starts."""
        return math.lcm(self.block_size, DEEPSPEED_START_ALIGNMENT) * self.dp

    @property
    def padded_numel(self) -> int:
        """Length of the flat buffer after padding (what DeepSpeed allocates)."""
        return ceil_div(self.numel, self.alignment) * self.alignment

    @property
    def partition_numel(self) -> int:
        """Elements in every rank's partition, padding included; a multiple of ``block_size``."""
        return self.padded_numel // self.dp

    @property
    def num_blocks(self) -> int:
        """Blocks that hold at least one real element (the saved block-wise length)."""
        return ceil_div(self.numel, self.block_size)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.dp:
            raise ValueError(f"rank {rank} is outside the data-parallel group of size dp={self.dp}")

    def partition_start(self, rank: int) -> int:
        """First global element of ``rank``'s partition (a multiple of ``block_size``)."""
        self._check_rank(rank)
        return rank * self.partition_numel

    def element_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the real elements ``rank`` owns; empty when it holds only padding."""
        start = min(self.partition_start(rank), self.numel)
        end = min(start + self.partition_numel, self.numel)
        return start, end

    def block_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the blocks that hold real elements of ``rank``'s partition."""
        start, end = self.element_range(rank)
        if start == end:  # only padding: after every real block
            return self.num_blocks, self.num_blocks
        return start // self.block_size, ceil_div(end, self.block_size)

    def element_ranges(self) -> list[tuple[int, int]]:
        """``element_range`` of every rank, in rank order; they tile ``[0, numel)``."""
        return [self.element_range(r) for r in range(self.dp)]

    def block_ranges(self) -> list[tuple[int, int]]:
        """``block_range`` of every rank, in rank order; they tile ``[0, num_blocks)``."""
        return [self.block_range(r) for r in range(self.dp)]


@dataclass(frozen=True, slots=True)
class Segment:
    """Copy ``length`` items from source ``source`` at ``src_offset`` to ``dst_offset``.

    Offsets are relative to the start of the source range and of the target range.
    """

    source: int
    src_offset: int
    dst_offset: int
    length: int


def largest_dp_with_partition(numel: int, block_size: int, at_least: int, max_dp: int) -> int | None:
    """The largest DP size up to ``max_dp`` at which a group of ``numel`` elements still gives every rank a partition
    of at least ``at_least`` elements (:attr:`GroupGeometry.partition_numel`), or ``None`` when even DP=1 does not.

    ``partition_numel`` is ``ceil(numel / (a * dp)) * a`` for a fixed ``a``: it never grows with ``dp``, so a
    bisection finds the edge (what bitsandbytes' ``min_8bit_size`` decides per partition: the largest DP size that
    keeps a group's state 8-bit).
    """
    def enough(dp: int) -> bool:
        return GroupGeometry(numel, dp, block_size).partition_numel >= at_least

    if max_dp < 1 or not enough(1):
        return None
    low, high = 1, max_dp
    while low < high:
        middle = (low + high + 1) // 2
        if enough(middle):
            low = middle
        else:
            high = middle - 1
    return low


def plan_copy(sources: Sequence[tuple[int, int]], target: tuple[int, int]) -> list[Segment]:
    """Plan how to fill ``target`` from the saved ``sources`` that overlap it.

    Args:
        sources: ``[start, end)`` global ranges of the saved pieces, one per saving rank, in
            rank order; together they must tile ``[0, total)`` without gaps or overlaps.
        target: the ``[start, end)`` global range to fill; it must lie inside ``[0, total)``.

    Returns:
        Segments in increasing ``dst_offset`` order whose lengths add up to the target's
        length. Only sources that overlap the target appear, so a loader opens only those.
    """
    position = 0
    for index, (start, end) in enumerate(sources):
        if start != position or end < start:
            raise ValueError(
                f"saved ranges must tile [0, total) in order; range {index} is [{start}, {end}) "
                f"but the previous one ended at {position}: {list(sources)}"
            )
        position = end
    t_start, t_end = target
    if not 0 <= t_start <= t_end <= position:
        raise ValueError(f"target range [{t_start}, {t_end}) is outside the saved range [0, {position})")

    segments = []
    for index, (start, end) in enumerate(sources):
        lo, hi = max(start, t_start), min(end, t_end)
        if lo < hi:
            segments.append(Segment(index, lo - start, lo - t_start, hi - lo))
    return segments
