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

Local: no collectives; any thread may write the file while one :class:`WriteBack` follows it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

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
    """Follows one open file: :meth:`advance` says how many bytes it has received; a task on ``pool`` starts the
    write-back of every :data:`WRITE_BACK_BYTES` received since the last start; :meth:`close` ends the task (call it
    before the file's fsync and close)."""

    def __init__(self, descriptor: int, pool: ThreadPoolExecutor) -> None:
        self._descriptor = descriptor
        self._received = 0
        self._started = 0
        self._closed = False
        self._changed = threading.Condition()
        self._call = sync_file_range()
        self._task: Future | None = None
        if self._call is not None:
            try:
                self._task = pool.submit(self._run)
            except RuntimeError:  # the interpreter is exiting (a save a thread finishes then): no new threads
                pass

    @property
    def started(self) -> int:
        """How many bytes from the file's start have had their write-back started."""
        with self._changed:
            return self._started

    def advance(self, received: int) -> None:
        """The file has received ``received`` bytes from its start."""
        if self._task is None:
            return
        with self._changed:
            self._received = received
            if received - self._started >= WRITE_BACK_BYTES:
                self._changed.notify()

    def close(self) -> None:
        """Stop following the file and wait for the helper task: a write-back already started stays started, a range
        not yet started is left to the fsync that follows."""
        if self._task is None:
            return
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._task.result()
        self._task = None

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._closed and self._received - self._started < WRITE_BACK_BYTES:
                    self._changed.wait()
                if self._closed:
                    return
                start, end = self._started, self._received
                self._started = end
            if self._call(self._descriptor, start, end - start, _SYNC_FILE_RANGE_WRITE) != 0:
                # advice only: the fsync that ends the file writes what this did not and reports any I/O error
                logger.debug("zero_bnb: sync_file_range failed (%s); the file's fsync writes it",
                             os.strerror(ctypes.get_errno()))
                with self._changed:
                    self._closed = True
                return
