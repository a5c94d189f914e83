"""benchmarks/gpu/check.sh, the one command a GPU machine runs: on a machine without CUDA its CPU dry run goes through
every step (set-up check, the GPU tests collected, the cross-device check with the GPU sides on a CPU rank, golden
vectors from bitsandbytes' CPU path and their agreement report) and exits 0; a wheel folder without wheels is an
error that names it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from zero_bnb.testing import warm

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=65)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "benchmarks", "gpu", "check.sh")


def _check(out, **env) -> subprocess.CompletedProcess:
    """check.sh as a user runs it, but with its CPU launches forked from a warm server (``WARM_ENV``), as the suite's
    own are (the dry run's multi-rank and cross-device steps: 26 s -> 13 s and 20 s -> 11 s on 2 cores); the GPU run
    spawns its ranks (CUDA cannot be used in a forked child)."""
    environment = {key: value for key, value in os.environ.items() if key != "ZERO_BNB_WHEELS"}
    environment[warm.WARM_ENV] = "1"
    return subprocess.run(["bash", CHECK, str(out)], capture_output=True, text=True, timeout=1200,
                          env={**environment, **env})


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, check.sh runs the whole GPU check (about 9 minutes): "
                                                      "run it directly")
def test_the_dry_run_goes_through_every_step_and_exits_0(tmp_path):
    # Another check running at the same time keeps its scratch folder (its process is alive: this one); a killed
    # run's leftovers (their process gone) are removed.
    alive = tempfile.mkdtemp(prefix="zero_bnb_gpu_check.", dir="/tmp")
    dead = tempfile.mkdtemp(prefix="zero_bnb_cross_device_", dir="/tmp")
    with open(os.path.join(alive, "pid"), "w") as handle:
        handle.write(str(os.getpid()))
    with open(os.path.join(dead, "pid"), "w") as handle:
        handle.write("999999999")  # no such process
    try:
        done = _check(tmp_path)
        assert os.path.isdir(alive) and not os.path.exists(dead)
    finally:
        shutil.rmtree(alive, ignore_errors=True)
    log = (tmp_path / "check.log").read_text()
    assert done.returncode == 0, log[-3000:]
    assert "no CUDA device: a CPU dry run of the same steps" in log and "check: all steps passed" in log
    assert sorted(os.listdir(tmp_path)) == ["check.log", "cross_device.json", "machine.txt", "multi_rank.json",
                                            "pytest.txt", "triton_update.json"]
    assert "tests/test_fp16.py::test_an_fp16_run_with_overflow_skipped_steps_resumes_on_a_gpu" in (
        tmp_path / "pytest.txt").read_text()
    report = json.loads((tmp_path / "cross_device.json").read_text())
    assert set(report["cases"]) == {"fp32-zero1", "fp16-zero2", "bf16-zero3", "bf16-zero1-async"}
    assert all(case["ok"] and case["tensors"] == 18 for case in report["cases"].values()), report
    multi = json.loads((tmp_path / "multi_rank.json").read_text())
    assert list(multi["cases"]) == ["fp32-zero1"] and multi["cases"]["fp32-zero1"]["ok"], multi
    assert all(multi["gloo_collectives"][name] == "ok" for name in ("all_reduce", "all_gather_into_tensor")), multi
    kernel = json.loads((tmp_path / "triton_update.json").read_text())
    assert kernel["interpreted"] and [size["size"] for size in kernel["sizes"]] == ["64K"], kernel
    assert "tests/test_triton_update.py::test_every_gpu_8bit_step_with_fused_gives_the_reference_bits[Adam8bit]" in (
        tmp_path / "pytest.txt").read_text()
    assert "golden_vectors: 12 fixtures" in log  # bitsandbytes' CPU path cannot run AdEMAMix: its 2 cases are noted
    assert "commit:" in (tmp_path / "machine.txt").read_text()


def test_a_wheel_folder_without_wheels_is_named(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    done = _check(tmp_path / "out", ZERO_BNB_WHEELS=str(empty))
    assert done.returncode == 1
    assert f"set-up: no wheels in ZERO_BNB_WHEELS={empty}" in done.stdout
