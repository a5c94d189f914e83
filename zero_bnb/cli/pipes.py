"""Commands whose output is piped into a reader that stops early (``zero-bnb inspect CKPT | head``).

Python ignores SIGPIPE, so a write to a pipe whose reader is gone raises ``BrokenPipeError``, from a ``print`` or
from the flush of ``sys.stdout`` at exit ("Exception ignored ... BrokenPipeError"). :func:`quiet_on_broken_pipe`
runs a command as Python's documentation recommends for command-line tools
(https://docs.python.org/3/library/signal.html#note-on-sigpipe): standard output is flushed inside the guard, and on
``BrokenPipeError`` it is pointed at ``os.devnull`` so that nothing is written (or fails) later; the command then ends
without a traceback or message, with :data:`EXIT_BROKEN_PIPE`.

Local, no collectives.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

__all__ = ["EXIT_BROKEN_PIPE", "quiet_on_broken_pipe"]

#: Exit status of a command whose standard output's reader went away: a shell's status of a process that SIGPIPE
#: ended (141), not 1, which ``zero-bnb verify`` uses for a checkpoint that fails a check.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _same_file(first: int, second: int) -> bool:
    """Whether the descriptors ``first`` and ``second`` are open on the same file (``2>&1 | head``)."""
    try:
        one, other = os.fstat(first), os.fstat(second)
    except OSError:
        return False
    return (one.st_dev, one.st_ino) == (other.st_dev, other.st_ino)


def _silence_stdout() -> None:
    """Point standard output (and standard error too, when it is the same broken pipe) at ``os.devnull``."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor (a test's StringIO)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        stderr = sys.stderr.fileno() if sys.stderr is not None else -1
    except (AttributeError, OSError, ValueError):
        stderr = -1
    if stderr >= 0 and _same_file(descriptor, stderr):
        os.dup2(devnull, stderr)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def quiet_on_broken_pipe(command: Callable[[], int]) -> int:
    """Run ``command`` and flush standard output; returns its exit code, or :data:`EXIT_BROKEN_PIPE` (and nothing
    more is written to standard output) when standard output's reader went away."""
    try:
        try:
            return command()
        finally:  # inside the guard: a broken pipe met by the flush at exit could not be caught
            sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
