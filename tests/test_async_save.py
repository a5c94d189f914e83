"""Asynchronous saves (``zero_checkpoint_async``, issue 35): two real DP=2 launches (tests/async_scenarios.py, the
break-it probe tests/async_probe_scenarios.py) and two real ``torchrun`` scripts (tests/async_torchrun_scenarios.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from async_probe_scenarios import CASES, probe
from async_scenarios import asynchronous
from scenarios import result

from zero_bnb.checkpoint import pending
from zero_bnb.checkpoint.background import BackgroundSaver
from zero_bnb.checkpoint.pending import after_pending_saves
from zero_bnb.core.config import ZeroBnbConfigError, split_config
from zero_bnb.errors import CheckpointSaveError
import zero_bnb
import zero_bnb.testing.launch as launch
from zero_bnb.testing.launch import run_distributed

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=95)]

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("async")
    run_distributed(asynchronous, 2, str(workdir))
    return torch.load(workdir / "async.pt", weights_only=False)


def test_the_checkpoint_holds_the_state_at_the_call_not_what_training_did_next(ranks):
    assert result(ranks, "returned_while_pending") is True  # the call returned before the files were written
    assert result(ranks[:1], "state_differences") == []  # masters, 8-bit moments, counters bit for bit
    assert result(ranks[:1], "bnb_differences") == []  # the same through bitsandbytes' view of every rank's state
    assert len(result(ranks[:1], "bnb_checked")) == 6  # the toy's 6 parameters
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
    assert result(ranks[:1], "bf16_bnb_differences") == []


def test_the_call_blocks_for_less_than_the_background_write(ranks):
    for rank in (0, 1):
        blocked, background = ranks[rank][f"blocked_and_background:{rank}"]
        assert background is not None and blocked < background, (rank, blocked, background)


def test_back_to_back_saves_a_load_and_destroy_wait_for_a_pending_save(ranks):
    assert result(ranks[:1], "load_while_pending") == []
    assert result(ranks, "waits_listing") == (["latest", "one", "two", "zero_to_fp32.py"], "two")
    assert result(ranks, "verify_one") is None and result(ranks, "verify_two") is None
    assert result(ranks, "after_destroy") == (None, "three")
    # a pending save's failure is raised by destroy() (once), on every rank: never lost
    for record in ranks:
        assert record["destroy_raises"].startswith("CheckpointSaveError") and "'four'" in record["destroy_raises"], \
            record["destroy_raises"]
    assert result(ranks, "destroy_raises_once") == (None, "three")


def test_a_save_inside_a_save_is_refused_and_the_interrupted_save_fails_cleanly(ranks):
    # A "save on SIGTERM" handler interrupting a save: the handler's call is refused at once (before any collective),
    # and the save it interrupted fails on every rank like any save meeting an error, the previous one intact.
    [inner] = result(ranks, "interrupted_inner")
    assert inner.startswith("CheckpointUsageError: save_checkpoint was called while this engine's save_checkpoint is "
                            "still running (this very thread: a signal handler or callback interrupted it)"), inner
    assert "set a flag in the handler and save after the training step" in inner
    outer = result(ranks, "interrupted_outer")
    assert outer.startswith("CheckpointSaveError: saving checkpoint 'outer'") and "signal handler's save" in outer
    assert result(ranks, "interrupted_listing") == (["base", "latest", "zero_to_fp32.py"], "base")


def test_a_load_from_another_thread_during_a_save_is_refused_and_the_save_completes(ranks):
    [other] = result(ranks, "threaded_other")
    assert other.startswith("CheckpointUsageError: load_checkpoint was called while this engine's save_checkpoint is "
                            "still running (thread 'MainThread'; this call came from thread 'second-caller')"), other
    assert result(ranks, "threaded_outer") is None
    assert result(ranks, "threaded_listing") == "threaded" and result(ranks, "threaded_verify") is None


@pytest.mark.parametrize("call", ["wait", "save", "load"])
def test_a_background_failure_keeps_the_previous_checkpoint_and_is_raised_by_the_next_call(ranks, call):
    assert result(ranks, f"returned:{call}") is None  # the failing save itself returned: the write was later
    message = result(ranks, f"raised:{call}")
    # Issue 42: the next save_checkpoint("next") raised the old save's error without saying "next" was not written.
    said = {"wait": "CheckpointSaveError: saving checkpoint 'bad'",
            "save": "CheckpointSaveError: checkpoint 'next' was not saved (nothing of it was written); call "
                    "save_checkpoint again to save it: the previous asynchronous save failed, and is reported here "
                    "(once). saving checkpoint 'bad'",
            "load": "CheckpointSaveError: nothing was loaded (the engine is as it was); call load_checkpoint again to "
                    "load: the previous asynchronous save failed, and is reported here (once). saving checkpoint 'bad'"}
    assert message.startswith(said[call]), message
    assert "injected: no space left on device" in message and "rank(s) [1]" in message
    assert "the previous checkpoint and 'latest' are unchanged" in message
    assert result(ranks, f"listing:{call}") == (["good", "latest", "zero_to_fp32.py"], "good")
    assert result(ranks, f"raised_once:{call}") is None


def test_a_staging_folder_removed_during_the_background_write_is_named_as_the_cause(ranks):
    # Issue 42: it was reported as "every rank must save into the same shared folder".
    assert result(ranks, "staging_removed_returned") is None
    message = result(ranks, "staging_removed_raised")
    assert message.startswith("CheckpointSaveError: saving checkpoint 'removed'") and "was removed while the save ran" \
        in message and "nothing was published" in message, message
    assert "same shared folder" not in message, message
    assert result(ranks, "staging_removed_listing") == (["good", "latest", "zero_to_fp32.py"], "good")


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


def test_a_failure_staging_the_module_weights_stores_the_masters_whole_and_leaves_no_lock(ranks):
    assert result(ranks, "slices_fail_save") is None
    assert result(ranks, "slices_fail_next_save") is None  # the lock was released
    assert result(ranks, "slices_fail_verify") == [None, None]


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
    pending.register(saver)  # as its first process_group() call registers it

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
        pending.unregister(saver)


def test_a_front_doors_deletion_is_dropped_when_the_save_failed_before_it_asked():
    # Trainer asks for its rotation after save_checkpoint returned and its own files are written; a background
    # save that failed quickly (a full disk at the first file) has finished by then, its error not raised yet.
    deleted = []
    saver = BackgroundSaver()
    pending.register(saver)
    try:
        saver.start("T", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        saver.join()  # finished, failed; the error waits for the next call
        after_pending_saves(lambda: deleted.append("old"), "the test's deletion")
        assert deleted == []  # the older checkpoint is the newest complete one: kept
        with pytest.raises(CheckpointSaveError, match="No space left on device"):
            saver.wait()
    finally:
        pending.unregister(saver)


def test_wait_for_checkpoint_from_another_thread_never_hides_a_pending_save():
    # A thread calling wait() in a loop (a monitoring callback) set the saver's thread to None after the main thread
    # had started the next save: the engine then saw no pending save, and its next save would have restaged the
    # buffers the writer was still reading; it also raised "cannot join thread before it is started".
    saver, stop, problems = BackgroundSaver(), threading.Event(), []

    def poll():
        while not stop.is_set():
            try:
                saver.wait(raise_error=False)
            except Exception as error:  # noqa: BLE001 - recorded for the assertion
                problems.append(repr(error))

    poller = threading.Thread(target=poll)
    poller.start()
    hidden = 0
    try:
        for _ in range(300):
            release = threading.Event()
            saver.start("T", lambda release=release: release.wait(10))
            hidden += not saver.pending  # its work is blocked: it is pending
            release.set()
            saver.wait()
    finally:
        stop.set()
        poller.join()
    assert hidden == 0 and problems == [], (hidden, problems[:3])


def test_a_background_failure_is_raised_once_when_two_threads_wait():
    release, outcomes = threading.Event(), []
    saver = _saver_blocked_until(release, fail=True)
    pending.unregister(saver)

    def wait():
        try:
            saver.wait()
            outcomes.append(None)
        except CheckpointSaveError as error:
            outcomes.append(str(error))

    waiters = [threading.Thread(target=wait) for _ in range(2)]
    for waiter in waiters:
        waiter.start()
    release.set()
    for waiter in waiters:
        waiter.join()
    assert outcomes.count(None) == 1, outcomes  # one waiter raised it, the other returned
    assert "No space left on device" in next(outcome for outcome in outcomes if outcome is not None), outcomes


# -- the break-it probe: one DP=2 launch (tests/async_probe_scenarios.py) ------------------------------------------


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("async_probe")
    run_distributed(probe, 2, str(workdir))
    return torch.load(workdir / "async_probe.pt", weights_only=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_nothing_done_after_the_call_leaks_at_stage_2_3_with_offload_and_bf16_optimizer(probed, case):
    assert result(probed, f"pending:{case}") is True
    assert result(probed[:1], f"differences:{case}") == []  # masters, 8-bit state, absmax, counters
    assert result(probed, f"scheduler:{case}") is True  # the LR scheduler's state at the call
    assert result(probed, f"client:{case}") == ({"seen": [1, 2]}, [0.0, 1.0, 2.0, 3.0], 2)
    assert result(probed, f"verify:{case}") is None


def test_a_second_engine_saving_into_the_same_folder_waits_for_the_pending_save(probed):
    # It failed with "another job is writing into ...: .zero_bnb.lock is held by ... pid <this process>"
    assert result(probed, "second_engine_pending") is True
    assert result(probed, "second_engine_save") is None
    assert result(probed, "first_engine_wait") is None
    assert result(probed, "two_engines_listing") == (["first", "latest", "second", "zero_to_fp32.py"], "second")


def test_another_engine_loading_the_folder_right_after_the_save_returned_loads_that_save(probed):
    # It loaded 'second', the checkpoint 'latest' named before the pending save of 'third' was committed
    assert result(probed, "other_load") is None
    assert result(probed[:1], "other_load_differences") == []
    assert result(probed, "other_load_wait") is None


@pytest.mark.parametrize("label", ["mid", "below_rank1"])
def test_a_staging_limit_the_ranks_hit_at_different_points_keeps_the_state_at_the_call(probed, label):
    staged = result(probed, "unbounded_staged")
    assert staged[0] > staged[1] > 0, staged  # rank 0 stages DeepSpeed's model file too
    assert result(probed, f"limit_save:{label}") is None and result(probed, f"limit_wait:{label}") is None
    assert result(probed[:1], f"limit_differences:{label}") == []
    for rank in (0, 1):
        assert probed[rank][f"limit_held:{label}:{rank}"] is True, rank


def test_the_save_folder_removed_while_the_writer_runs_fails_that_save_only(probed):
    assert result(probed, "removed_save") is None
    message = result(probed, "removed_wait")
    assert message.startswith("CheckpointSaveError: saving checkpoint 'during'") and "unchanged" in message, message
    assert result(probed, "removed_exists") is False
    assert result(probed, "removed_again") is None
    assert result(probed, "removed_listing") == (["after", "latest", "zero_to_fp32.py"], "after")


def test_an_exception_in_a_step_while_a_save_is_pending_does_not_touch_the_save(probed):
    assert result(probed, "raising_step").startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert result(probed, "raising_train_after") is None and result(probed, "raising_wait") is None
    assert result(probed[:1], "raising_differences") == []


def test_the_same_tag_twice_holds_the_second_state_and_destroy_twice_is_harmless(probed):
    assert result(probed, "twice_listing") == (["X", "latest", "zero_to_fp32.py"], "X")
    assert result(probed[:1], "twice_differences") == []
    assert result(probed, "destroy_first") is None and result(probed, "destroy_second") is None
    assert result(probed, "destroyed_verify") is None


def test_trainer_rotation_while_a_save_is_pending_keeps_the_newer_folders_files(probed):
    # Trainer writes model.safetensors into checkpoint-4 while checkpoint-2 is being committed; the deletion of
    # checkpoints beyond save_total_limit=1, deferred to checkpoint-2's commit, sorts by mtime and took
    # checkpoint-4 for the older one: checkpoint-4 and -6 then lacked the model weights and config.json
    assert result(probed[:1], "rotation_committed") is True
    assert result(probed[:1], "rotation_gaps") == []  # always a complete checkpoint after the first commit
    assert result(probed[:1], "rotation_folders") == ["checkpoint-6"]
    files = result(probed[:1], "rotation_last_files")
    assert {"model.safetensors", "config.json", "trainer_state.json", "latest", "global_step6"} <= set(files), files
    assert result(probed, "rotation_verify") is None


# -- real torchrun scripts: a script that ends with a save pending; ranks that disagree on the switch ---------------


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory):
    """Both scripts at once (``python -m torch.distributed.run --standalone``, 2 ranks each); per scenario its return
    code, output tail, folder and each rank's JSON."""
    runs = {}
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(launch.child_environment_for("cpu"),
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH")])))
    for scenario in ("exit", "exit_failed", "mixed"):
        folder = tmp_path_factory.mktemp(f"async_{scenario}")
        process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             os.path.join(HERE, "async_torchrun_scenarios.py"), scenario, str(folder)],
            env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        runs[scenario] = (process, folder)
    done = {}
    for scenario, (process, folder) in runs.items():
        try:
            output, _ = process.communicate(timeout=240)  # a rank waiting for a group nobody joins waits 30 min
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        ranks = [json.loads((folder / f"rank{rank}.json").read_text()) if (folder / f"rank{rank}.json").exists()
                 else None for rank in (0, 1)]
        done[scenario] = (process.returncode, output[-4000:], folder, ranks)
    return done


def test_a_script_that_ends_with_a_save_pending_waits_for_its_commit(torchrun):
    code, output, folder, ranks = torchrun["exit"]
    assert code == 0, output
    assert ranks == [{"pending_at_exit": True}] * 2, output  # the script's last line ran before the commit
    with open(folder / "ckpt" / "latest") as handle:
        assert handle.read() == "at_exit"
    zero_bnb.verify_checkpoint(str(folder / "ckpt"))


def test_a_script_that_ends_after_a_failed_asynchronous_save_exits_non_zero_naming_it(torchrun):
    code, output, folder, ranks = torchrun["exit_failed"]
    assert code != 0, output  # a training job never reports success without its last checkpoint
    assert ranks == [{"pending_at_exit": True}] * 2, output
    assert ("the asynchronous save of checkpoint 'lost' into" in output and "failed and nothing raised it before the "
            "process ended" in output and "'latest' there still names 'good'. Exiting with status 1" in output), output
    with open(folder / "ckpt" / "latest") as handle:
        assert handle.read() == "good"
    zero_bnb.verify_checkpoint(str(folder / "ckpt"))


def test_ranks_that_disagree_on_the_switch_get_a_clear_error_instead_of_a_hang(torchrun):
    code, output, folder, ranks = torchrun["mixed"]
    assert code == 0, output  # it waited for rank 1 in the creation of the writers' group (30 minutes)
    for rank, record in enumerate(ranks):
        assert record is not None, output
        message = record["raised"]
        assert message == ("CheckpointUsageError: zero_checkpoint_async is true on rank(s) [0] and false on rank(s) "
                           "[1]: every rank must save the same way (the asynchronous writers commit together on a "
                           "process group every rank joins at the first asynchronous save). Nothing was written. "
                           "Give every rank the same DeepSpeed config"), (rank, message)
    assert not os.path.exists(folder / "ckpt" / "mixed")


def test_the_staging_limit_message_shows_the_limit_and_the_need_apart():
    # Issue 42: a limit of 0.1 MiB and a slightly larger save both read "0.1 MiB".
    from zero_bnb.checkpoint.staging import StagingLimitError, StagingPool

    pool = StagingPool(limit_bytes=int(0.1 * 2**20))
    pool.begin()
    with pytest.raises(StagingLimitError) as raised:
        pool.snapshot({"a": torch.zeros(26215)})  # 104,860 bytes: 3 over the 104,857-byte limit
    assert str(raised.value) == ("this save stages more than zero_checkpoint_async_max_staging_mb allows: the limit is "
                                 "0.099999 MiB (104857 bytes), this save needs at least 0.1 MiB (104860 "
                                 "bytes, 3 over)"), raised.value


def test_a_staged_storage_freed_by_its_owner_is_not_mistaken_for_a_new_tensor_at_the_same_address():
    """The review's finding: a snapshotted temporary, freed, let a new tensor take its address, and view_or_copy
    returned the old copy. The pool now keeps each staged source until the staging ends."""
    from zero_bnb.checkpoint.staging import StagingPool

    pool = StagingPool()
    for _ in range(20):  # the allocator hands a freed block of the same size straight back
        pool.begin()
        temporary = torch.full((4096,), 1.0)
        pool.snapshot({"client": temporary})
        del temporary
        fresh = torch.full((4096,), 2.0)
        assert torch.equal(pool.view_or_copy(fresh), fresh)
        pool.trim()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: pinned staging of device tensors")
def test_device_tensors_are_staged_into_pinned_buffers_holding_the_values_at_the_call():
    """On a GPU: a device view of a snapshotted storage is a view of its pinned copy; one of a storage nobody
    snapshotted gets its own pinned copy (the module weights of a rank that did not write the model file); both
    hold the values at the call after copies_done(), though the device tensors change right after it."""
    from zero_bnb.checkpoint.staging import StagingPool

    pool = StagingPool()
    flat = torch.arange(4096, dtype=torch.bfloat16, device="cuda")
    other = torch.arange(2048, dtype=torch.float32, device="cuda")
    for _ in range(2):  # the second save reuses the buffers
        pool.begin()
        snapshot = pool.snapshot({"module": {"w": flat[:1000].view(10, 100), "b": flat[1000:1024]}})
        view = pool.view_or_copy(flat[512:3000])
        copied = pool.view_or_copy(other[100:1100])
        done = pool.copies_done()
        expected = (flat[512:3000].cpu(), other[100:1100].cpu(), flat[:1000].view(10, 100).cpu())
        flat.add_(1)  # training changes the state right after the call, on the same stream
        other.mul_(2)
        pool.trim()
        done.synchronize()
        assert view.is_pinned() and copied.is_pinned() and snapshot["module"]["w"].is_pinned()
        assert view.untyped_storage().data_ptr() == snapshot["module"]["w"].untyped_storage().data_ptr()
        assert torch.equal(view, expected[0]) and torch.equal(copied, expected[1])
        assert torch.equal(snapshot["module"]["w"], expected[2])


def test_a_synchronous_save_stages_no_host_copy_of_the_masters_or_module_weights():
    """A synchronous save keeps the masters and module weights as views where they live (on a GPU too): the writer
    copies one group at a time to decide whether its masters derive (an adversarial review of fe100c1: staging them
    with .to("cpu") held a host copy of every derivable group's masters and weights, up to 6 B/param, until the end
    of the save). Meta tensors stand in for a device's: any copy to the host would make them CPU tensors."""
    from zero_bnb.checkpoint.staging import InlineStaging

    device = torch.empty(1024, device="meta")
    staging = InlineStaging()
    assert staging.master(device).device.type == "meta"
    assert staging.view_or_copy(device).device.type == "meta"
    assert staging.snapshot(device) is device and staging.copies_done() is None
