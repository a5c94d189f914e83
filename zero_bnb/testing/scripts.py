"""Short Python scripts run as ``python -c SCRIPT`` runs them, each in a process of its own, but forked from one warm
interpreter that imported what they import (about 2 s of CPU per script otherwise).

:class:`ScriptServer` starts that interpreter (``python -m zero_bnb.testing.scripts MODULE...``) with the
environment it is given; it imports the modules and then, per request, forks one child per script. A child takes
its script's environment (all of it, as ``subprocess`` would), writes to files of its own in place of standard output
and error, runs the script as ``__main__`` and ends as the interpreter would: non-daemon threads joined, ``atexit``
handlers run (those the imported modules registered too), the exit status Python gives (an uncaught exception: its
traceback, status 1; ``KeyboardInterrupt``: SIGINT; ``sys.exit(code)``: that code). A child still running at its
timeout is killed (SIGKILL).

Only for scripts whose behaviour does not depend on their process before their first statement: the modules were
imported once, under the interpreter's environment (a module that reads a variable at import time, such as
``deepspeed.constants`` reading ``DEEPSPEED_TIMEOUT``, keeps the interpreter's value); the script's ``PYTHONPATH`` and
working folder are the interpreter's; ``sys.modules["__main__"]`` is this module (a function the script defines
cannot be pickled by reference).

Local to the calling process; CPU only (CUDA cannot be used in a forked child).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Done", "ScriptServer"]

#: Seconds the caller waits for a reply beyond the scripts' own timeout (the server reads their output files).
_REPLY_MARGIN = 30.0
#: Seconds the interpreter may take to import its modules.
_START_TIMEOUT = 300.0


@dataclass(frozen=True)
class Done:
    """How one script ended: its exit status (negative: the signal that ended it, as ``subprocess`` gives it; None:
    killed at its timeout), standard output and standard error."""

    returncode: int | None
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        """The script was still running at its timeout (and was killed)."""
        return self.returncode is None


class ScriptServer:
    """The warm interpreter: ``with ScriptServer(modules, env) as server: server.run(script, env, timeout)``.

    ``env`` is the interpreter's environment (it imports ``modules`` under it; ``PYTHONPATH`` must let it import
    zero_bnb). Local to the process that made it; calls from several threads take turns.
    """

    def __init__(self, modules: Sequence[str], env: dict[str, str]) -> None:
        self._lock = threading.Lock()
        self._pending = b""
        self._folder: str | None = None
        self._process = subprocess.Popen([sys.executable, "-m", __name__, *modules], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE)
        ready = self._line(_START_TIMEOUT, f"importing {list(modules)}")
        if not ready.startswith("ready "):
            self.close()
            raise RuntimeError(f"the script server did not start (importing {list(modules)}): {ready!r}; its standard "
                               "error above says why")
        self._folder = ready[len("ready "):]

    def run(self, script: str, env: dict[str, str], timeout: float) -> Done:
        """Run ``script`` in a forked child with exactly the environment ``env``; wait at most ``timeout`` seconds."""
        [done] = self.run_together([(script, env)], timeout)
        return done

    def run_together(self, scripts: Sequence[tuple[str, dict[str, str]]], timeout: float) -> list[Done]:
        """Run every ``(script, env)`` at once, each in its own forked child; wait for all, at most ``timeout``
        seconds from the start."""
        request = {"scripts": [{"script": script, "env": env} for script, env in scripts], "timeout": timeout}
        with self._lock:
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            self._process.stdin.flush()
            reply = self._line(timeout + _REPLY_MARGIN, "running the scripts")
        return [Done(**done) for done in json.loads(reply)]

    def _line(self, timeout: float, what: str) -> str:
        """The server's next line, waited for at most ``timeout`` seconds (then the server is killed)."""
        deadline = time.monotonic() + timeout
        descriptor = self._process.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([descriptor], [], [], left)[0]:
                self._process.kill()
                self.close()
                raise RuntimeError(f"the script server did not answer within {timeout:.0f} s ({what}): killed")
            chunk = os.read(descriptor, 1 << 16)
            if not chunk:
                code = self._process.wait()
                self.close()
                raise RuntimeError(f"the script server ended (exit {code}) while {what}; its standard error says why")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        """End the server (it ends when its standard input closes; killed after 30 s) and remove its folder."""
        for pipe in (self._process.stdin, self._process.stdout):
            try:
                pipe.close()
            except OSError:  # the server is gone: its end of the pipe too
                pass
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._folder and os.path.basename(self._folder).startswith(_FOLDER_PREFIX):
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> ScriptServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# -- the server (python -m zero_bnb.testing.scripts MODULE...) ------------------------------------------------------

_FOLDER_PREFIX = "zero_bnb_scripts_"


def _child(script: str, env: dict[str, str], out: str, err: str, replies: int) -> None:
    """In a child the server forked: become ``python -c script`` under ``env``; never returns."""
    status = 1
    try:
        os.close(replies)  # the server's reply pipe: a child that outlives the server must not hold it open
        for path, target, flags in ((os.devnull, 0, os.O_RDONLY), (out, 1, os.O_WRONLY | os.O_TRUNC),
                                    (err, 2, os.O_WRONLY | os.O_TRUNC)):
            descriptor = os.open(path, flags)
            os.dup2(descriptor, target)
            os.close(descriptor)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["-c"]
        sys.path[0] = ""  # as python -c has it: the working folder
        namespace: dict[str, Any] = {"__name__": "__main__", "__doc__": None, "__spec__": None,
                                     "__builtins__": __builtins__}
        try:
            # dont_inherit: not this module's ``from __future__`` imports
            exec(compile(script, "<string>", "exec", dont_inherit=True), namespace)
            status = 0
        except SystemExit as exit:
            from zero_bnb.testing.ranks import exit_status

            status = exit_status(exit)
            if not isinstance(exit.code, int) and exit.code is not None:
                sys.stderr.write(f"{exit.code}\n")  # the script's own output, as Python writes it: not a log record
        except KeyboardInterrupt:  # python ends by SIGINT, so that its parent sees how it stopped
            traceback.print_exc()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # noqa: BLE001 - what Python prints for an uncaught exception, status 1
            traceback.print_exc()
        from zero_bnb.testing.ranks import exit_skipping_finalization

        exit_skipping_finalization(status)  # threads joined, atexit handlers run, streams flushed
    finally:
        os._exit(status)


def _run(request: dict[str, Any], folder: str, replies: int) -> list[dict[str, Any]]:
    """In the server: fork one child per script of ``request``, wait for them (SIGKILL at the timeout), and return
    each one's exit status and output."""
    children = []
    for index, entry in enumerate(request["scripts"]):
        out, err = os.path.join(folder, f"{index}.out"), os.path.join(folder, f"{index}.err")
        for path in (out, err):
            open(path, "w").close()
        pid = os.fork()
        if pid == 0:
            _child(entry["script"], entry["env"], out, err, replies)
        children.append((pid, out, err))
    deadline = time.monotonic() + float(request["timeout"])
    codes: dict[int, int | None] = {}
    while len(codes) < len(children):
        for pid, _, _ in children:
            if pid in codes:
                continue
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(code)  # as subprocess reports it
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[pid] = None
        time.sleep(0.005)
    results = []
    for pid, out, err in children:
        with open(out, errors="replace") as stdout, open(err, errors="replace") as stderr:
            results.append({"returncode": codes[pid], "stdout": stdout.read(), "stderr": stderr.read()})
    return results


def _write(descriptor: int, data: bytes) -> None:
    """Write all of ``data`` (a pipe may take it in parts)."""
    while data:
        data = data[os.write(descriptor, data):]


def _serve(modules: Sequence[str]) -> None:
    """The server's main: import ``modules``, say ``ready FOLDER``, then answer one request per line of standard
    input until it closes."""
    replies = os.dup(1)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # what the imports print does not reach the replies
    os.close(quiet)
    for name in modules:
        importlib.import_module(name)
    gc.freeze()  # the children do not copy what only the collector would touch
    folder = tempfile.mkdtemp(prefix=_FOLDER_PREFIX)  # (no finalizer: a child's atexit handlers must not remove it)
    try:
        _write(replies, f"ready {folder}\n".encode())
        for line in sys.stdin:
            sys.stdout.flush()
            sys.stderr.flush()
            _write(replies, json.dumps(_run(json.loads(line), folder, replies)).encode() + b"\n")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    _serve(sys.argv[1:])
