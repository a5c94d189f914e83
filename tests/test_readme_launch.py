"""The README's launch lines, run for real on CPU: ``train.py`` under ``torchrun`` at 2 processes, resumed under the
``deepspeed`` launcher at 3; ``train_accelerate.py`` with its ``accel.yaml`` under ``accelerate launch`` at 2,
resumed at 3. Scripts, YAML and command lines are extracted from README.md (``readme_examples``); the only change
to a command line is a free rendezvous port, so that concurrent runs on one machine do not meet.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import signal
import socket
import subprocess
import time

import pytest
from readme_examples import README, block

from zero_bnb.testing.launch import child_environment_for

logger = logging.getLogger(__name__)

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=50)]

ROOT = os.path.dirname(README)
#: The option each launcher takes its rendezvous port by.
PORT_OPTION = {"torchrun": "--master_port", "deepspeed": "--master_port", "accelerate launch": "--main_process_port"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def commands(heading: str) -> list[str]:
    """The command lines of the bash block under ``heading`` (comments dropped)."""
    lines = [line.split("  #")[0].strip() for line in block(heading, "bash").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _remove_shared_memory_buffers(port: int, since: float) -> None:
    """Remove the shared-memory all-reduce buffers this launch's ranks left: on CPU the ``deepspeed`` launcher sets
    ``LOCAL_SIZE``, so DeepSpeed's ``deepspeed_shm_comm`` op makes one ``/dev/shm`` file per rank (66 MiB with
    deepspeed 0.19.8), named by user, address and port, and never removes it (every suite run left 200 MB). Only files
    of this user and this launch's port made since it started are removed."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        try:
            if os.stat(path).st_mtime >= since - 1:
                os.remove(path)
        except OSError as error:  # gone already, or not ours to remove: named, and the launch's result stands
            logger.warning("could not remove %s: %s", path, error)


def launch(command: str, folder) -> str:
    """Run one README command line in ``folder`` with the CPU ranks' environment; its output (stdout + stderr)."""
    [launcher] = [name for name in PORT_OPTION if command.startswith(name + " ")]
    port = _free_port()
    command = command.replace(launcher, f"{launcher} {PORT_OPTION[launcher]} {port}", 1)
    env = {**os.environ, **child_environment_for("cpu"),
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    started = time.time()
    # A session of its own: on a timeout the launcher and every rank it started are killed, none left behind.
    process = subprocess.Popen(command, shell=True, cwd=folder, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{command} did not finish in 300 s:\n{output[-6000:]}")
    finally:
        _remove_shared_memory_buffers(port, started)
    assert process.returncode == 0, f"{command} exited {process.returncode}:\n{output[-6000:]}"
    return output


def test_plain_script_under_torchrun_resumes_under_the_deepspeed_launcher(tmp_path):
    (tmp_path / "train.py").write_text(block("A plain DeepSpeed script"))
    first, later = commands("A plain DeepSpeed script")
    assert first.startswith("torchrun --nproc_per_node 2 "), first
    assert later.startswith("deepspeed --num_gpus 3 "), later
    assert "step 2 at 2 processes: bitsandbytes.optim.adam.Adam8bit" in launch(first, tmp_path)
    # the resume: 2 more steps at 3 processes, and the 8-bit state survived (train.py asserts it on every rank)
    assert "step 4 at 3 processes: bitsandbytes.optim.adam.Adam8bit" in launch(later, tmp_path)


def test_accelerate_script_with_its_yaml_resumes_at_another_number_of_processes(tmp_path):
    (tmp_path / "accel.yaml").write_text(block("Accelerate", "yaml"))
    (tmp_path / "train_accelerate.py").write_text(block("Accelerate"))
    first, later = commands("Accelerate")
    assert "--config_file accel.yaml" in first and "--num_processes 3" in later, (first, later)
    # PartialState(cpu=True): each process its own index (without it every one reports 0, tests/test_front_doors_hf.py)
    # 48 samples in micro-batches of 2 under a global batch of 12: 4 optimizer steps per run at 2 and at 3 processes.
    assert sorted(re.findall(r"process (\d): step 4(?!\d)", launch(first, tmp_path))) == ["0", "1"]
    assert sorted(re.findall(r"process (\d): step 8(?!\d)", launch(later, tmp_path))) == ["0", "1", "2"]


@pytest.mark.parametrize("heading", ["A plain DeepSpeed script", "Accelerate"])
def test_every_launch_line_names_a_launcher_the_test_knows(heading):
    for command in commands(heading):
        assert any(command.startswith(name + " ") for name in PORT_OPTION), command
