"""Per-parameter block-aligned partitions for ZeRO stage 3.

Pure arithmetic, no DeepSpeed and no distributed calls; property-tested in ``tests/test_stage3_layout.py``.

ZeRO stage 3 partitions every *parameter*, not a flat group: rank ``r`` of ``dp`` holds elements
``[r * s, (r + 1) * s)`` of each parameter, where stock DeepSpeed takes ``s = ceil(numel / dp)``
(``partition_parameters.py``, ``_padding_size``). Those slices start at arbitrary elements, so the
256-element quantization blocks of an 8-bit optimizer fall at other places for every DP size.

zero_bnb pads each parameter to a multiple of ``lcm(block_size, 2) * dp`` instead: ``s`` is then a
multiple of the block size and every slice starts on a block boundary of its parameter. That is the
stage-1/2 geometry of :class:`~zero_bnb.core.layout.GroupGeometry` applied to a group of one parameter,
so a stage-3 parameter *is* a ``GroupGeometry`` and everything built on it (saved ranges, block ranges,
:func:`~zero_bnb.core.layout.plan_copy`) applies unchanged. Block ``k`` of a parameter covers its elements
``[k * block_size, (k + 1) * block_size)`` at every DP size.

The optimizer steps one flat fp32 tensor per *sub-group*; zero_bnb makes each sub-group hold exactly one
parameter's slice, so the optimizer's state tensors are that slice's state and the checkpoint stores one
group per parameter, whatever the DP size.
"""

from __future__ import annotations

from zero_bnb.core.layout import GroupGeometry, ceil_div

__all__ = ["gathered_numel", "padding_size", "stock_slice_ranges"]


def padding_size(numel: int, dp: int, block_size: int) -> int:
    """Elements DeepSpeed must append to the parameter so every rank's slice is whole blocks
    (what ``Init._padding_size`` returns for a zero_bnb parameter)."""
    return GroupGeometry(numel, dp, block_size).padded_numel - numel


def gathered_numel(partition_numel: int, dp: int) -> int:
    """Length of the all-gather buffer of one parameter: every rank's whole slice, padding included."""
    if partition_numel < 0 or dp < 1:
        raise ValueError(f"gathered_numel needs partition_numel >= 0 and dp >= 1, got {partition_numel} and {dp}")
    return partition_numel * dp


def stock_slice_ranges(numel: int, dp: int) -> tuple[tuple[int, int], ...]:
    """Per rank, the elements ``[start, end)`` of one parameter that stock DeepSpeed's stage 3 gives rank ``r``
    of ``dp``: slices of ``ceil(numel / dp)`` (``partition_parameters.py``, ``_padding_size``), the last ones
    cut at ``numel`` (possibly empty). Each rank's flat sub-group holds its whole slice, padding included, so the
    next parameter starts ``ceil(numel / dp)`` elements later on every rank."""
    if numel < 0 or dp < 1:
        raise ValueError(f"stock_slice_ranges needs numel >= 0 and dp >= 1, got {numel} and {dp}")
    size = ceil_div(numel, dp)
    return tuple((min(r * size, numel), min((r + 1) * size, numel)) for r in range(dp))
