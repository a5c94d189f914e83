"""Multi-process launches forked from one warm server instead of spawned cold (the test suite's launches).

A spawned rank imports torch, DeepSpeed and bitsandbytes before it runs anything: 5 to 7 s of CPU each, about 45
launches of 2 or 3 ranks in the suite. :func:`run_warm` hands a launch to a server spawned once per process (with the
CPU ranks' environment, see :func:`zero_bnb.testing.launch.child_environment_for`) that has imported them and every
module a launched function came from; it forks the ranks, which run exactly what a spawned rank runs
(:func:`zero_bnb.testing.launch.run_rank`), in the caller's environment of the moment and writing to the caller's
standard output and error (its descriptors are passed along). Each launch is a connection to the server's Unix socket
(with a random key), run by a fork of the server: launches from several threads run at once. A failure raises what
``torch.multiprocessing.start_processes`` raises: the first failed rank's traceback, or the signal that ended it.

Local to the calling process; CPU ranks only (CUDA cannot be used in a forked child).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

__all__ = ["WARM_ENV", "children_cpu_seconds", "run_warm", "stop_server", "warm_enabled"]

logger = logging.getLogger(__name__)

#: Set to "1" (the test suite does, in tests/conftest.py) to launch CPU ranks from the warm server.
WARM_ENV = "ZERO_BNB_WARM_LAUNCH"
#: What the server imports before its first launch.
_WARM_MODULES = ("torch", "torch.distributed", "deepspeed", "deepspeed.comm", "bitsandbytes", "zero_bnb",
                 "zero_bnb.testing.launch")

_server: Any = None  # (process, address, authkey) while one runs
_starting = threading.Lock()  # launches may come from several threads at once
_children_cpu = 0.0


def children_cpu_seconds() -> float:
    """CPU seconds spent by the ranks of every warm launch of this process so far (they are the server's children,
    so ``RUSAGE_CHILDREN`` does not count them here)."""
    return _children_cpu


def warm_enabled() -> bool:
    """Whether :func:`zero_bnb.testing.launch.run_distributed` sends CPU launches here."""
    return os.environ.get(WARM_ENV) == "1"


def _status(code: int) -> int:
    """A waitpid status as multiprocessing's exit code: -signal, or the exit status."""
    return -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def _rank(rank: int, world: int, store: str, fn: Callable[..., Any], args: bytes, env: dict[str, str],
          error_file: str, fds: tuple[int, int]) -> None:
    """A forked rank: the caller's environment and output, then what a spawned rank runs. Never returns."""
    from zero_bnb.testing.launch import exit_skipping_finalization, run_rank

    code = 1
    try:
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.environ.clear()
        os.environ.update(env)
        run_rank(rank, world, store, fn, pickle.loads(args), "cpu")  # ends the process when fn returns
    except BaseException as error:  # noqa: BLE001 - reported to the caller as a spawned rank's error would be
        with open(error_file, "w") as handle:
            handle.write(f"{getattr(error, 'zero_bnb_failed_at', time.monotonic())}\n{traceback.format_exc()}")
    finally:
        exit_skipping_finalization(code)


def _wait(pids: dict[int, int]) -> tuple[dict[int, int], float]:
    """Exit codes of every rank and the CPU seconds they spent; once one fails, the others are killed (as torch's
    launcher does: they would wait in a collective for ever)."""
    codes: dict[int, int] = {}
    cpu = 0.0
    while len(codes) < len(pids):
        pid, status, usage = os.wait4(-1, 0)
        rank = next((r for r, p in pids.items() if p == pid), None)
        if rank is None:
            continue
        cpu += usage.ru_utime + usage.ru_stime
        codes[rank] = _status(status)
        if codes[rank] != 0:
            for other, other_pid in pids.items():
                if other not in codes:
                    try:
                        os.kill(other_pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    return codes, cpu


def _leader(connection, fn: Callable[..., Any], args: bytes, world: int, store: str, env: dict[str, str],
            folder: str, fds: tuple[int, int]) -> None:
    """One launch, in a fork of the server: fork the ranks, wait for them, reply. Never returns."""
    try:
        pids = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                connection.close()
                _rank(rank, world, store, fn, args, env, os.path.join(folder, f"rank{rank}.error"), fds)
            pids[rank] = pid
        connection.send(_wait(pids))
    finally:
        os._exit(0)  # no finalizer: the listener's socket file belongs to the server


def _serve(address: str, authkey: bytes, ready) -> None:
    """The server: each connection is one launch, run by a fork of the server (its leader), so launches from several
    threads of the caller run at once; ``None`` ends it."""
    import importlib
    from multiprocessing.connection import Listener

    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    ready.send(os.getpid())
    ready.close()
    for name in _WARM_MODULES:
        importlib.import_module(name)
    while True:
        connection = listener.accept()
        message = connection.recv()
        if message is None:
            connection.close()
            listener.close()
            return
        fn_bytes, args, world, store, env, folder = message
        fds = (reduction.recv_handle(connection), reduction.recv_handle(connection))
        fn = pickle.loads(fn_bytes)  # imports fn's module here, once for every later launch
        gc.freeze()  # what the server imported is shared by its forks and skipped by their collector
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if os.fork() == 0:
            _leader(connection, fn, args, world, store, env, folder, fds)
        connection.close()
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # the leaders that ended
                pass


def _started():
    """The server (process, address, authkey), started now if none runs (or the last one died)."""
    global _server
    if _server is not None and _server[0].is_alive():
        return _server
    import multiprocessing

    from zero_bnb.testing.launch import child_environment

    folder = tempfile.mkdtemp(prefix="zero_bnb-warm-")
    address, authkey = os.path.join(folder, "server"), os.urandom(32)
    receiver, sender = multiprocessing.Pipe(duplex=False)
    with child_environment("cpu"):
        process = multiprocessing.get_context("spawn").Process(target=_serve, args=(address, authkey, sender),
                                                                daemon=True, name="zero_bnb-warm-launch")
        process.start()
    sender.close()
    if not receiver.poll(120):
        process.kill()
        raise RuntimeError("the warm launch server did not start listening within 120 s")
    receiver.recv()
    _server = (process, address, authkey)
    return _server


def stop_server() -> None:
    """End the server, if one runs. Registered at exit."""
    global _server
    if _server is None:
        return
    from multiprocessing.connection import Client

    process, address, authkey = _server
    _server = None
    with contextlib.suppress(OSError, EOFError):
        with Client(address, family="AF_UNIX", authkey=authkey) as connection:
            connection.send(None)
    process.join(timeout=10)
    if process.is_alive():
        process.kill()
    shutil.rmtree(os.path.dirname(address), ignore_errors=True)


atexit.register(stop_server)


def run_warm(fn: Callable[..., Any], world_size: int, args: tuple) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU ranks forked by the warm server and wait for them.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback in the message).
        torch.multiprocessing.ProcessExitedException: a rank ended by a signal or with a non-zero status.
        RuntimeError: the server itself died.
    """
    from multiprocessing.connection import Client

    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    with _starting:
        process, address, authkey = _started()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zero_bnb_rendezvous_") as folder:
        try:
            with Client(address, family="AF_UNIX", authkey=authkey) as connection:
                connection.send((pickle.dumps(fn), pickle.dumps(args), world_size, os.path.join(folder, "store"),
                                 dict(os.environ), folder))
                for fd in (1, 2):
                    reduction.send_handle(connection, fd, process.pid)
                codes, cpu = connection.recv()
        except (EOFError, OSError) as error:
            raise RuntimeError(f"the warm launch server (pid {process.pid}) or this launch's leader died: "
                               f"{error!r}; the server's exit code {process.exitcode}") from error
        global _children_cpu
        with _starting:
            _children_cpu += cpu
        logger.debug("warm launch of %s on %d ranks: %.1f s", getattr(fn, "__name__", fn), world_size,
                     time.monotonic() - started)
        failed = [rank for rank in range(world_size) if codes[rank] != 0]
        if not failed:
            return
        raised = {}
        for rank in failed:
            with contextlib.suppress(FileNotFoundError), open(os.path.join(folder, f"rank{rank}.error")) as handle:
                at, _, trace = handle.read().partition("\n")
                raised[rank] = (float(at), trace)
        if raised:  # the rank that raised first: a peer's collective breaks after it
            rank = min(raised, key=lambda r: raised[r][0])
            trace = raised[rank][1]
            raise ProcessRaisedException(f"\n\n-- Process {rank:d} terminated with the following error:\n{trace}",
                                         rank, -1)
        # the first rank that ended by itself (in the order they were reaped): the peers killed after it come later
        rank = next(r for r in codes if codes[r] != 0)
        code = codes[rank]
        if code < 0:
            name = signal.Signals(-code).name
            raise ProcessExitedException(f"process {rank:d} terminated with signal {name}", error_index=rank,
                                         error_pid=-1, exit_code=code, signal_name=name)
        raise ProcessExitedException(f"process {rank:d} terminated with exit code {code:d}", error_index=rank,
                                     error_pid=-1, exit_code=code)
