"""Property tests of the stage-3 per-parameter geometry (pure arithmetic, no processes)."""

from __future__ import annotations

import pytest
from deepspeed.utils.zero_to_fp32 import zero3_partitioned_param_info
from hypothesis import given
from hypothesis import strategies as st

from zero_bnb.core.layout import GroupGeometry, plan_copy
from zero_bnb.core.stage3 import gathered_numel, padding_size, stock_slice_ranges

BLOCK = 256
numels = st.integers(min_value=0, max_value=300_000)
dps = st.integers(min_value=1, max_value=64)


def _slice(numel: int, dp: int, rank: int) -> tuple[int, int]:
    """What DeepSpeed's ``_partition_param`` copies for ``rank`` once the parameter is padded by ``padding_size``."""
    size = (numel + padding_size(numel, dp, BLOCK)) // dp
    return min(rank * size, numel), min((rank + 1) * size, numel)


@given(numels, dps)
def test_every_slice_starts_on_a_block_and_the_slices_tile_the_parameter(numel, dp):
    geometry = GroupGeometry(numel, dp, BLOCK)
    padded = numel + padding_size(numel, dp, BLOCK)
    assert padded % dp == 0 and (padded // dp) % BLOCK == 0
    assert padded // dp == geometry.partition_numel
    assert 0 <= padding_size(numel, dp, BLOCK) < geometry.alignment
    ranges = [_slice(numel, dp, rank) for rank in range(dp)]
    assert ranges == geometry.element_ranges()
    assert all(start % BLOCK == 0 for start, end in ranges if end > start)
    assert sum(end - start for start, end in ranges) == numel
    assert gathered_numel(geometry.partition_numel, dp) == padded


@given(numels, dps, dps)
def test_block_k_covers_the_same_elements_at_every_dp_size(numel, dp_a, dp_b):
    """A block of one rank's slice is a block of the parameter at any DP size: codes and absmax move as they are."""
    blocks = {}
    for dp in (dp_a, dp_b):
        geometry = GroupGeometry(numel, dp, BLOCK)
        for (start, end), (first, last) in zip(geometry.element_ranges(), geometry.block_ranges()):
            for block in range(first, last):
                local = block * BLOCK - start  # where the block starts inside this rank's slice
                assert local % BLOCK == 0 and 0 <= local < max(end - start, 1)
                covered = (block * BLOCK, min((block + 1) * BLOCK, numel))
                assert blocks.setdefault(block, covered) == covered
    assert sorted(blocks) == list(range(-(-numel // BLOCK)))


@given(numels, dps, dps)
def test_a_slice_at_one_dp_size_is_filled_from_the_slices_of_another(numel, saved_dp, loaded_dp):
    saved = GroupGeometry(numel, saved_dp, BLOCK)
    loaded = GroupGeometry(numel, loaded_dp, BLOCK)
    for rank in range(loaded_dp):
        start, end = loaded.element_range(rank)
        segments = plan_copy(saved.element_ranges(), (start, end))
        assert sum(s.length for s in segments) == end - start
        blocks = plan_copy(saved.block_ranges(), loaded.block_range(rank))
        assert all(s.src_offset >= 0 for s in blocks)


@given(numels, dps)
def test_stock_slices_are_deepspeeds_and_tile_the_parameter(numel, dp):
    """Stock stage 3's slices (what the rescue of a stock checkpoint reads): DeepSpeed's own arithmetic."""
    size, padding = zero3_partitioned_param_info(numel, dp)
    ranges = stock_slice_ranges(numel, dp)
    assert size * dp == numel + padding and len(ranges) == dp
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(end == start for (_, end), (start, _) in zip(ranges, ranges[1:]))  # consecutive, no gap
    assert all(start == min(rank * size, numel) and end - start <= size for rank, (start, end) in enumerate(ranges))


@pytest.mark.parametrize("numel, dp, partition", [(9600, 2, 4864), (9600, 3, 3328), (9600, 1, 9728), (90, 2, 256),
                                                   (15360, 2, 7680), (0, 4, 0)])
def test_known_partition_sizes(numel, dp, partition):
    assert GroupGeometry(numel, dp, BLOCK).partition_numel == partition


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="dp must be >= 1"):
        padding_size(10, 0, BLOCK)
    with pytest.raises(ValueError, match="gathered_numel"):
        gathered_numel(-1, 2)
    with pytest.raises(ValueError, match="stock_slice_ranges"):
        stock_slice_ranges(10, 0)


def test_the_tools_take_every_ranks_stage3_model_file_and_refuse_a_gap(tmp_path):
    from zero_bnb.errors import CheckpointFormatError
    from zero_bnb.format.stock_files import model_file_of, model_states_files, stage3_model_states

    for rank in (0, 1, 2):
        (tmp_path / stage3_model_states(rank)).write_bytes(b"placeholder")
    assert sorted(model_states_files(str(tmp_path))) == [stage3_model_states(r) for r in (0, 1, 2)]
    assert model_file_of(str(tmp_path)) == (stage3_model_states(0), str(tmp_path / stage3_model_states(0)))
    (tmp_path / stage3_model_states(1)).unlink()
    with pytest.raises(CheckpointFormatError, match="one zero_pp_rank_<rank>_mp_rank_00_model_states.pt per DP rank"):
        model_states_files(str(tmp_path))


def test_a_checkpoint_is_stage3_by_its_model_file_name():
    from zero_bnb.format.stock_files import MODEL_STATES, is_stage3_model_file, stage3_model_states

    assert is_stage3_model_file(stage3_model_states(0)) and is_stage3_model_file(stage3_model_states(12))
    for other in (MODEL_STATES, "zero_pp_rank_07_mp_rank_00_model_states.pt", "zero_pp_rank__mp_rank_00_model_states.pt",
                  "zero_pp_rank_0_mp_rank_00_optim_states.pt", "model_states.pt"):
        assert not is_stage3_model_file(other), other
