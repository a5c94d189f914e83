"""A call run on a pool thread that the calling thread can wait for through Ctrl-C without a lock left held.

``concurrent.futures.wait`` and ``Future.done`` take the future's condition in Python code: a Ctrl-C (or any signal
handler that raises) landing between the lock's acquisition and the end of ``__enter__``, or at the start of
``__exit__``, leaves that lock held by the waiting thread, and the pool thread that completes the future then blocks
on it forever (a save interrupted at the wrong instant hung). :class:`HelperCall` is waited for on a plain lock that
the pool thread releases when the call has ended: its acquisition is one C call, which a signal interrupts without
acquiring; whether the call ended is a plain attribute. Local; any thread may submit and wait.
"""

from __future__ import annotations

import _thread
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["HelperCall"]


class HelperCall:
    """``fn(*args)`` on a pool thread (:meth:`submit`); :meth:`wait` until it has ended, :attr:`error` what it
    raised."""

    def __init__(self) -> None:
        self.finished = False
        self.error: BaseException | None = None
        self._ended = _thread.allocate_lock()
        self._ended.acquire()

    @classmethod
    def submit(cls, pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> HelperCall | None:
        """Run ``fn(*args)`` on ``pool``; ``None`` where the interpreter is exiting (no new threads then)."""
        call = cls()
        try:
            pool.submit(call._run, fn, args)
        except RuntimeError:
            return None
        return call

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            self.error = error
        finally:
            self.finished = True
            self._ended.release()

    def wait(self) -> None:
        """Return once the call has ended, even through an interrupt (Ctrl-C), which is re-raised after (the call
        may read a buffer the interrupt would free)."""
        interrupted: BaseException | None = None
        # A signal handler's exception is raised at the next call or backward jump: at the loop's own jump back,
        # outside the try, it would escape while the call runs. Nested, one escapes only when interrupts land in
        # two handlers in a row (each a few bytecodes, against the lock's wait).
        while not self.finished:
            try:
                while not self.finished:
                    try:
                        self._ended.acquire()
                    except BaseException as error:  # noqa: BLE001 - a signal handler's (Ctrl-C): re-raised below
                        interrupted = error
            except BaseException as error:  # noqa: BLE001 - the same, raised at the inner loop's jump back
                interrupted = error
        if interrupted is not None:
            raise interrupted

    def result(self) -> None:
        """:meth:`wait`, then raise what the call raised."""
        self.wait()
        if self.error is not None:
            raise self.error
