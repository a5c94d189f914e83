"""Run one distributed job as forked processes of a warm server: cheap enough to start one per kill point.

A server process that imported torch, DeepSpeed and the front doors once forks ``world`` children per job
(:func:`fork_job`); they form a process group of their own (a new file rendezvous), run the job and exit. The job's
processes share one OS process group, so a kill point takes the whole job down at once (:func:`kill_job`), as a
preemption or a launcher would. Children never return into the server: they end with ``os._exit``.

Local to the server; the children join a gloo group (:func:`zero_bnb.testing.launch.init_worker`).
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable

__all__ = ["fork_job", "kill_job", "run_server"]


def kill_job() -> None:
    """SIGKILL every process of this job (the caller included) at once."""
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _status(code: int) -> str:
    if os.WIFSIGNALED(code):
        return signal.Signals(os.WTERMSIG(code)).name
    return f"exit {os.WEXITSTATUS(code)}"


def _child(rank: int, world: int, store: str, log: str, job: Callable[[int, int], None]) -> None:
    code = 1
    try:
        descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(descriptor, 1)
        os.dup2(descriptor, 2)
        from zero_bnb.testing.launch import init_worker

        init_worker(rank, world, store)
        job(rank, world)
        import torch.distributed as dist

        dist.destroy_process_group()
        code = 0
    except SystemExit as exit:  # sys.exit(status) in the job: its status, as a script's would be
        from zero_bnb.testing.ranks import exit_status

        code = exit_status(exit)
    except BaseException:  # noqa: BLE001 - the exit status and the log report it
        traceback.print_exc()
    finally:
        os._exit(code)


def fork_job(world: int, job: Callable[[int, int], None], prefix: str, *, timeout: float = 90.0) -> dict[str, str]:
    """Run ``job(rank, world)`` on ``world`` forked processes and wait for them; returns rank -> exit status
    (``"exit 0"``, ``"SIGKILL"``, ``"timeout: SIGKILL"``). Each rank's output goes to ``{prefix}.rank{r}.log``."""
    store = f"{prefix}.store"
    if os.path.exists(store):
        os.remove(store)
    pids: dict[int, int] = {}
    group = 0
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, group)  # the first child leads the job's process group, the others join it
            _child(rank, world, store, f"{prefix}.rank{rank}.log", job)
        try:
            os.setpgid(pid, group or pid)  # also here: whichever of parent and child runs first, the group exists
        except (ProcessLookupError, PermissionError):
            pass  # the child did it (and may have ended already)
        group = group or pid
        pids[rank] = pid
    status: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(status) < world:
        for rank, pid in pids.items():
            if str(rank) not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[str(rank)] = _status(code)
        if time.monotonic() > deadline:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for rank, pid in pids.items():
                if str(rank) not in status:
                    status[str(rank)] = "timeout: " + _status(os.waitpid(pid, 0)[1])
        time.sleep(0.005)
    return status


def _serve(target: Callable[..., None], args: tuple) -> None:
    """The spawned server: DeepSpeed warmed up (:func:`zero_bnb.testing.ranks.warm_up_deepspeed`), then ``target``."""
    from zero_bnb.testing.ranks import warm_up_deepspeed

    warm_up_deepspeed()
    target(*args)


def run_server(target: Callable[..., None], *args: object, what: str) -> None:
    """Run ``target(*args)`` in a spawned process (the warm server that forks the jobs) started with the CPU ranks'
    environment (:func:`zero_bnb.testing.ranks.child_environment_for`: one thread of OpenMP, no CUDA device, DeepSpeed's
    CPU accelerator, inherited by every job) and DeepSpeed's lazy imports and ops probe done
    (:func:`zero_bnb.testing.ranks.warm_up_deepspeed`), and wait for it. The caller's environment is left as it was.

    Raises:
        RuntimeError: the server failed; names ``what`` and its exit code.
    """
    import multiprocessing

    from zero_bnb.testing.ranks import child_environment

    with child_environment("cpu"):  # the server's environment, not left behind in the caller's
        server = multiprocessing.get_context("spawn").Process(target=_serve, args=(target, args))
        server.start()
    server.join()
    if server.exitcode != 0:
        raise RuntimeError(f"{what} exited with {server.exitcode}")
