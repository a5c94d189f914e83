"""``zero_bnb.enable()`` initialises ``deepspeed.comm`` (``zero_bnb.integrations.comm``), checked under a real
``torchrun`` (``python -m torch.distributed.run --standalone``), whose ranks start with nothing initialised: the
tests' own launcher (``zero_bnb.testing.launch``) initialises ``deepspeed.comm`` before a scenario runs, which hid
issue 34's stage-3 failure."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import zero_bnb.testing.launch as launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: The variables of a launch; a test's own process must not pass its own on to the scripts it starts.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env.update(launch.child_environment_for("cpu"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, HERE, os.environ.get("PYTHONPATH")])), **extra)
    return env


def _torchrun(tmp_path, scenario: str, ranks: int = 2) -> dict:
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           os.path.join(HERE, "torchrun_scenarios.py"), scenario, str(out)],
                          env=_environment(ZERO_BNB_TEST_OUT=str(tmp_path / "trainer")), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return json.loads(out.read_text())


def test_trainer_at_stage3_under_torchrun_on_cpu_builds_the_model_over_both_ranks(tmp_path):
    # Issue 34: the model build under zero.Init failed ("Check batch related parameters ... 12 != 2 * 3 * 1"):
    # deepspeed.comm was not initialised, so DeepSpeed's config saw a world of 1.
    result = _torchrun(tmp_path, "trainer_z3")
    assert result["world"] == 2 and result["dp_size"] == 2 and result["zero_stage"] == 3, result
    assert result["partitions"] and all(part == math.ceil(numel / 2) for numel, part in result["partitions"].values()), \
        result["partitions"]
    assert len(result["losses"]) == 2 and all(math.isfinite(loss) for loss in result["losses"]), result
    assert result["eight_bit_groups"] > 0, result
    [said] = result["comm"]
    assert said.startswith("zero_bnb.enable(): deepspeed.comm initialised from the launcher's environment (gloo, "
                           "rank 0 of 2, MASTER_ADDR="), said


def test_enable_wraps_the_users_own_process_group(tmp_path):
    result = _torchrun(tmp_path, "wrap")
    assert result["initialized"] and result["world"] == 2 and result["sum"] == 2.0 and result["same_group"], result
    # the second enable() returns before touching deepspeed.comm: one message
    assert result["comm"] == ["zero_bnb.enable(): deepspeed.comm now wraps the existing torch.distributed group "
                              "(gloo, rank 0 of 2)"], result


ALONE = """if True:
    import logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("zero_bnb.integrations.comm").setLevel(logging.DEBUG)
    import zero_bnb
    from deepspeed import comm
    zero_bnb.enable()
    print("result", comm.is_initialized())
"""


@pytest.mark.parametrize(("given", "missing"), [({}, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
                                                ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR")])
def test_without_a_complete_launcher_environment_enable_leaves_comm_alone_and_says_what_is_missing(given, missing):
    # A plain `python script.py`, or a half-set environment (which would hang a rendezvous): nothing is joined.
    done = subprocess.run([sys.executable, "-c", ALONE], env=_environment(**given), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "result False" in done.stdout.splitlines(), done.stdout
    assert (f"zero_bnb.enable(): deepspeed.comm not initialised: no process group and no launcher environment "
            f"(missing {missing})") in done.stderr, done.stderr[-4000:]


@pytest.mark.parametrize(("given", "named"), [
    ({"RANK": "abc"}, "RANK='abc'"), ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK='2' with WORLD_SIZE='2'"), ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
])
def test_launcher_variables_no_rendezvous_can_use_are_named_with_the_fix(given, named):
    launched = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **given}
    done = subprocess.run([sys.executable, "-c", ALONE], env=_environment(**launched), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "Traceback" in done.stderr, done.stdout
    assert (f"ValueError: zero_bnb.enable(): the launcher's environment cannot start DeepSpeed's communication: {named} "
            f"(RANK and WORLD_SIZE are integers") in done.stderr, done.stderr[-3000:]
    assert "unset RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT to run one process" in done.stderr, done.stderr[-3000:]
