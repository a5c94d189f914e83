"""One checkpoint call at a time per engine.

``save_checkpoint`` and ``load_checkpoint`` are collective: every rank runs the same sequence of collectives. A
second call that starts while one of the same engine is still running (from another thread, or from a signal
handler or callback that interrupted it in this very thread, as a "save on SIGTERM" handler does) would interleave
its collectives with the first's differently on each rank: a hang, or one save's data in another's agreement. Such
a call is refused at once, on its own rank, before any collective and before anything is written. Where it
interrupted the running call (a signal handler), its error surfaces inside that call, which then usually fails like
any save that meets an error (on every rank, the previous checkpoint and ``latest`` unchanged); if the handler ran
while that call was between collectives outside the save's error guards, that rank leaves the call and the other
ranks wait for it (the previous checkpoint is kept either way). Signals reach the ranks at different moments, so a
handler should set a flag and the training loop save after the step.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from zero_bnb.errors import CheckpointUsageError

__all__ = ["one_at_a_time"]

_Method = TypeVar("_Method", bound=Callable[..., Any])
_GUARD = "_zero_bnb_checkpoint_call"


class _Running:
    """Which checkpoint call of an engine runs now, and in which thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.name = ""
        self.thread: threading.Thread | None = None


def one_at_a_time(method: _Method) -> _Method:
    """Wrap an engine's checkpoint method so that it refuses to start while another checkpoint call of the same
    engine runs. Local (the refusal involves no other rank).

    Raises:
        CheckpointUsageError: another checkpoint call of this engine is running (named, with its thread).
    """

    @functools.wraps(method)
    def guarded(engine: Any, *args: Any, **kwargs: Any) -> Any:
        running: _Running = engine.__dict__.setdefault(_GUARD, _Running())  # dict.setdefault: atomic under the GIL
        if not running.lock.acquire(blocking=False):
            here, holder = threading.current_thread(), running.thread
            where = ("this very thread: a signal handler or callback interrupted it" if holder is here
                     else f"thread {holder.name if holder else '?'!r}; this call came from thread {here.name!r}")
            raise CheckpointUsageError(
                f"{method.__name__} was called while this engine's {running.name or 'other checkpoint call'} is "
                f"still running ({where}). "
                f"Checkpoint calls are collective and must not overlap, so this call did nothing. Call "
                f"save_checkpoint and load_checkpoint from one thread, one at a time; to save on a signal, set a "
                f"flag in the handler and save after the training step"
            )
        try:  # from right after the acquire: an interrupt (Ctrl-C) landing anywhere after it still releases
            running.name, running.thread = method.__name__, threading.current_thread()
            return method(engine, *args, **kwargs)
        finally:
            running.name, running.thread = "", None
            running.lock.release()

    return guarded  # type: ignore[return-value]
