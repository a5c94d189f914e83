"""A checkpoint on the preemption signal: a real SIGTERM to a ``torchrun`` job at DP=2 mid-run, then the automatic
resume at DP=3 (``engine.load_checkpoint(folder)`` follows ``latest``), whose losses follow the run that was never
interrupted (``tests/preemption_script.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from scenarios import within, worst_relative
from test_comm_init import HERE, _environment
from test_elastic import LOSS_BOUND

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=27)]

STEPS = 8
SIGNAL_AFTER = 3


def _torchrun(folder: str, ranks: int, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={ranks}", os.path.join(HERE, "preemption_script.py"), folder,
                             str(STEPS)], env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **popen)


def _losses(folder: str) -> list[dict]:
    with open(f"{folder}.losses.jsonl") as handle:
        return [json.loads(line) for line in handle]


def test_sigterm_to_a_torchrun_job_saves_at_the_next_step_and_the_resume_at_another_size_follows(tmp_path):
    reference, preempted = str(tmp_path / "uninterrupted"), str(tmp_path / "preempted")
    uninterrupted = _torchrun(reference, 2)
    job = _torchrun(preempted, 2)
    deadline = time.monotonic() + 300
    while not (os.path.exists(f"{preempted}.losses.jsonl") and len(_losses(preempted)) >= SIGNAL_AFTER):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker, and SIGKILLs them 30 s later
    output = job.communicate(timeout=120)[0]
    assert job.returncode != 0, output[-3000:]  # the job did not finish: the launcher and scheduler see that
    assert "preempted (SIGTERM): checkpoint saved and durable; exiting with status 143" in output, output[-3000:]
    saved = len(_losses(preempted))
    assert SIGNAL_AFTER <= saved < STEPS, saved
    with open(os.path.join(preempted, "latest")) as handle:
        tag = handle.read().strip()
    # the step after the last logged one completed and was saved before the loss was logged: the save is at a step
    # boundary, never inside one
    assert tag in (f"global_step{saved}", f"global_step{saved + 1}"), (tag, saved)
    resumed = _torchrun(preempted, 3)  # the same script: it resumes automatically from `latest`
    resumed_output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, resumed_output[-3000:]
    uninterrupted_output = uninterrupted.communicate(timeout=300)[0]
    assert uninterrupted.returncode == 0, uninterrupted_output[-3000:]
    expected = {entry["step"]: entry["loss"] for entry in _losses(reference)}
    after = [entry for entry in _losses(preempted) if entry["dp"] == 3]
    first = int(tag.removeprefix("global_step")) + 1
    assert [entry["step"] for entry in after] == list(range(first, STEPS + 1)), after
    within("losses resumed at DP=3 after SIGTERM vs the uninterrupted run (rel.)",
           worst_relative([expected[entry["step"]] for entry in after], [entry["loss"] for entry in after]), LOSS_BOUND)
