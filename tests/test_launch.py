"""The test launcher itself: a child that dies natively leaves its Python stack behind, and every child's
OpenMP runtime starts with one thread and sees no CUDA device, on DeepSpeed's CPU accelerator (the environment is
set before the child imports torch), whatever GPUs the machine has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from zero_bnb.testing.launch import SHM_COMM_OP, child_environment_for, gpus_missing, run_distributed
from zero_bnb.testing.warm import WARM_ENV

pytestmark = pytest.mark.launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_KEYS = ("OMP_NUM_THREADS", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES")


def _where_am_i() -> dict:
    """What a rank sees of its devices: the launcher's variables, torch's CUDA devices, DeepSpeed's accelerator and
    the device of a tensor it makes there, and the process group's backend."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm import comm

    return {"shm_comm_op": repr(comm.cdb.shm_comm_op), **{key: os.environ.get(key, "unset") for key in CHILD_KEYS},
            "cuda_devices": torch.cuda.device_count(), "accelerator": get_accelerator().device_name(),
            "tensor_device": torch.ones(1, device=get_accelerator().current_device_name()).device.type,
            "backend": dist.get_backend()}


def abort_natively_on_rank_1(rank: int, world_size: int, folder: str) -> None:
    """Rank 1 aborts the way a C++ ``std::terminate`` does (SIGABRT); each rank first records where it runs."""
    with open(os.path.join(folder, f"env{rank}"), "w") as handle:
        json.dump(_where_am_i(), handle)
    dist.barrier()
    if rank == 1:
        os.abort()
    dist.barrier()


def test_a_native_abort_in_a_child_prints_its_python_stack(tmp_path, capfd):
    # CI once lost a rank to "terminate called without an active exception" with nothing else to go on.
    before = os.environ.get("OMP_NUM_THREADS")
    with pytest.raises(ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
        run_distributed(abort_natively_on_rank_1, 2, str(tmp_path))
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err, err[-2000:]
    assert "in abort_natively_on_rank_1" in err, err[-2000:]
    seen = [json.loads((tmp_path / f"env{rank}").read_text()) for rank in (0, 1)]
    # On a machine with one GPU, DeepSpeed's CUDA accelerator gave rank 1 "cuda:1" and the launch died at once; with
    # several, gloo ranks got CUDA tensors. CPU ranks see no CUDA device, whatever the machine has.
    # DeepSpeed's shared-memory op is not loaded (its JIT build under a lock without timeout could hang the suite)
    assert seen == [{"shm_comm_op": "None", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "cuda_devices": 0,
                     "accelerator": "cpu", "tensor_device": "cpu", "backend": "gloo"}] * 2, seen
    assert os.environ.get("OMP_NUM_THREADS") == before  # the parent's environment is restored


def test_cpu_ranks_stay_on_the_cpu_whatever_the_parent_sets(tmp_path, monkeypatch):
    # A user's shell may name the CUDA accelerator or a GPU: the CPU launcher's children override both, and the
    # parent gets its own values back.
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    run_distributed(record_where, 2, str(tmp_path))
    seen = [json.loads((tmp_path / f"env{rank}").read_text()) for rank in (0, 1)]
    assert {(s["DS_ACCELERATOR"], s["CUDA_VISIBLE_DEVICES"], s["accelerator"], s["backend"]) for s in seen} == {
        ("cpu", "", "cpu", "gloo")}, seen
    assert (os.environ["DS_ACCELERATOR"], os.environ["CUDA_VISIBLE_DEVICES"]) == ("cuda", "0")


def record_where(rank: int, world_size: int, folder: str) -> None:
    with open(os.path.join(folder, f"env{rank}"), "w") as handle:
        json.dump(_where_am_i(), handle)


def raise_on_rank_1(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 1:
        raise ValueError(f"rank {rank} of {world_size} refuses")


@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_rank_that_raises_fails_the_launch_with_its_traceback_warm_or_spawned(monkeypatch, warm):
    # the suite forks its ranks from a warm server (zero_bnb.testing.warm); the demo and benchmarks spawn them.
    # torch's launcher reports whichever rank it reaps first, often rank 0, whose barrier broke when rank 1 left; the
    # warm launch reports the rank that raised first.
    monkeypatch.setenv(WARM_ENV, warm)
    expected = r"Process 1 terminated with the following error:.*ValueError: rank 1 of 2 refuses" if warm == "1" else \
        r"Process [01] terminated with the following error:"
    with pytest.raises(ProcessRaisedException, match=f"(?s){expected}"):
        run_distributed(raise_on_rank_1, 2)


def exit_with_3_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        sys.exit(3)


def record_what_a_rank_inherits(rank: int, world_size: int, folder: str) -> None:
    """Where a rank runs, whether it may start a child process (a DataLoader worker, a pool) and its random state."""
    import multiprocessing
    import random

    import torch

    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump({"cwd": os.getcwd(), "child_exit": child.exitcode, "torch": torch.rand(1).item(),
                   "random": random.random()}, handle)


@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_rank_is_what_a_spawned_rank_is_warm_or_spawned(tmp_path, monkeypatch, warm):
    # a forked rank used to keep the server's folder, daemon flag (no DataLoader workers) and random state
    monkeypatch.setenv(WARM_ENV, warm)
    monkeypatch.chdir(tmp_path)
    run_distributed(record_what_a_rank_inherits, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["cwd"], r["child_exit"]) for r in ranks] == [(str(tmp_path), 0)] * 2, ranks
    assert ranks[0]["torch"] != ranks[1]["torch"] and ranks[0]["random"] != ranks[1]["random"], ranks
    # torch's launcher reports whichever rank it reaps first (rank 0's broken barrier, often); the warm one rank 1's
    expected = (ProcessExitedException,) if warm == "1" else (ProcessExitedException, ProcessRaisedException)
    with pytest.raises(expected, match="process 1 terminated with exit code 3" if warm == "1" else None):
        run_distributed(exit_with_3_on_rank_1, 2)


def test_launches_from_two_threads_run_at_once(tmp_path):
    # tests/test_hostile.py runs two jobs into one folder at the same time: each waits for the other at a barrier file
    threads = [threading.Thread(target=run_distributed, args=(meet, 1, str(tmp_path), side)) for side in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(os.listdir(tmp_path)) == ["a", "a.met", "b", "b.met"]


def meet(rank: int, world_size: int, folder: str, side: str) -> None:
    """Write this side's mark, then wait (up to 60 s) for the other side's: only launches running at once meet."""
    import time

    open(os.path.join(folder, side), "w").close()
    other = os.path.join(folder, "b" if side == "a" else "a")
    deadline = time.monotonic() + 60
    while not os.path.exists(other):
        if time.monotonic() > deadline:
            raise TimeoutError(f"side {side} never saw the other launch")
        time.sleep(0.05)
    open(os.path.join(folder, side + ".met"), "w").close()


def test_the_op_the_launcher_leaves_out_is_deepspeeds_shared_memory_op():
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    assert SHM_COMM_OP == ShareMemCommBuilder.NAME


def test_the_shared_memory_op_scripts_test_sh_builds_first_is_the_one_cpu_launches_load():
    # scripts/test.sh builds it before the workers start (a cached build: a few seconds), in a process of its own
    done = subprocess.run([sys.executable, "-c", "from zero_bnb.testing.ranks import build_shm_comm_op; "
                           "print(build_shm_comm_op())"], capture_output=True, text=True, timeout=600,
                          env={key: value for key, value in os.environ.items() if key not in CHILD_KEYS})
    assert done.returncode == 0, done.stderr[-3000:]
    built = done.stdout.strip().splitlines()[-1]
    assert os.path.isfile(built) and os.path.basename(built).startswith(SHM_COMM_OP + "."), built


def test_a_rank_that_skips_finalization_still_runs_its_exit_handlers_and_keeps_their_status():
    # zero_bnb's report of a lost asynchronous save is an atexit handler that exits with status 1
    script = ("import atexit, os, sys\n"
              "atexit.register(lambda: (print('handler ran', flush=True), os._exit(1)))\n"
              "from zero_bnb.testing.launch import exit_skipping_finalization\n"
              "print('done', flush=True)\n"
              "exit_skipping_finalization()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert (done.returncode, done.stdout) == (1, "done\nhandler ran\n"), done
    done = subprocess.run([sys.executable, "-c", script.replace("os._exit(1)", "None")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert (done.returncode, done.stdout) == (0, "done\nhandler ran\n"), done


def test_the_launcher_names_its_devices_and_refuses_gpu_ranks_it_cannot_place():
    assert child_environment_for("cpu") == {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    assert child_environment_for("cuda")["DS_ACCELERATOR"] == "cuda"
    with pytest.raises(ValueError, match=r"device must be one of \['cpu', 'cuda', 'cuda-shared'\], got 'tpu'"):
        child_environment_for("tpu")
    too_many = torch.cuda.device_count() + 1
    assert gpus_missing(too_many) is not None
    with pytest.raises(ValueError, match=f"needs {too_many} CUDA device"):
        run_distributed(record_where, too_many, "unused", device="cuda")
    assert child_environment_for("cuda-shared")["DS_ACCELERATOR"] == "cuda"
    if not torch.cuda.is_available():  # ranks sharing one GPU need one
        with pytest.raises(ValueError, match=r"run_distributed\(device='cuda-shared'\) needs 1 CUDA device\(s\); "
                                             r"this machine has none"):
            run_distributed(record_where, 2, "unused", device="cuda-shared")


@pytest.mark.gpu
@pytest.mark.skipif(gpus_missing(2) is not None, reason=str(gpus_missing(2)))
def test_gpu_ranks_get_one_device_each_and_nccl(tmp_path):
    run_distributed(record_where_gpu, 2, str(tmp_path), device="cuda")
    seen = [json.loads((tmp_path / f"env{rank}").read_text()) for rank in (0, 1)]
    assert [(s["accelerator"], s["backend"], s["current"]) for s in seen] == [("cuda", "nccl", 0), ("cuda", "nccl", 1)]


def record_where_gpu(rank: int, world_size: int, folder: str) -> None:
    with open(os.path.join(folder, f"env{rank}"), "w") as handle:
        json.dump({**_where_am_i(), "current": torch.cuda.current_device(),
                   "local_rank": os.environ.get("LOCAL_RANK")}, handle)


@pytest.mark.gpu
@pytest.mark.skipif(gpus_missing(1) is not None, reason=str(gpus_missing(1)))
def test_ranks_share_one_gpu_over_gloo(tmp_path):
    """Issue 45: DP > 1 on a one-GPU machine (nccl refuses two ranks on one device)."""
    run_distributed(record_where_gpu, 3, str(tmp_path), device="cuda-shared")
    seen = [json.loads((tmp_path / f"env{rank}").read_text()) for rank in range(3)]
    assert {(s["accelerator"], s["backend"], s["current"], s["local_rank"]) for s in seen} == {("cuda", "gloo", 0, "0")}


def test_a_rank_ending_with_sys_exit_gets_the_status_a_script_would():
    """One rule for spawned-like ranks (warm launches) and the fault campaigns' forked jobs: sys.exit() is 0,
    sys.exit(n) is n, sys.exit("message") is 1 (forks gave 1 for a bare sys.exit())."""
    from zero_bnb.testing.ranks import exit_status

    assert [exit_status(SystemExit(code)) for code in (None, 0, 3, "message", 2.5)] == [0, 0, 3, 1, 1]


#: Scripts whose ending ``python -c`` and a forked child of the script server must report alike.
SCRIPTS = {
    "output and environment": "import os, sys; print(os.environ.get('ZERO_BNB_PROBE'), os.environ.get('SERVER_ONLY'));"
                              " print('err', file=sys.stderr)",
    "an uncaught exception": "print('before'); raise ValueError('boom')",
    "sys.exit(3)": "import sys; sys.exit(3)",
    "sys.exit('a message')": "import sys; sys.exit('a message')",
    "a signal": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    "KeyboardInterrupt": "raise KeyboardInterrupt",
    "a thread still running": "import threading, time\n"
                              "threading.Thread(target=lambda: (time.sleep(0.3), print('late'))).start()",
    "an atexit handler": "import atexit; atexit.register(print, 'bye')",
    "an annotation evaluated": "def f(x: undefined_name): pass",  # not the server module's postponed annotations
}


def _first_and_last(text: str) -> tuple[str, ...]:
    lines = text.splitlines()
    return (lines[0], lines[-1]) if lines else ()


def test_a_script_forked_by_the_script_server_ends_as_python_minus_c_does():
    from zero_bnb.testing.scripts import ScriptServer

    env = {**os.environ, "ZERO_BNB_PROBE": "seen"}  # the script's environment, all of it: not the server's
    with ScriptServer(["json"], {**os.environ, "SERVER_ONLY": "1"}) as server:
        forked = server.run_together([(script, env) for script in SCRIPTS.values()], timeout=60)
        for (label, script), done in zip(SCRIPTS.items(), forked):
            spawned = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
            assert (done.returncode, done.stdout) == (spawned.returncode, spawned.stdout), (label, done, spawned)
            # a traceback has one frame more (the server's call of the script); its first and last lines are equal
            assert _first_and_last(done.stderr) == _first_and_last(spawned.stderr), (label, done, spawned)
        hung, quick = server.run_together([("import time; time.sleep(60)", env), ("print('quick')", env)], timeout=1)
        assert hung.timed_out and hung.returncode is None, hung
        assert (quick.returncode, quick.stdout) == (0, "quick\n"), quick
