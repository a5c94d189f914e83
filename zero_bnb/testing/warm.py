"""Multi-process launches forked from one warm server instead of spawned cold (the test suite's launches).

A spawned rank imports torch, DeepSpeed and bitsandbytes before it runs anything: 5 to 7 s of CPU each, about 45
launches of 2 or 3 ranks in the suite. :func:`run_warm` hands a launch to a server spawned once per process (with the
CPU ranks' environment, see :func:`zero_bnb.testing.ranks.child_environment_for`) that has imported them and every
module a launched function came from; it forks the ranks, which run exactly what a spawned rank runs
(:func:`zero_bnb.testing.ranks.run_rank`), in the caller's environment of the moment and writing to the caller's
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

from zero_bnb.testing.ranks import child_environment, exit_skipping_finalization, exit_status, run_rank

__all__ = ["WARM_ENV", "children_cpu_seconds", "enable_here", "run_warm", "stop_server", "warm_enabled"]

logger = logging.getLogger(__name__)

#: Set to "1" to launch CPU ranks from the warm server (inherited by the processes started; the test suite calls
#: :func:`enable_here` instead).
WARM_ENV = "ZERO_BNB_WARM_LAUNCH"
#: What the server imports before its first launch.
_WARM_MODULES = ("torch", "torch.distributed", "deepspeed", "deepspeed.comm", "bitsandbytes", "zero_bnb",
                 "zero_bnb.testing.ranks")

_server: Any = None  # (process, address, authkey) while one runs
_starting = threading.Lock()  # launches may come from several threads at once
_children_cpu = 0.0
_enabled_here = False


def children_cpu_seconds() -> float:
    """CPU seconds spent by the ranks of every warm launch of this process so far (they are the server's children,
    so ``RUSAGE_CHILDREN`` does not count them here)."""
    return _children_cpu


def enable_here() -> None:
    """Send this process's CPU launches here (the test suite does, in tests/conftest.py); unlike ``WARM_ENV``, the
    processes it starts (a user's demo run by a test) launch as a user's would."""
    global _enabled_here
    _enabled_here = True


def warm_enabled() -> bool:
    """Whether :func:`zero_bnb.testing.launch.run_distributed` sends CPU launches here: ``WARM_ENV`` says so ("1" or
    "0"), else whether :func:`enable_here` was called."""
    value = os.environ.get(WARM_ENV)
    return value == "1" if value in ("0", "1") else _enabled_here


def _as_spawned(rank: int, caller: dict[str, Any]) -> None:
    """Undo in a forked rank what it inherited from the server and a spawned rank would not have: the caller's
    working folder, umask, module path and environment; fresh random states (``random``, torch, NumPy); not a daemon
    (a daemonic process may not start children: DataLoader workers, pools); its name. The string-hash seed cannot be
    changed after the interpreter started: every warm rank has the server's (``PYTHONHASHSEED``)."""
    import multiprocessing.process
    import random

    process = multiprocessing.process.current_process()
    process._config["daemon"] = False
    process.name = f"WarmRank-{rank}"
    os.chdir(caller["cwd"])
    os.umask(caller["umask"])
    sys.path[:] = caller["path"]
    os.environ.clear()
    os.environ.update(caller["env"])
    random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the launch's leader) ends."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _rank(rank: int, world: int, store: str, fn_bytes: bytes, args: bytes, caller: dict[str, Any],
          error_file: str, fds: tuple[int, int], listener_fd: int) -> None:
    """A forked rank: the caller's environment and output, then what a spawned rank runs. Never returns. Ends as a
    spawned rank does: ``sys.exit(n)`` gives status ``n`` and no error; an exception is reported with its
    traceback."""
    code = 1
    try:
        _die_with_parent()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (*fds, listener_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        _as_spawned(rank, caller)
        run_rank(rank, world, store, pickle.loads(fn_bytes), pickle.loads(args), "cpu")  # ends the process
    except SystemExit as exit:
        code = exit_status(exit)
        if code:  # when it ended: its peers' collectives break after it
            _report(error_file, f"{getattr(exit, 'zero_bnb_failed_at', time.monotonic())}\nexit\n{code}")
    except BaseException as error:  # noqa: BLE001 - reported to the caller as a spawned rank's error would be
        _report(error_file, f"{getattr(error, 'zero_bnb_failed_at', time.monotonic())}\nraised\n"
                            f"{traceback.format_exc()}")
    finally:
        exit_skipping_finalization(code)


def _report(error_file: str, text: str) -> None:
    """Write a rank's end whole or not at all: the leader kills the other ranks once one fails, perhaps mid-write."""
    with open(error_file + ".part", "w") as handle:
        handle.write(text)
    os.replace(error_file + ".part", error_file)


def _kill(pids: dict[int, int], done: dict[int, int], killed: set[int]) -> None:
    for rank, pid in pids.items():
        if rank not in done:
            killed.add(rank)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait(pids: dict[int, int], connection) -> tuple[dict[int, int], float, list[int]]:
    """Exit codes of every rank (in the order they ended), the CPU seconds they spent and the ranks killed here: once
    one fails, the others are killed (as torch's launcher does: they would wait in a collective for ever), and all of
    them if the caller went away (its end of the connection closed: interrupted, killed)."""
    codes: dict[int, int] = {}
    killed: set[int] = set()
    cpu = 0.0
    while len(codes) < len(pids):
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            if connection.poll(0.05):  # the caller sends nothing while it waits: this is its end closing
                _kill(pids, codes, killed)
            continue
        rank = next((r for r, p in pids.items() if p == pid), None)
        if rank is None:
            continue
        cpu += usage.ru_utime + usage.ru_stime
        codes[rank] = os.waitstatus_to_exitcode(status)  # -signal, or the exit status
        if codes[rank] != 0:
            _kill(pids, codes, killed)
    return codes, cpu, sorted(killed)


def _leader(connection, fn_bytes: bytes, args: bytes, world: int, store: str, caller: dict[str, Any],
            folder: str, fds: tuple[int, int], listener_fd: int) -> None:
    """One launch, in a fork of the server: fork the ranks, wait for them, reply. Never returns."""
    try:
        pids = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                connection.close()
                _rank(rank, world, store, fn_bytes, args, caller, os.path.join(folder, f"rank{rank}.error"), fds,
                      listener_fd)
            pids[rank] = pid
        for fd in fds:
            os.close(fd)
        connection.send(_wait(pids, connection))
    finally:
        os._exit(0)  # no finalizer: the listener's socket file belongs to the server


def _warm_import(fn_bytes: bytes, path: list[str]) -> None:
    """Import, in the server, the module a launched function comes from (once: every later launch's ranks find it
    imported); a module that fails to import here fails in the ranks, where it is reported."""
    import importlib

    for entry in path:
        if entry not in sys.path:
            sys.path.append(entry)
    with contextlib.suppress(Exception):
        importlib.import_module(pickle.loads(fn_bytes).__module__)


def _serve(address: str, authkey: bytes, ready) -> None:
    """The server: each connection is one launch, run by a fork of the server (its leader), so launches from several
    threads of the caller run at once; ``None`` ends it. A launch that fails cannot end the server."""
    import importlib
    from multiprocessing.connection import Listener

    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    listener_fd = listener._listener._socket.fileno()
    ready.send(os.getpid())
    ready.close()
    for name in _WARM_MODULES:
        importlib.import_module(name)
    while True:
        try:
            connection = listener.accept()
            message = connection.recv()
        except (OSError, EOFError):  # a caller that went away before sending its launch
            continue
        if message is None:
            connection.close()
            listener.close()
            return
        try:
            fn_bytes, args, world, store, caller, folder = message
            fds = (reduction.recv_handle(connection), reduction.recv_handle(connection))
        except Exception:  # noqa: BLE001 - a malformed launch: its caller sees the connection close
            connection.close()
            continue
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if os.fork() == 0:
            _leader(connection, fn_bytes, args, world, store, caller, folder, fds, listener_fd)
        connection.close()
        for fd in fds:
            os.close(fd)
        _warm_import(fn_bytes, caller["path"])
        gc.freeze()  # what the server imported is shared by its forks and skipped by their collector
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # the leaders that ended
                pass


def _started():
    """The server (process, address, authkey), started now if none runs (or the last one died)."""
    global _server
    if _server is not None and _server[0].is_alive():
        return _server
    if _server is not None:  # it died: its socket's folder goes with it
        shutil.rmtree(os.path.dirname(_server[1]), ignore_errors=True)
    import multiprocessing

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

    fn_bytes, args_bytes = pickle.dumps(fn), pickle.dumps(args)  # an unpicklable launch fails here, as spawned
    umask = os.umask(0)
    os.umask(umask)
    caller = {"cwd": os.getcwd(), "umask": umask, "path": list(sys.path), "env": dict(os.environ)}
    with _starting:
        process, address, authkey = _started()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zero_bnb_rendezvous_") as folder:
        try:
            with Client(address, family="AF_UNIX", authkey=authkey) as connection:
                connection.send((fn_bytes, args_bytes, world_size, os.path.join(folder, "store"), caller, folder))
                for fd in (1, 2):
                    reduction.send_handle(connection, fd, process.pid)
                codes, cpu, killed = connection.recv()
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
        ended = {}  # rank -> (when, "raised" or "exit", traceback or status)
        for rank in failed:
            with contextlib.suppress(FileNotFoundError), open(os.path.join(folder, f"rank{rank}.error")) as handle:
                at, kind, payload = handle.read().split("\n", 2)
                ended[rank] = (float(at), kind, payload)
        # A rank that died by a signal it was not sent here (a native crash) is the cause of its peers' broken
        # collectives, which they raise; otherwise the rank that raised or exited first.
        crashed = [rank for rank in codes if codes[rank] < 0 and rank not in ended and rank not in killed]
        rank = crashed[0] if crashed else min(ended, key=lambda r: ended[r][0]) if ended else \
            next(r for r in codes if codes[r] != 0)
        if rank in ended and ended[rank][1] == "raised":
            raise ProcessRaisedException(f"\n\n-- Process {rank:d} terminated with the following error:\n"
                                         f"{ended[rank][2]}", rank, -1)
        if rank in ended:
            codes[rank] = int(ended[rank][2])
        code = codes[rank]
        if code < 0:
            name = signal.Signals(-code).name
            raise ProcessExitedException(f"process {rank:d} terminated with signal {name}", error_index=rank,
                                         error_pid=-1, exit_code=code, signal_name=name)
        raise ProcessExitedException(f"process {rank:d} terminated with exit code {code:d}", error_index=rank,
                                     error_pid=-1, exit_code=code)
