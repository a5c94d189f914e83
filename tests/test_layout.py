"""Property tests of the block-aligned partition geometry and copy planning."""

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_bnb.core.layout import GroupGeometry, ceil_div, largest_dp_with_partition, plan_copy

numels = st.integers(min_value=0, max_value=200_000)
dps = st.integers(min_value=1, max_value=8)
block_sizes = st.sampled_from([1, 2, 3, 64, 100, 256, 2048])


@given(numel=numels, dp=dps, block=block_sizes)
def test_partitions_hold_whole_blocks_and_tile_the_group(numel, dp, block):
    g = GroupGeometry(numel=numel, dp=dp, block_size=block)
    assert g.partition_numel % block == 0
    assert g.partition_numel % 2 == 0  # DeepSpeed's 4-byte start alignment still holds
    assert g.padded_numel >= numel and g.padded_numel - numel < g.alignment
    assert all(g.partition_start(r) % block == 0 for r in range(dp))
    ranges = g.element_ranges()
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in pairwise(ranges))
    blocks = g.block_ranges()
    assert blocks[0][0] == 0 and blocks[-1][1] == g.num_blocks
    assert all(a[1] == b[0] for a, b in pairwise(blocks))


@given(numel=numels.filter(lambda n: n > 0), dp_a=dps, dp_b=dps, block=block_sizes, data=st.data())
def test_block_grid_does_not_depend_on_dp(numel, dp_a, dp_b, block, data):
    element = data.draw(st.integers(0, numel - 1))
    for dp in (dp_a, dp_b):
        g = GroupGeometry(numel=numel, dp=dp, block_size=block)
        rank = element // g.partition_numel
        start, _ = g.element_range(rank)
        # The block that holds the element, counted from the partition start, is global block element // block.
        assert g.block_range(rank)[0] + (element - start) // block == element // block


@given(numel=numels, dp=dps, block=block_sizes)
def test_padding_never_reaches_saved_ranges(numel, dp, block):
    g = GroupGeometry(numel=numel, dp=dp, block_size=block)
    assert sum(e - s for s, e in g.element_ranges()) == numel
    assert sum(e - s for s, e in g.block_ranges()) == ceil_div(numel, block)
    for rank in range(dp):
        s, e = g.element_range(rank)
        assert e - s <= g.partition_numel and e <= numel


def _save(global_values, ranges):
    return [global_values[s:e].clone() for s, e in ranges]


def _load(pieces, ranges, target):
    out = torch.full((target[1] - target[0],), -1, dtype=torch.int64)
    for seg in plan_copy(ranges, target):
        out[seg.dst_offset : seg.dst_offset + seg.length] = pieces[seg.source][seg.src_offset : seg.src_offset + seg.length]
    return out


@settings(max_examples=200)
@given(numel=st.integers(0, 20_000), dp_a=dps, dp_b=dps, block=block_sizes)
def test_merge_then_split_is_identity_for_elements_and_blocks(numel, dp_a, dp_b, block):
    saved, loaded = GroupGeometry(numel, dp_a, block), GroupGeometry(numel, dp_b, block)
    elements = torch.arange(numel)
    blocks = torch.arange(saved.num_blocks) * 7 + 3
    element_pieces = _save(elements, saved.element_ranges())
    block_pieces = _save(blocks, saved.block_ranges())
    rebuilt_elements, rebuilt_blocks = [], []
    for rank in range(dp_b):
        target = loaded.element_range(rank)
        rebuilt_elements.append(_load(element_pieces, saved.element_ranges(), target))
        rebuilt_blocks.append(_load(block_pieces, saved.block_ranges(), loaded.block_range(rank)))
        # The blocks a rank loads are exactly those that cover the elements it loads.
        b0, b1 = loaded.block_range(rank)
        if target[0] < target[1]:
            assert b0 == target[0] // block and b1 == ceil_div(target[1], block)
        else:
            assert b0 == b1
    assert torch.equal(torch.cat(rebuilt_elements), elements)
    assert torch.equal(torch.cat(rebuilt_blocks), blocks)


@given(numel=st.integers(1, 5000), dp=dps, data=st.data())
def test_plan_copy_opens_only_overlapping_sources(numel, dp, data):
    g = GroupGeometry(numel, dp, 256)
    start = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(start, numel))
    segments = plan_copy(g.element_ranges(), (start, end))
    assert sum(s.length for s in segments) == end - start
    assert [s.dst_offset for s in segments] == sorted(s.dst_offset for s in segments)
    for s in segments:
        lo, hi = g.element_ranges()[s.source]
        assert s.length > 0 and s.src_offset + s.length <= hi - lo


def test_plan_copy_rejects_gaps_and_out_of_range_targets():
    with pytest.raises(ValueError, match=r"tile \[0, total\)"):
        plan_copy([(0, 5), (6, 10)], (0, 3))
    with pytest.raises(ValueError, match=r"outside the saved range \[0, 10\)"):
        plan_copy([(0, 5), (5, 10)], (4, 11))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"numel": -1, "dp": 1, "block_size": 256}, "numel must be >= 0"),
     ({"numel": 1, "dp": 0, "block_size": 256}, "dp must be >= 1"),
     ({"numel": 1, "dp": 1, "block_size": 0}, "block_size must be >= 1")],
)
def test_geometry_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupGeometry(**kwargs)


def test_rank_outside_group_is_named():
    with pytest.raises(ValueError, match="rank 4 is outside the data-parallel group of size dp=4"):
        GroupGeometry(1000, 4, 256).element_range(4)


def test_known_example_from_design_notes():
    # 11312 elements at DP=2: stock DeepSpeed gives partitions of 5656 (22.1 blocks); block-aligned gives 5888.
    g = GroupGeometry(11312, 2, 256)
    assert g.partition_numel == 5888 and g.element_ranges() == [(0, 5888), (5888, 11312)]
    assert g.block_ranges() == [(0, 23), (23, 45)]


@given(st.integers(0, 10**7), st.sampled_from([1, 2, 64, 256, 4096]), st.integers(0, 10**6), st.integers(0, 600))
def test_largest_dp_with_partition_is_the_last_dp_a_scan_keeps(numel, block, at_least, max_dp):
    """The bisection gives what a scan of every DP size 1..max_dp gives (bitsandbytes' min_8bit_size edge)."""
    scan = max((dp for dp in range(1, max_dp + 1) if GroupGeometry(numel, dp, block).partition_numel >= at_least),
               default=None)
    assert largest_dp_with_partition(numel, block, at_least, max_dp) == scan
