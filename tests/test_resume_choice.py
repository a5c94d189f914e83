"""Which folder automatic resume takes, on folders made by hand the way killed saves leave them (one process, no
DeepSpeed engine): zero_bnb's records (``zero_bnb.format.progress``), each front door's finder
(``zero_bnb.integrations.resume``, ``accelerate_checkpoints``, ``lightning_resume``), ``zero-bnb verify`` on them, and
the end of a process with a lost asynchronous save. The real saves and kills are ``tests/test_front_door_kills.py``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from zero_bnb.cli import main as cli_main
import zero_bnb.errors as zero_bnb_errors
from zero_bnb.errors import CheckpointFormatError, CheckpointUsageError
from zero_bnb.format import progress
from zero_bnb.format.lock import LOCK_NAME
from zero_bnb.format.manifest import MANIFEST_NAME, SUBDIR
from zero_bnb.integrations import resume
from zero_bnb.integrations.accelerate_checkpoints import newest_checkpoint
from zero_bnb.integrations.lightning_resume import complete_checkpoint
from zero_bnb.tools.checkpoint_paths import verify_target

pytestmark = pytest.mark.launch


def _committed(folder, tag: str, *, when: float | None = None) -> str:
    """A save folder whose ``latest`` names a committed zero_bnb tag (its manifest's time ``when``)."""
    os.makedirs(os.path.join(folder, tag, SUBDIR), exist_ok=True)
    manifest = os.path.join(folder, tag, SUBDIR, MANIFEST_NAME)
    with open(manifest, "w") as handle:
        handle.write("{}")
    with open(os.path.join(folder, "latest"), "w") as handle:
        handle.write(tag)
    if when is not None:
        os.utime(manifest, (when, when))
    return str(folder)


def _staging(folder, tag: str, pid: int = 1 << 30) -> None:
    """What a zero_bnb save killed mid-write leaves: its staging folder and its lock (the holder gone)."""
    os.makedirs(os.path.join(folder, f".{tag}.zero_bnb-staging-0123456789ab", SUBDIR), exist_ok=True)
    with open(os.path.join(folder, LOCK_NAME), "w") as handle:
        json.dump({"host": os.uname().nodename, "pid": pid, "since": time.time(), "purpose": f"saving tag {tag!r}"},
                  handle)


def _marked(folder, door: str = "trainer") -> None:
    """What a front door's save killed before it was complete leaves: its mark."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, progress.SAVING_NAME), "w") as handle:
        json.dump({"front_door": door, "started": time.time(), "host": "node7", "pid": 4242, "token": "x"}, handle)


def test_folder_status_reads_committed_tags_staging_folders_locks_and_marks(tmp_path):
    done = _committed(tmp_path / "done", "global_step4")
    status = progress.folder_status(done)
    assert (status.tag, status.interrupted, status.superseded) == ("global_step4", False, False)
    _staging(tmp_path / "killed", "global_step6")
    status = progress.folder_status(str(tmp_path / "killed"))
    assert status.interrupted and status.tag is None
    assert "zero_bnb save of tag 'global_step6'" in status.describe() and "its process is gone" in status.describe()
    resaved = _committed(tmp_path / "resaved", "checkpoint")
    _staging(resaved, "checkpoint")  # a re-save of the same tag killed: the previous one stays complete
    status = progress.folder_status(resaved)
    assert status.tag == "checkpoint" and not status.interrupted and status.superseded
    marked = _committed(tmp_path / "marked", "global_step8")
    _marked(marked)  # the front door's files may be half written, whatever zero_bnb's tag says
    status = progress.folder_status(marked)
    assert status.interrupted and "trainer save started" in status.describe()
    assert "pid 4242 on host 'node7'" in status.describe()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not progress.folder_status(str(empty)).interrupted  # judged as the front door judges it
    assert progress.folder_status(str(empty), require="pytorch_model").interrupted  # Accelerate + DeepSpeed


def test_a_new_front_door_folder_appears_with_its_mark_and_only_its_own_mark_is_removed(tmp_path):
    folder = str(tmp_path / "out" / "checkpoint-6")
    token = progress.mark_saving(folder, "trainer")
    assert os.listdir(folder) == [progress.SAVING_NAME]  # made under a private name, renamed with the mark in it
    assert not [name for name in os.listdir(tmp_path / "out") if name != "checkpoint-6"]
    with open(os.path.join(folder, "trainer_state.json"), "w") as handle:
        handle.write("{}")
    assert progress.folder_status(folder).interrupted
    assert progress.finish_saving(folder, token)
    assert os.listdir(folder) == ["trainer_state.json"] and not progress.folder_status(folder).interrupted
    token = progress.mark_saving(folder, "trainer")  # a re-save into the existing folder
    _marked(folder)  # someone else's mark replaced ours: it stays, and the folder stays interrupted
    assert not progress.finish_saving(folder, token)
    assert progress.folder_status(folder).interrupted and "trainer_state.json" in os.listdir(folder)


def test_trainer_resume_from_checkpoint_true_takes_the_newest_complete_checkpoint(tmp_path, caplog):
    transformers_trainer = pytest.importorskip("transformers.trainer")
    import zero_bnb

    out = tmp_path / "out"
    _committed(out / "checkpoint-4", "global_step4")
    _staging(out / "checkpoint-6", "global_step6")  # the case: killed while the save of step 6 was written
    _marked(out / "checkpoint-6")
    _committed(out / "checkpoint-8", "global_step8")
    _marked(out / "checkpoint-8")  # complete zero_bnb tag, Trainer's own files unfinished
    (out / "checkpoint-10-old").mkdir()  # not a Trainer name
    zero_bnb.enable()
    try:
        import transformers.trainer_utils as trainer_utils

        with caplog.at_level(logging.WARNING, logger="zero_bnb"):
            chosen = transformers_trainer.get_last_checkpoint(str(out))
            assert trainer_utils.get_last_checkpoint(str(out)) == chosen
        assert chosen == str(out / "checkpoint-4")
        warnings = [r.getMessage() for r in caplog.records if "passes over" in r.getMessage()]
        assert len(warnings) == 2 and "passes over 2 interrupted saves" in warnings[0], warnings
        assert "checkpoint-6" in warnings[0] and "checkpoint-8" in warnings[0]
        assert "Resuming from " + str(out / "checkpoint-4") in warnings[0]
        with pytest.raises(CheckpointUsageError) as refused:  # given explicitly: refused, naming the fix
            resume.refuse_interrupted(str(out / "checkpoint-6"), chosen, "resume_from_checkpoint", "pass that folder")
        assert "holds an interrupted save" in str(refused.value) and str(out / "checkpoint-4") in str(refused.value)
    finally:
        zero_bnb.disable()
    assert not getattr(transformers_trainer.get_last_checkpoint, "_zero_bnb_patch", False)  # disable() undoes it


def test_accelerate_load_state_takes_the_newest_complete_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    _committed(checkpoints / "checkpoint_0", "pytorch_model")
    (checkpoints / "checkpoint_0" / "pytorch_model").mkdir(exist_ok=True)
    _committed(checkpoints / "checkpoint_1", "pytorch_model")
    (checkpoints / "checkpoint_2").mkdir()  # Accelerate made the folder, the kill came before zero_bnb's mark
    _marked(checkpoints / "checkpoint_3", "accelerate")
    assert newest_checkpoint(str(checkpoints), "pytorch_model") == str(checkpoints / "checkpoint_1")
    assert newest_checkpoint(str(checkpoints), None) == str(checkpoints / "checkpoint_2")  # no DeepSpeed: a folder
    for name in ("checkpoint_0", "checkpoint_1"):
        _marked(checkpoints / name, "accelerate")
    with pytest.raises(CheckpointUsageError, match="found no complete checkpoint"):
        newest_checkpoint(str(checkpoints), "pytorch_model")


def test_lightning_last_takes_the_complete_checkpoint_committed_last(tmp_path):
    now = time.time()
    folder = tmp_path / "ckpts"
    _committed(folder / "epoch=0.ckpt", "checkpoint", when=now - 30)
    _committed(folder / "epoch=1.ckpt", "checkpoint", when=now - 10)
    last = _committed(folder / "last.ckpt", "checkpoint", when=now - 20)  # committed at epoch 0 ...
    _staging(last, "checkpoint")  # ... and its re-save at epoch 1 was killed
    assert complete_checkpoint(last, [str(folder)]) == str(folder / "epoch=1.ckpt")
    fresh = _committed(tmp_path / "fresh" / "last.ckpt", "checkpoint", when=now - 20)  # nothing interrupted in it,
    _committed(tmp_path / "fresh" / "epoch=1.ckpt", "checkpoint", when=now - 10)  # the top-k save after it complete
    assert complete_checkpoint(fresh, [str(tmp_path / "fresh")]) == str(tmp_path / "fresh" / "epoch=1.ckpt")
    assert complete_checkpoint(str(folder / "epoch=0.ckpt"), [str(folder)]) == str(folder / "epoch=0.ckpt")
    first = tmp_path / "first" / "last.ckpt"
    _staging(first, "checkpoint")  # the very first save of last.ckpt was killed, nothing else
    with pytest.raises(CheckpointUsageError, match="no complete checkpoint is beside it"):
        complete_checkpoint(str(first), [str(first.parent)])
    _staging(folder / "epoch=2.ckpt", "checkpoint")
    with pytest.raises(CheckpointUsageError) as refused:
        complete_checkpoint(str(folder / "epoch=2.ckpt"), [str(folder)])
    assert str(folder / "epoch=1.ckpt") in str(refused.value)
    assert complete_checkpoint(str(tmp_path / "a-file.ckpt"), []) == str(tmp_path / "a-file.ckpt")  # not a folder


def test_verify_names_the_newest_complete_checkpoint_and_the_interrupted_saves(tmp_path, capsys):
    out = tmp_path / "out"
    _committed(out / "checkpoint-4", "global_step4")
    _staging(out / "checkpoint-6", "global_step6")
    checkpoint, notes = verify_target(str(out), None)
    assert checkpoint == str(out / "checkpoint-4")
    assert notes[0].endswith(f"the newest complete one is {out / 'checkpoint-4'}")
    assert "interrupted save" in notes[1] and "global_step6" in notes[1]
    with pytest.raises(CheckpointFormatError) as refused:
        verify_target(str(out / "checkpoint-6"), None)
    assert "holds an interrupted save" in str(refused.value)
    assert f"The newest complete checkpoint beside it is {out / 'checkpoint-4'}" in str(refused.value)
    # the command line: exit 1, one line naming the newest complete checkpoint; never a tag that does not exist
    assert cli_main(["verify", str(out / "checkpoint-6")]) == 1
    error = capsys.readouterr().err
    assert str(out / "checkpoint-4") in error and "global_step100" not in error, error
    only = tmp_path / "only"
    _staging(only / "checkpoint-2", "global_step2")
    with pytest.raises(CheckpointFormatError, match="holds no complete checkpoint, only interrupted saves"):
        verify_target(str(only), None)


@pytest.mark.parametrize("how", ["end", "destroy_process_group"])
def test_a_failed_asynchronous_save_nothing_raised_makes_the_process_exit_non_zero(tmp_path, how):
    script = f"""
import logging, os, sys
import torch.distributed as dist
from zero_bnb.checkpoint import background
logging.basicConfig(level=logging.WARNING)
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
saver = background.BackgroundSaver()
saver.process_group()  # the first asynchronous save: the writers' group, and the end-of-process check
def full_disk():
    raise OSError(28, "No space left on device")
saver.start("global_step6", full_disk, {str(tmp_path)!r})
saver.join()
if {how!r} == "destroy_process_group":
    try:
        dist.destroy_process_group()
    except Exception as error:
        print("raised:", type(error).__name__, error)
        sys.exit(0)
    sys.exit(3)
print("the script ended normally")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if how == "end":
        assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
        assert "the script ended normally" in done.stdout
        assert "the asynchronous save of checkpoint 'global_step6'" in done.stderr, done.stderr
        assert "Exiting with status 1" in done.stderr and "holds no complete checkpoint" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
        assert "raised: CheckpointSaveError" in done.stdout and "global_step6" in done.stdout, done.stdout


def test_records_written_by_a_stranger_never_crash_the_choice_or_verify(tmp_path, capsys):
    out = tmp_path / "out"
    _committed(out / "checkpoint-4", "global_step4")
    for number, record in enumerate(({"started": float("nan"), "pid": 2**70, "host": os.uname().nodename},
                                     {"started": 1e300, "pid": -1, "host": os.uname().nodename},
                                     {"started": "soon", "pid": True, "host": "x\n" * 400, "front_door": ["x"]},
                                     [1, 2], "text")):
        folder = out / f"checkpoint-{6 + number}"
        folder.mkdir()
        (folder / progress.SAVING_NAME).write_text(json.dumps(record) if number < 4 else "{not json")
        status = progress.folder_status(str(folder))
        assert status.interrupted and "front door save started" in status.describe(), status.describe()
        assert "still running" not in status.describe()  # a negative pid names a process group, not a process
    directory = out / "checkpoint-20"
    (directory / progress.SAVING_NAME).mkdir(parents=True)  # a folder where the mark goes
    assert progress.folder_status(str(directory)).interrupted
    assert resume.newest_complete(resume.trainer_checkpoints(str(out)), "test") == str(out / "checkpoint-4")
    assert cli_main(["verify", str(out / "checkpoint-7")]) == 1  # one line, no traceback
    assert "holds an interrupted save" in capsys.readouterr().err
    with pytest.raises(zero_bnb_errors.CheckpointSaveError, match="cannot mark"):
        progress.mark_saving(str(directory), "trainer")  # its mark's path is a folder: a clear error


def test_a_folder_that_cannot_be_listed_is_never_the_one_resumed_from(tmp_path):
    # (a folder without read permission; the test runs as root, who reads every folder: a path that is no folder
    # fails os.listdir the same way)
    not_a_folder = tmp_path / "checkpoint-6"
    not_a_folder.write_text("")
    status = progress.folder_status(str(not_a_folder))
    assert status.interrupted and "cannot be listed" in status.describe(), status.describe()


def test_the_hf_example_scripts_own_get_last_checkpoint_resumes_from_the_newest_complete_one(tmp_path):
    pytest.importorskip("transformers")
    from zero_bnb.integrations.hf import _explicit_resume

    out = tmp_path / "out"
    _committed(out / "checkpoint-100", "global_step100")
    _committed(out / "checkpoint-150", "global_step150")
    _staging(out / "checkpoint-200", "global_step200")
    _marked(out / "checkpoint-200")
    # run_clm.py's get_last_checkpoint, imported before zero_bnb.enable(), returns the newest folder: interrupted
    assert _explicit_resume(str(out / "checkpoint-200")) == str(out / "checkpoint-150")
    assert _explicit_resume(str(out / "checkpoint-150")) == str(out / "checkpoint-150")
    _marked(out / "checkpoint-100")
    with pytest.raises(CheckpointUsageError, match="holds an interrupted save"):  # an older one, asked for by name
        _explicit_resume(str(out / "checkpoint-100"))


def test_a_lock_from_another_host_is_taken_over_once_its_holder_stopped_renewing_it(tmp_path):
    from zero_bnb.format import lock as lock_module

    folder = tmp_path / "checkpoint-200"
    folder.mkdir()
    path = folder / LOCK_NAME
    path.write_text(json.dumps({"host": "node-a-of-the-preempted-job", "pid": 4242, "since": time.time()}))
    with pytest.raises(zero_bnb_errors.CheckpointSaveError, match="is taken over 120 s after its holder last"):
        lock_module.SaveFolderLock(str(folder), "test").acquire()  # renewed just now: its holder may be alive
    old = time.time() - lock_module.LEASE_S - 5
    os.utime(path, (old, old))  # the job died on node-a and was requeued here: nobody renews it any more
    taken = lock_module.SaveFolderLock(str(folder), "test")
    taken.acquire()
    try:
        assert json.loads(path.read_text())["host"] == os.uname().nodename
        before = os.stat(path).st_mtime
        os.utime(path, (old, old))
        lock_module.RENEW_S, saved = 0.05, lock_module.RENEW_S
        descriptor = os.open(path, os.O_RDONLY)
        renewal = lock_module._Renewal(descriptor)
        try:
            deadline = time.monotonic() + 5
            while os.stat(path).st_mtime <= old + 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            lock_module.RENEW_S = saved
            renewal.stop()
            os.close(descriptor)
        assert os.stat(path).st_mtime > old + 1 and before > old  # a holder renews it
    finally:
        taken.release()
    assert not path.exists()


def test_an_asynchronous_save_started_by_an_atexit_handler_is_written(tmp_path):
    """An emergency save in an atexit handler (after the interpreter stopped concurrent.futures' workers) is written
    in the caller, and its failure raised as any other (an adversarial review of 510b6a1: it raised a bare
    RuntimeError 'cannot schedule new futures after interpreter shutdown', the save lost)."""
    script = f"""
import atexit
import torch.distributed as dist
from zero_bnb.checkpoint import background
from zero_bnb.errors import CheckpointSaveError
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
saver = background.BackgroundSaver()
saver.process_group()
saver.start("early", lambda: None)
saver.wait()
def late():
    saver.start("late", lambda: open({str(tmp_path / 'late')!r}, "w").write("written"))
    saver.wait()
    saver.start("failing", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    try:
        saver.wait()
    except CheckpointSaveError as error:
        print("raised:", error)
atexit.register(late)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert (tmp_path / "late").read_text() == "written"
    assert "raised: the asynchronous save of checkpoint 'failing' failed in the background: OSError" in done.stdout, \
        done.stdout


def test_a_failed_save_of_an_engine_freed_before_the_end_is_still_reported(tmp_path):
    script = f"""
import logging
import torch.distributed as dist
from zero_bnb.checkpoint import background
logging.basicConfig(level=logging.WARNING)
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
saver = background.BackgroundSaver()
saver.process_group()
saver.start("global_step6", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")), {str(tmp_path)!r})
saver.close(report=False)  # what a garbage-collected engine does (DeepSpeed's __del__ would swallow an error)
del saver
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1 and "global_step6" in done.stderr, (done.returncode, done.stderr[-2000:])


def _plain_ddp_accelerate(rank: int, out: str, store: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    import zero_bnb

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    zero_bnb.enable()  # a shared launcher enables it; this job is plain DDP
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    if accelerator.is_main_process:  # diffusers' training scripts save so, without DeepSpeed
        accelerator.save_state(os.path.join(out, "checkpoint-1"))
    for _ in range(2):
        accelerator.backward(model(torch.ones(1, 2)).sum())
    dist.destroy_process_group()
    from zero_bnb.testing.ranks import exit_skipping_finalization

    exit_skipping_finalization()  # not gloo's teardown race at interpreter exit (a SIGABRT seen here once)


def test_accelerate_without_a_zero_bnb_engine_saves_as_accelerate_does(tmp_path):
    pytest.importorskip("accelerate")
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_plain_ddp_accelerate, args=(rank, str(tmp_path), str(tmp_path / "store")))
               for rank in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    alive = [worker.is_alive() for worker in workers]
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    assert alive == [False, False] and [worker.exitcode for worker in workers] == [0, 0], alive
    assert not (tmp_path / "checkpoint-1" / progress.SAVING_NAME).exists()
