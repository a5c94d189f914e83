"""Defects an adversarial probe of the issue-31 fixes found, each a test that failed before its fix (branch probe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from probe_scenarios import deep_exists, engine_findings, plant_deep

from zero_bnb.errors import CheckpointError
from zero_bnb.format import durable
from zero_bnb.format.ownership import checkpoint_strangers
from zero_bnb.testing.launch import run_distributed

pytestmark = pytest.mark.launch


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("probe")
    run_distributed(engine_findings, 1, str(workdir))
    return workdir, torch.load(workdir / "findings.pt", weights_only=False)


# -- engine saves into an existing tag folder -------------------------------------------------------------------


def test_strangers_sees_files_below_folders_os_walk_cannot_list(tmp_path):
    # os.walk's errors (ENAMETOOLONG here; EACCES for an unreadable subfolder) are ignored: the files below are
    # not seen, so the folder counts as empty/pure.
    relative = plant_deep(str(tmp_path))
    assert deep_exists(str(tmp_path), relative)
    assert checkpoint_strangers(str(tmp_path)) != []


def test_a_users_deeply_nested_folder_in_a_tag_folder_is_not_deleted(findings):
    _, out = findings
    assert out["deep_planted"]
    assert out["deep_survives_in"], "the user's file below the tag folder was deleted by the re-save"


def test_a_users_file_at_a_listed_path_with_the_listed_size_is_not_deleted(findings):
    # The manifest records each file's SHA-256, but ownership is decided by path and size only.
    _, out = findings
    assert out["same_size_survives_in"], "the user's rewritten model file was deleted by the re-save"


def test_a_file_added_after_the_last_check_is_not_deleted(findings):
    # Checked "again before publishing", but the folder moved aside is removed without a look at what it holds now.
    _, out = findings
    assert out["late_file_survives_in"], "eval_results.json written into the tag folder during the save was deleted"


# -- write_shards / zero_to_fp32 ----------------------------------------------------------------------------------


def _contents(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if (folder / name).is_file()}


def test_an_interrupt_before_any_file_is_in_place_says_the_previous_output_is_unchanged(tmp_path):
    from zero_bnb.errors import CheckpointSaveError
    from zero_bnb.tools.shards import write_shards

    old = {name: torch.full((300,), 1.0) for name in "abc"}
    write_shards(old, str(tmp_path), "pytorch_model.bin", None)
    before = _contents(tmp_path)

    def hook(event, path):  # Ctrl-C (or a full disk) while the record is written, before any rename
        if os.path.basename(path) == ".zero_bnb-outputs.json" and event == "replace":
            raise KeyboardInterrupt

    previous = durable.set_io_hook(hook)
    try:
        with pytest.raises((CheckpointSaveError, KeyboardInterrupt)) as raised:  # an interrupt stays one
            write_shards({n: torch.full((300,), 2.0) for n in "abc"}, str(tmp_path), "pytorch_model.bin", 1500)
    finally:
        durable.set_io_hook(previous)
    assert _contents(tmp_path) == before  # nothing was put in place ...
    assert "incomplete" not in str(raised.value), str(raised.value)  # ... yet the message says the output is incomplete


def test_zero_to_fp32_with_an_existing_file_as_output_gives_a_clear_error(findings, tmp_path):
    # DeepSpeed < 0.14's zero_to_fp32.py took an output *file*: `python zero_to_fp32.py . pytorch_model.bin`.
    workdir, _ = findings
    save_dir = workdir / "clean"
    output = tmp_path / "pytorch_model.bin"
    output.write_bytes(b"an earlier export")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "zero_to_fp32.py", ".", str(output)], cwd=save_dir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert output.read_bytes() == b"an earlier export"
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]


# -- verification (C1) ----------------------------------------------------------------------------------------------


def test_a_re_signed_model_file_cannot_replace_a_verified_weight_through_shared_params(findings, tmp_path):
    # The masters of 4.weight are bound to the shard's per-piece SHA-256s, but the model file's shared_params
    # (tied names) is applied over them: 4.weight is exported as 0.weight's tensor, shape (160, 60), not (90, 96).
    import shutil

    from hostile_scenarios import record_algorithm, replace_listed_file, resign

    from zero_bnb.cli.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    workdir, _ = findings
    save_dir = tmp_path / "ckpt"
    shutil.copytree(workdir / "clean", save_dir)
    clean = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    tag_folder = save_dir / "A"
    states = torch.load(tag_folder / "mp_rank_00_model_states.pt", weights_only=False)
    states["shared_params"] = {"4.weight": "0.weight"}
    replace_listed_file(str(tag_folder), "mp_rank_00_model_states.pt", states)
    manifest = json.loads((tag_folder / "zero_bnb" / "manifest.json").read_text())
    if manifest.get("module_digest"):
        record = next(r for r in manifest["files"] if r["path"] == "mp_rank_00_model_states.pt")
        manifest["module_digest"] = record[record_algorithm(record)]
        resign(str(tag_folder / "zero_bnb"), manifest)
    try:
        state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    except CheckpointError:
        return  # refused: fine
    assert tuple(state["4.weight"].shape) == (90, 96) and torch.equal(state["4.weight"], clean["4.weight"])


# -- the Accelerate hook ------------------------------------------------------------------------------------------


def test_enable_with_an_accelerate_lacking_the_swap_does_not_claim_a_120_s_import_timeout(tmp_path):
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "__init__.py").write_text("")
    (tmp_path / "accelerate" / "accelerator.py").write_text("X = 1\n")  # imported completely, no swap function
    code = """if True:
        import logging, time
        logging.basicConfig(level=logging.WARNING)
        import accelerate.accelerator, zero_bnb
        zero_bnb.enable()
        time.sleep(0.5)
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.getcwd(),
                                                                      os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "did not finish importing within 120 s" not in done.stderr, done.stderr[-1500:]
