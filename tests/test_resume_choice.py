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
from zero_bnb.errors import CheckpointFormatError, CheckpointUsageError
from zero_bnb.format import progress
from zero_bnb.format.lock import LOCK_NAME
from zero_bnb.format.manifest import MANIFEST_NAME, SUBDIR
from zero_bnb.integrations import resume
from zero_bnb.integrations.accelerate_checkpoints import newest_checkpoint
from zero_bnb.integrations.lightning_resume import complete_checkpoint
from zero_bnb.tools.checkpoint_paths import verify_target


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
saver._thread.join()
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
