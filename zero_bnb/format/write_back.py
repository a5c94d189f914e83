"""Early write-back of a file being written: the disk starts on what a file has received while the rest is still
being serialised, so the fsync that ends the file finds little left to write.

Linux holds a checkpoint's dirty pages in memory until an fsync (or ``dirty_background_ratio`` of memory, several
GiB on a training machine): a save then serialises every byte and only after that waits for the whole file to reach
the disk. :class:`WriteBack` asks the kernel, from a helper thread, to start writing each range the file has
received (``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk works while the save serialises. It is advice
only: it never waits for the disk, its failures are ignored, and the fsync that follows is what makes the file
durable and reports an I/O error. Where the call does not exist (not Linux), nothing is done.

A save's fsync waited 0.15 s for 405 MB before, 0.005 s after (``benchmarks/save_profile.py --floor``: see
docs/design.md, "Early write-back, and the disk's floor").

Local: no collectives; only the thread that writes a file calls its :class:`WriteBack`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from zero_bnb.format.helper_calls import HelperCall

__all__ = ["WRITE_BACK_BYTES", "WriteBack", "sync_file_range"]

logger = logging.getLogger(__name__)

#: The write-back of a file starts in ranges of at least this many bytes.
WRITE_BACK_BYTES = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start write-out of the range's dirty pages, do not wait for it


@functools.cache
def sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range(fd, offset, nbytes, flags)`` (called without the GIL), or ``None`` where libc has
    none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


class WriteBack:
    """Follows one open file: :meth:`advance` says how many bytes it has received; each time
    :data:`WRITE_BACK_BYTES` or more have arrived since the last start, one short task on ``pool`` starts their
    write-back (one in flight at most: what arrives meanwhile joins the next). No task waits for the writer, so
    whatever interrupts the writer (Ctrl-C anywhere), the pool's exit waits for one ``sync_file_range`` call at most,
    and a file under :data:`WRITE_BACK_BYTES` starts no thread. :meth:`close` waits for the call in flight (call it
    before the file's fsync and close). Only the thread that writes the file calls :meth:`advance` and :meth:`close`.
    """

    def __init__(self, descriptor: int, pool: ThreadPoolExecutor) -> None:
        self._descriptor = descriptor
        self._pool = pool
        self._started = 0
        self._call = sync_file_range()
        self._off = self._call is None
        self._pending: HelperCall | None = None

    @property
    def started(self) -> int:
        """How many bytes from the file's start have had their write-back started (handed to a task)."""
        return self._started

    def advance(self, received: int) -> None:
        """The file has received ``received`` bytes from its start."""
        if self._off or received - self._started < WRITE_BACK_BYTES:
            return
        if self._pending is not None and not self._pending.finished:
            return  # one call at a time: this range joins the next
        start = self._started
        self._pending = HelperCall.submit(self._pool, self._start, start, received - start)
        if self._pending is None:  # the interpreter is exiting (a save a thread finishes then): no new threads
            self._off = True
            return
        self._started = received

    def close(self) -> None:
        """Stop following the file and wait for the call in flight; a range not yet started is left to the fsync."""
        self._off = True
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def _start(self, offset: int, nbytes: int) -> None:
        try:
            failed = self._call(self._descriptor, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0
            cause = os.strerror(ctypes.get_errno()) if failed else ""
        except Exception as error:  # noqa: BLE001 - advice only: nothing here may replace the save's own outcome
            failed, cause = True, repr(error)
        if failed:
            # the fsync that ends the file writes what this did not, and reports any I/O error
            logger.debug("zero_bnb: sync_file_range failed (%s); the file's fsync writes it", cause)
            self._off = True
