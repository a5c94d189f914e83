"""Nothing kept alive after a load: the replaced optimizer state is freed, and DeepSpeed's per-parameter views of
the state (``safe_get_full_optimizer_state`` reads them) show the live state, never the replaced one."""

from __future__ import annotations

import pytest
import torch
from memory_scenarios import CASES, load_keeps_nothing_alive

from zero_bnb.testing.launch import run_distributed

pytestmark = pytest.mark.launch


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("memory")
    run_distributed(load_keeps_nothing_alive, 2, str(workdir))
    return torch.load(workdir / "memory_dp2.pt", weights_only=False)


@pytest.mark.parametrize("case", list(CASES))
def test_a_load_frees_the_replaced_state_and_views_show_the_live_one(memory_runs, case):
    record = memory_runs[case]
    assert record["old_tensors"] > 0 and record["old_bytes"] > 0
    # Before the fix the pre-load state1/state2 (1 B/param each) stayed alive through the views: 2 B/param.
    assert record["kept_alive_bytes"] == 0, record
    assert record["stale_views"] == [], record
    if case.endswith("zero3"):
        assert record["views_before"] == record["views_after"] == []  # stage 3 reads its state directly
    else:
        # Every view DeepSpeed had is there again, on the live state (DeepSpeed links those of groups that had state
        # when it first looked; the relink after a load covers every group).
        assert record["views_before"] and set(record["views_before"]) <= set(record["views_after"]), record
        assert len(record["views_after"]) >= len(record["views_before"]), record


@pytest.mark.parametrize("case", list(CASES))
def test_describe_shows_the_8bit_state_a_user_can_assert(memory_runs, case):
    described = memory_runs[case]["described"]
    assert described["optimizer"] == "bitsandbytes.optim.adam.Adam8bit" and described["dp_size"] == 2
    assert described["zero_stage"] == (3 if case.endswith("zero3") else 2 if "zero2" in case else 1)
    assert described["eight_bit_groups"] and len(described["groups"]) >= 3, described
    group = described["groups"][described["eight_bit_groups"][0]]
    assert group["state"]["state1"]["dtype"] == "uint8" and group["state"]["state1"]["kind"] == "elementwise"
    assert group["state"]["absmax1"]["kind"] == "blockwise" and group["state"]["step"]["kind"] == "counter"
    assert 0 < described["state_bytes_per_param"] < 4  # 2 B/param of 8-bit moments, fp32 ones in small groups


def test_a_load_says_so_on_rank_0_in_one_line(memory_runs):
    ranks = memory_runs["fp32-zero1"]["load_log"]  # rank 0's record (the results file is rank 0's)
    assert len(ranks) == 1, ranks
    assert "saved at DP=2 into DP=2 at ZeRO stage 1 (same partitions); optimizer state loaded; rank 0's optimizer " \
           "state 8-bit in " in ranks[0], ranks[0]
