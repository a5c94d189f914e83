"""Short Python scripts run as ``python -c SCRIPT`` runs them, each in a process of its own, but forked from one warm
interpreter that imported what they import (about 2 s of CPU per script otherwise).

:class:`ScriptServer` starts that interpreter (``python -m zero_bnb.testing.scripts MODULE...``) with the
environment it is given; it imports the modules and then, per request, forks one child per script. A child takes
its script's environment (all of it, as ``subprocess`` would), writes to files of its own in place of standard output
and error, runs the script as ``__main__`` and ends with the exit status Python would give it (an uncaught exception:
its traceback, status 1; ``sys.exit(code)``: that code) without running ``atexit`` handlers (the interpreter's,
inherited, are not the script's). A child still running at its timeout is killed (SIGKILL).

Only for scripts whose behaviour does not depend on their environment before their first statement: the
interpreter imported the modules once, under its own environment (a module that reads a variable at import time,
such as ``deepspeed.constants`` reading ``DEEPSPEED_TIMEOUT``, keeps the interpreter's value).

Local to the calling process; CPU only (CUDA cannot be used in a forked child).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Done", "ScriptServer"]


@dataclass(frozen=True)
class Done:
    """How one script ended: its exit status (negative: the signal that ended it, as ``subprocess`` gives it; None:
    killed at its timeout), standard output and standard error."""

    returncode: int | None
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


class ScriptServer:
    """The warm interpreter: ``with ScriptServer(modules, env) as server: server.run(script, env, timeout)``.

    ``env`` is the interpreter's environment (it imports ``modules`` under it; ``PYTHONPATH`` must let it import
    zero_bnb). One caller thread at a time.
    """

    def __init__(self, modules: Sequence[str], env: dict[str, str]) -> None:
        self._process = subprocess.Popen([sys.executable, "-m", __name__, *modules], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        ready = self._process.stdout.readline()
        if ready.strip() != "ready":
            self.close()
            raise RuntimeError(f"the script server did not start (importing {list(modules)}): {ready!r}; its standard "
                               "error above says why")

    def run(self, script: str, env: dict[str, str], timeout: float) -> Done:
        """Run ``script`` in a forked child with exactly the environment ``env``; wait at most ``timeout`` seconds."""
        [done] = self.run_together([(script, env)], timeout)
        return done

    def run_together(self, scripts: Sequence[tuple[str, dict[str, str]]], timeout: float) -> list[Done]:
        """Run every ``(script, env)`` at once, each in its own forked child; wait for all, at most ``timeout``
        seconds from the start."""
        request = [{"script": script, "env": env} for script, env in scripts]
        self._process.stdin.write(json.dumps({"scripts": request, "timeout": timeout}) + "\n")
        self._process.stdin.flush()
        reply = self._process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the script server ended (exit {self._process.wait()}); its standard error says why")
        return [Done(**done) for done in json.loads(reply)]

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> ScriptServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# -- the server (python -m zero_bnb.testing.scripts MODULE...) ------------------------------------------------------


def _child(script: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked child: become ``python -c script`` under ``env``; never returns."""
    status = 1
    try:
        descriptor = os.open(os.devnull, os.O_RDONLY)
        os.dup2(descriptor, 0)
        for path, target in ((out, 1), (err, 2)):
            descriptor = os.open(path, os.O_WRONLY | os.O_TRUNC)
            os.dup2(descriptor, target)
            os.close(descriptor)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["-c"]
        try:
            exec(compile(script, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            status = 0
        except SystemExit as exit:
            from zero_bnb.testing.ranks import exit_status

            status = exit_status(exit)
            if not isinstance(exit.code, int) and exit.code is not None:
                print(exit.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what Python prints for an uncaught exception, status 1
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing more to write
                pass
        os._exit(status)


def _returncode(code: int) -> int:
    return -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def _run(request: dict, folder: str) -> list[dict]:
    children = []
    for index, entry in enumerate(request["scripts"]):
        out, err = os.path.join(folder, f"{index}.out"), os.path.join(folder, f"{index}.err")
        for path in (out, err):
            open(path, "w").close()
        pid = os.fork()
        if pid == 0:
            _child(entry["script"], entry["env"], out, err)
        children.append((pid, out, err))
    deadline = time.monotonic() + float(request["timeout"])
    codes: dict[int, int | None] = {}
    while len(codes) < len(children):
        for pid, _, _ in children:
            if pid in codes:
                continue
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = _returncode(code)
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


def _serve(modules: Sequence[str]) -> None:
    replies = os.fdopen(os.dup(1), "w")
    descriptor = os.open(os.devnull, os.O_WRONLY)
    os.dup2(descriptor, 1)  # what the imports print does not reach the replies
    for name in modules:
        importlib.import_module(name)
    gc.freeze()  # the children do not copy what only the collector would touch
    replies.write("ready\n")
    replies.flush()
    with tempfile.TemporaryDirectory(prefix="zero_bnb_scripts_") as folder:
        for line in sys.stdin:
            sys.stdout.flush()
            sys.stderr.flush()
            replies.write(json.dumps(_run(json.loads(line), folder)) + "\n")
            replies.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])
