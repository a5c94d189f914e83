"""Asynchronous saves (``zero_checkpoint_async``, issue 35): one real DP=2 launch (tests/async_scenarios.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from async_scenarios import asynchronous
from scenarios import result

from zero_bnb.checkpoint import background
from zero_bnb.checkpoint.background import BackgroundSaver, after_pending_saves
from zero_bnb.core.config import ZeroBnbConfigError, split_config
from zero_bnb.errors import CheckpointSaveError
from zero_bnb.testing.launch import run_distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("async")
    run_distributed(asynchronous, 2, str(workdir))
    return torch.load(workdir / "async.pt", weights_only=False)


def test_the_checkpoint_holds_the_state_at_the_call_not_what_training_did_next(ranks):
    assert result(ranks, "returned_while_pending") is True  # the call returned before the files were written
    assert result(ranks[:1], "state_differences") == []  # masters, 8-bit moments, counters bit for bit
    assert result(ranks, "weights_differ") == []  # module weights changed in place after the call did not leak in
    assert result(ranks, "client_state") == {"epoch": [3], "note": "at the call"}


def test_training_overlapping_the_background_commit_is_unaffected(ranks):
    # DP=2 all-reduces ran while the writers agreed and committed on their own process group
    assert result(ranks, "losses_overlapping") == result(ranks, "twin_losses")


def test_the_files_are_those_a_synchronous_save_writes(ranks):
    assert result(ranks, "same_files") is True
    for rank in (0, 1):
        assert ranks[rank][f"same_shard_bytes:{rank}"] is True, rank  # this rank's shard and the model file


def test_bf16_masters_derive_in_the_background_to_the_bytes_of_a_synchronous_save(ranks):
    assert set(result(ranks, "bf16_masters")) == {"module+low16"}, result(ranks, "bf16_masters")
    for rank in (0, 1):
        assert ranks[rank][f"bf16_same_bytes:{rank}"] is True, rank
    assert result(ranks[:1], "bf16_differences") == []


def test_the_call_blocks_for_less_than_the_background_write(ranks):
    for rank in (0, 1):
        blocked, background = ranks[rank][f"blocked_and_background:{rank}"]
        assert background is not None and blocked < background, (rank, blocked, background)


def test_back_to_back_saves_a_load_and_destroy_wait_for_a_pending_save(ranks):
    assert result(ranks[:1], "load_while_pending") == []
    assert result(ranks, "waits_listing") == (["latest", "one", "two", "zero_to_fp32.py"], "two")
    assert result(ranks, "verify_one") is None and result(ranks, "verify_two") is None
    assert result(ranks, "after_destroy") == (None, "three")


@pytest.mark.parametrize("call", ["wait", "save", "load"])
def test_a_background_failure_keeps_the_previous_checkpoint_and_is_raised_by_the_next_call(ranks, call):
    assert result(ranks, f"returned:{call}") is None  # the failing save itself returned: the write was later
    message = result(ranks, f"raised:{call}")
    assert message.startswith("CheckpointSaveError: saving checkpoint 'bad'"), message
    assert "injected: no space left on device" in message and "rank(s) [1]" in message
    assert "the previous checkpoint and 'latest' are unchanged" in message
    assert result(ranks, f"listing:{call}") == (["good", "latest", "zero_to_fp32.py"], "good")
    assert result(ranks, f"raised_once:{call}") is None


def test_a_full_disk_during_the_background_write_keeps_the_previous_checkpoint(ranks):
    assert result(ranks, "full_disk_returned") is None
    message = result(ranks, "full_disk_raised")
    assert message.startswith("CheckpointSaveError:") and "File too large" in message and "rank(s) [0]" in message
    assert result(ranks, "full_disk_listing") == (["good", "latest", "zero_to_fp32.py"], "good")
    assert result(ranks, "save_after_failures") is None
    assert result(ranks, "final_listing") == (["again", "good", "latest", "zero_to_fp32.py"], "again")


def test_staging_buffers_are_reused_and_bounded(ranks):
    assert result(ranks, "buffers_reused") is True
    for rank in (0, 1):
        assert ranks[rank]["held_bytes"] == ranks[rank]["staged_bytes"] > 0
    # a rank stages its shard (4 B masters + 2 B of 8-bit moments per parameter it owns, plus absmax) and its
    # module weights (4 B, fp32 here, per parameter it owns: on rank 0 views of DeepSpeed's model file, staged whole)
    params = result(ranks, "params")
    assert ranks[0]["staged_bytes"] / params <= 4 + (4 + 2) / 2 + 0.5, ranks[0]["staged_bytes"] / params
    assert ranks[1]["staged_bytes"] / params <= (4 + 4 + 2) / 2 + 0.5, ranks[1]["staged_bytes"] / params
    assert result(ranks, "bounded_save") is None
    assert result(ranks[:1], "bounded_differences") == []
    for rank in (0, 1):
        assert ranks[rank]["bounded_held"] <= 0.05 * 2**20, ranks[rank]["bounded_held"]


def test_deepspeeds_decoupled_writer_makes_saves_asynchronous_and_its_other_writers_are_refused_by_name(ranks):
    assert result(ranks, "decoupled_async") is True and result(ranks, "decoupled_verify") is None
    message = result(ranks, "fast_writer")
    assert message.startswith("ZeRORuntimeException:") and "checkpoint.writer 'FAST'" in message, message
    assert "remove checkpoint.writer" in message and "zero_checkpoint_async" in message


def test_the_switch_is_read_at_the_top_level_or_inside_zero_optimization():
    on, _ = split_config({"zero_optimization": {"stage": 2, "zero_checkpoint_async": True}})
    assert on.checkpoint_async is True and split_config({})[0].checkpoint_async is False
    with pytest.raises(ZeroBnbConfigError, match="zero_checkpoint_async must be true or false, got 'yes'"):
        split_config({"zero_checkpoint_async": "yes"})
    with pytest.raises(ZeroBnbConfigError, match="zero_checkpoint_async_max_staging_mb must be a non-negative"):
        split_config({"zero_checkpoint_async_max_staging_mb": -1})


def _saver_blocked_until(release: threading.Event, fail: bool = False) -> BackgroundSaver:
    saver = BackgroundSaver()
    background._SAVERS.add(saver)  # as its first process_group() call registers it

    def work():
        release.wait(10)
        if fail:
            raise OSError(28, "No space left on device")

    saver.start("T", work)
    return saver


def test_a_front_doors_deletion_waits_for_the_commit_and_is_dropped_if_the_save_fails():
    for fail in (False, True):
        release, deleted = threading.Event(), []
        saver = _saver_blocked_until(release, fail)
        after_pending_saves(lambda: deleted.append("old"), "the test's deletion")
        assert deleted == []  # not while the newer checkpoint is being written
        release.set()
        if fail:
            with pytest.raises(CheckpointSaveError, match="No space left on device"):
                saver.wait()
        else:
            saver.wait()
        assert deleted == ([] if fail else ["old"]), (fail, deleted)  # the older checkpoint is kept if the save failed
        after_pending_saves(lambda: deleted.append("now"), "the test's deletion")  # nothing pending: at once
        assert deleted[-1] == "now"
        background._SAVERS.discard(saver)
