"""``zero_bnb.enable()`` initialises ``deepspeed.comm`` (``zero_bnb.integrations.comm``), checked under a real
``torchrun`` (``python -m torch.distributed.run --standalone``), whose ranks start with nothing initialised: the
tests' own launcher (``zero_bnb.testing.launch``) initialises ``deepspeed.comm`` before a scenario runs, which hid
issue 34's stage-3 failure."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

import zero_bnb.testing.launch as launch
from zero_bnb.integrations import comm
from zero_bnb.testing.scripts import ScriptServer

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=30)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: The variables of a launch; a test's own process must not pass its own on to the scripts it starts.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Spelled out (checked against ``comm``'s): the children below set it whichever zero_bnb they run.
RENDEZVOUS_TIMEOUT_ENV = "ZERO_BNB_RENDEZVOUS_TIMEOUT"


def _environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env.update(launch.child_environment_for("cpu"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, HERE, os.environ.get("PYTHONPATH")])), **extra)
    return env


@pytest.fixture(scope="module")
def scripts() -> Iterator[ScriptServer]:
    """The ``python -c`` children below that start with nothing initialised (``ALONE``, ``TIMED``), forked from one
    interpreter that imported zero_bnb and DeepSpeed (2.2-2.8 s of CPU per child otherwise). ``JOINED`` is spawned:
    DeepSpeed reads ``DEEPSPEED_TIMEOUT`` when it is imported."""
    with ScriptServer(["zero_bnb", "deepspeed", "deepspeed.comm", "zero_bnb.integrations.substitute"],
                      _environment()) as server:
        yield server


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
def test_without_a_complete_launcher_environment_enable_leaves_comm_alone_and_says_what_is_missing(scripts, given,
                                                                                                   missing):
    # A plain `python script.py`, or a half-set environment (which would hang a rendezvous): nothing is joined.
    done = scripts.run(ALONE, _environment(**given), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "result False" in done.stdout.splitlines(), done.stdout
    assert (f"zero_bnb.enable(): deepspeed.comm not initialised: no process group and no launcher environment "
            f"(missing {missing})") in done.stderr, done.stderr[-4000:]


@pytest.mark.parametrize(("given", "named"), [
    ({"RANK": "abc"}, "RANK='abc'"), ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK='2' with WORLD_SIZE='2'"), ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
    # Issue 42: str.isdigit() took '²' (then int() raised "invalid literal for int()") and '٠' (Arabic-Indic zero,
    # which int() reads as 0): ASCII digits only.
    ({"RANK": "\u00b2"}, "RANK='\u00b2'"), ({"RANK": "\u0660"}, "RANK='\u0660'"),
])
def test_launcher_variables_no_rendezvous_can_use_are_named_with_the_fix(scripts, given, named):
    launched = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **given}
    done = scripts.run(ALONE, _environment(**launched), timeout=300)
    assert done.returncode != 0 and "Traceback" in done.stderr, done.stdout
    assert (f"ValueError: zero_bnb.enable(): the launcher's environment cannot start DeepSpeed's communication: {named} "
            f"(RANK, WORLD_SIZE and LOCAL_RANK are integers in ASCII digits 0-9") in done.stderr, done.stderr[-3000:]
    assert "unset RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT to run one process" in done.stderr, done.stderr[-3000:]


def test_a_fresh_interpreter_fails_on_a_broken_launcher_variable_as_the_forked_children_do(scripts):
    # The children above import nothing under their own environment (the server imported zero_bnb and DeepSpeed under
    # a clean one): this one imports them under the broken variable, as a user's script does.
    launched = _environment(RANK="abc", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    spawned = subprocess.run([sys.executable, "-c", ALONE], env=launched, capture_output=True, text=True, timeout=300)
    forked = scripts.run(ALONE, launched, timeout=300)
    errors = [[line for line in done.stderr.splitlines() if line.startswith("ValueError: ")] for done in (spawned, forked)]
    assert spawned.returncode == forked.returncode == 1 and errors[0] == errors[1] and errors[0], (spawned, forked)


@pytest.mark.parametrize(("name", "value"), [("WORLD_SIZE", "\uff12"), ("LOCAL_RANK", "\u0661"),
                                             ("MASTER_PORT", "\u0662\u0669\u0665\u0660\u0660"), ("RANK", "\u00b9")])
def test_launcher_numbers_are_ascii_digits_only(monkeypatch, name, value):
    # Issue 42, the same check in this process for the other variables (fullwidth, Arabic-Indic, superscript digits)
    launched = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for key, setting in {**launched, name: value}.items():
        monkeypatch.setenv(key, setting)
    with pytest.raises(ValueError, match=f"communication: {name}={value!r} \\(RANK, WORLD_SIZE and LOCAL_RANK are "
                                         "integers in ASCII digits 0-9"):
        comm._check_launcher_environment()
    monkeypatch.setenv(name, launched[name])
    comm._check_launcher_environment()


# Issue 42: a rendezvous that could not complete waited DeepSpeed's collective timeout (10 minutes), printing only
# torch's "gai error: -2 - Name or service not known". Each child below has a hard timeout well under that, so a
# regression fails here instead of hanging the suite.
TIMED = """if True:
    import logging, sys, time
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import zero_bnb
    import zero_bnb.integrations.substitute, deepspeed.comm  # imported before the clock starts: enable()'s own time
    started = time.monotonic()
    try:
        zero_bnb.enable()
    finally:
        print("elapsed", time.monotonic() - started, flush=True)
"""


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def _fail_in_time(scripts: ScriptServer, launched: dict[str, str], hard_timeout: float) -> tuple[str, float]:
    """Run ``enable()`` in a child under ``launched``; return its stderr and the seconds ``enable()`` took."""
    done = scripts.run(TIMED, _environment(**launched), timeout=hard_timeout)
    if done.timed_out:
        pytest.fail(f"zero_bnb.enable() under {launched} was still waiting after {hard_timeout} s: "
                    f"{done.stderr[-2000:]!r}")
    assert done.returncode != 0 and "Traceback" in done.stderr, (done.stdout + done.stderr)[-3000:]
    [elapsed] = [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("elapsed ")]
    return done.stderr, elapsed


@pytest.mark.parametrize(("rank", "world_size"), [("0", "1"), ("1", "2")])
def test_a_master_addr_that_does_not_resolve_fails_at_once_naming_it_and_the_fix(scripts, rank, world_size):
    # The lookup is checked before torch's store, which retried it until the collective timeout. (A name service that
    # does not answer is bounded by the rendezvous timeout, 10 s here.)
    launched = {"RANK": rank, "WORLD_SIZE": world_size, "MASTER_ADDR": "no-such-host.invalid",
                "MASTER_PORT": _free_port(), RENDEZVOUS_TIMEOUT_ENV: "10"}
    stderr, elapsed = _fail_in_time(scripts, launched, hard_timeout=60)
    assert elapsed < 12, elapsed
    assert (f"zero_bnb.integrations.comm.RendezvousError: zero_bnb.enable(): rank {rank} of {world_size} "
            f"(RANK='{rank}', WORLD_SIZE='{world_size}') cannot reach the launcher's rendezvous: "
            f"MASTER_ADDR='no-such-host.invalid', MASTER_PORT='{launched['MASTER_PORT']}', and "
            f"'no-such-host.invalid' does not resolve to an address (") in stderr, stderr[-3000:]
    assert "Fix: set MASTER_ADDR to rank 0's host as every rank's host can reach it" in stderr, stderr[-3000:]


@pytest.mark.parametrize(("rank", "tried"), [
    # a resolvable address where no store listens: rank 1 retries connecting
    ("1", "tried connecting to rank 0's rendezvous store at 127.0.0.1:{port} (127.0.0.1); the last attempt failed "
          "with ConnectionRefusedError: [Errno 111] Connection refused (at 127.0.0.1)"),
    # rank 0 hosts the store; the other rank never comes
    ("0", "tried hosting the rendezvous store on port {port} and connecting to it at 127.0.0.1:{port} (127.0.0.1), "
          "then waiting for the other 1 rank(s) to connect; torch said: Timed out after"),
], ids=["rank1-nothing-listens", "rank0-no-other-rank"])
def test_a_rendezvous_that_does_not_complete_fails_within_the_rendezvous_timeout(scripts, rank, tried):
    with socket.socket() as held:
        # rank 1: the port stays bound here, not listening (connections are refused), so no other process of the
        # machine (the suite's other worker) can start listening on it meanwhile; rank 0 binds it itself
        held.bind(("127.0.0.1", 0))
        port = str(held.getsockname()[1])
        if rank == "0":
            held.close()
        launched = {"RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                    RENDEZVOUS_TIMEOUT_ENV: "2"}
        stderr, elapsed = _fail_in_time(scripts, launched, hard_timeout=60)
    assert 1.9 < elapsed < 2 + 3, elapsed
    assert (f"RendezvousError: zero_bnb.enable(): rank {rank} of 2 (RANK='{rank}', WORLD_SIZE='2') could not join "
            f"the launcher's rendezvous (gave up after ") in stderr, stderr[-3000:]
    assert "s; limit 2 s, ZERO_BNB_RENDEZVOUS_TIMEOUT): MASTER_ADDR=" in stderr, stderr[-3000:]
    assert f"MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}'; {tried.format(port=port)}" in stderr, stderr[-3000:]
    assert ("MASTER_PORT to a free TCP port open between the hosts, the same on every rank; launchers set both "
            "(torchrun --master_addr/--master_port") in stderr, stderr[-3000:]
    assert ("start rank 0 and every other rank so that all reach zero_bnb.enable() within 2 s of each other, or raise "
            "ZERO_BNB_RENDEZVOUS_TIMEOUT (seconds)") in stderr, stderr[-3000:]


def test_the_rendezvous_timeout_defaults_to_at_most_60_seconds_documented_and_checked(monkeypatch):
    assert comm.DEFAULT_RENDEZVOUS_TIMEOUT <= 60 and comm.RENDEZVOUS_TIMEOUT_ENV == RENDEZVOUS_TIMEOUT_ENV
    monkeypatch.delenv(comm.RENDEZVOUS_TIMEOUT_ENV, raising=False)
    assert comm.rendezvous_timeout() == comm.DEFAULT_RENDEZVOUS_TIMEOUT
    monkeypatch.setenv(comm.RENDEZVOUS_TIMEOUT_ENV, " 2.5 ")
    assert comm.rendezvous_timeout() == 2.5
    for wrong in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv(comm.RENDEZVOUS_TIMEOUT_ENV, wrong)
        with pytest.raises(ValueError, match=f"ZERO_BNB_RENDEZVOUS_TIMEOUT={wrong!r} is not a number of seconds > 0; "
                                             "set it to .* or unset it \\(default 60\\)"):
            comm.rendezvous_timeout()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as readme:
        assert f"`$ZERO_BNB_RENDEZVOUS_TIMEOUT` seconds (default {comm.DEFAULT_RENDEZVOUS_TIMEOUT:g})" in readme.read()


JOINED = """if True:
    import json, sys
    import torch, torch.distributed as dist
    import zero_bnb
    from deepspeed import comm
    from deepspeed.constants import default_pg_timeout
    from torch.distributed import distributed_c10d
    zero_bnb.enable()
    total = torch.ones(1)
    comm.all_reduce(total)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    print("result", json.dumps({"sum": total.item(), "collective": backend.options._timeout.total_seconds(),
                                "store": distributed_c10d._get_default_store().timeout.total_seconds(),
                                "deepspeed": default_pg_timeout.total_seconds()}), flush=True)
    # as every launched script here ends: gloo's teardown at interpreter exit can abort with "terminate called
    # without an active exception" (SIGABRT; it did once in the full run at c4f17e9, see exit_skipping_finalization)
    dist.destroy_process_group()
    from zero_bnb.testing.ranks import exit_skipping_finalization
    exit_skipping_finalization()
"""


def test_a_joined_rendezvous_leaves_collectives_deepspeeds_timeout_not_the_rendezvous_one():
    # The deepspeed launcher's way (no torchrun agent: rank 0 hosts the store), the rendezvous bounded by 60 s: once
    # joined, the group's collectives and its store wait DeepSpeed's timeout (DEEPSPEED_TIMEOUT=10 minutes), as
    # deepspeed.init_distributed gives them, not the rendezvous' 60 s.
    launched = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port(),
                RENDEZVOUS_TIMEOUT_ENV: "60", "DEEPSPEED_TIMEOUT": "10"}
    ranks = [subprocess.Popen([sys.executable, "-c", JOINED], env=_environment(RANK=str(rank), **launched),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    results = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=180)
            assert process.returncode == 0, err[-3000:]
            [result] = [json.loads(line[len("result "):]) for line in out.splitlines() if line.startswith("result ")]
            results.append(result)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    for result in results:
        assert result == {"sum": 2.0, "collective": 600.0, "store": 600.0, "deepspeed": 600.0}, results
