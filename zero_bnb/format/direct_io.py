"""Files written around the page cache (``O_DIRECT``), for an asynchronous save's background writer.

A buffered write copies every byte into the page cache and the kernel writes it back later, on the same cores and
memory bus as training: beside a 2-thread training step on a 2-core Xeon, 400 MiB written that way slowed the steps
0.13-0.30 s in all, written directly 0.04-0.07 s (``docs/benchmarks.md``, "asynchronous saves"). Inside
:func:`direct_writes` (per thread) :func:`open_new` gives a :class:`DirectFile`; elsewhere, or where the file system
has no ``O_DIRECT`` (ramfs; tmpfs before Linux 6.6), a buffered file. The bytes written and the fsync that follows
are the same either way. Local.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy

__all__ = ["DirectFile", "direct_writes", "open_new"]

#: ``O_DIRECT`` (0 where the OS has none) and the bytes of each direct write (a multiple of every block size).
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_BUFFER = 1 << 22

_direct = threading.local()


@contextmanager
def direct_writes() -> Iterator[None]:
    """The files this thread writes inside the block bypass the page cache (``O_DIRECT`` where the file system takes
    it): an asynchronous save's writer, whose copies into the page cache and their write-back, on the cores and the
    memory bus training uses, slowed the steps beside it about three times as much as the same bytes written
    directly (``docs/benchmarks.md``). A synchronous save keeps the page cache: there the write-back overlaps the
    rest of the save. Local."""
    previous = getattr(_direct, "on", False)
    _direct.on = True
    try:
        yield
    finally:
        _direct.on = previous


class DirectFile:
    """A new file written with ``O_DIRECT`` through one page-aligned buffer of :data:`_DIRECT_BUFFER` bytes, each
    full buffer one write; the tail (which need not fill a block) is written after ``O_DIRECT`` is cleared. Where the
    file system refuses a direct write (``EINVAL``), the rest is written through the page cache."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor  # closed by __exit__ (by the caller if this raises)
        self._buffer = mmap.mmap(-1, _DIRECT_BUFFER)  # page-aligned, as O_DIRECT needs
        self._array = numpy.frombuffer(self._buffer, dtype=numpy.uint8)  # copies into it release the GIL
        self._filled = 0

    def write(self, data: Any) -> int:
        source = numpy.frombuffer(memoryview(data).cast("B"), dtype=numpy.uint8)
        done = 0
        while done < source.size:
            take = min(source.size - done, _DIRECT_BUFFER - self._filled)
            numpy.copyto(self._array[self._filled : self._filled + take], source[done : done + take])
            self._filled += take
            done += take
            if self._filled == _DIRECT_BUFFER:
                self._drain()
        return done

    def _drain(self) -> None:
        data = memoryview(self._buffer)[: self._filled]
        try:
            while data.nbytes:
                try:
                    written = os.write(self._descriptor, data)
                except OSError as error:
                    if error.errno != errno.EINVAL or not self._through_page_cache():
                        raise
                    continue
                if written == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                data = data[written:]
        finally:
            data.release()
        self._filled = 0

    def _through_page_cache(self) -> bool:
        """Clear ``O_DIRECT``; whether it was set."""
        flags = fcntl.fcntl(self._descriptor, fcntl.F_GETFL)
        if not flags & _O_DIRECT:
            return False
        fcntl.fcntl(self._descriptor, fcntl.F_SETFL, flags & ~_O_DIRECT)
        return True

    def flush(self) -> None:
        """Write what the buffer holds. It need not fill a block, so ``O_DIRECT`` is cleared first: call it at the
        end (``torch.save`` does, once); what is written after an earlier call goes through the page cache."""
        if self._filled:
            self._through_page_cache()
            self._drain()

    def fileno(self) -> int:
        return self._descriptor

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the file. What the buffer still holds is dropped: :meth:`flush` first (``_durable_write`` does)."""
        try:
            del self._array  # the buffer's last export: an mmap with one cannot be closed
            self._buffer.close()
        finally:
            os.close(self._descriptor)


def open_new(path: str, flags: int) -> Any:
    """``os.open(path, flags)`` (the caller's flags create it) as a file object to write: a :class:`DirectFile` inside
    :func:`direct_writes` where the file system takes ``O_DIRECT``, else a buffered file.

    ``O_DIRECT`` is asked for once the file exists (``fcntl``): a file system without it (ramfs, tmpfs before Linux
    6.6, overlayfs over them) creates the file and only then refuses an ``open`` with ``O_DIRECT``, and a buffered
    retry of an ``O_EXCL`` open would find it there.
    """
    descriptor = os.open(path, flags, 0o666)
    try:
        if getattr(_direct, "on", False) and _O_DIRECT and _direct_io_on(descriptor):
            return DirectFile(descriptor)
    except BaseException:
        os.close(descriptor)
        raise
    # Outside the try: once fdopen has made its file object, that object closes the descriptor when an interrupt
    # unwinds it, and a second close here could close a file another thread opened under the same number since.
    return os.fdopen(descriptor, "wb")


def _direct_io_on(descriptor: int) -> bool:
    """Set ``O_DIRECT`` on ``descriptor``; ``False`` where its file system refuses it (``EINVAL``)."""
    try:
        fcntl.fcntl(descriptor, fcntl.F_SETFL, fcntl.fcntl(descriptor, fcntl.F_GETFL) | _O_DIRECT)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return False
    return True
