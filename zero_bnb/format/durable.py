"""Durable file operations for checkpoints: every byte fsynced, every file checksummed.

All of zero_bnb's checkpoint writes go through this module, which

* computes each file's digest (:mod:`zero_bnb.format.digests`: BLAKE3, or SHA-256 without the ``blake3`` package)
  while it is written (no second read; large writes are hashed on a helper thread while the calling thread copies
  them into the file, both outside the GIL),
* writes ``torch.save`` files without the zip format's CRC-32 (:mod:`zero_bnb.format.zip_crc`: ``torch.load`` never
  checks it, the digest in the manifest is what a load verifies), which makes serialising about three times cheaper,
* flushes and fsyncs files and the folders that name them before a save is published (an asynchronous save's
  writer writes around the page cache: :mod:`zero_bnb.format.direct_io`),
* creates every file it writes itself, under a name nobody else chose, with ``O_CREAT | O_EXCL |
  O_NOFOLLOW`` (never opening an existing path, so a symlink planted where a file goes cannot
  redirect a write), inside a fresh staging folder or a fresh private folder
  (:class:`zero_bnb.format.publish.StagedFile`, which also publishes folders and single files by ``rename``),
* reports each step to an optional I/O hook (:func:`set_io_hook`), which fault-injection
  tests use to kill or fail a process at an exact point of a save.

Pure local I/O: no collectives; any rank may call these functions.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from zero_bnb.format import digests
from zero_bnb.format.direct_io import DirectFile, open_new
from zero_bnb.format.helper_calls import HelperCall
from zero_bnb.format.write_back import WRITE_BACK_BYTES, WriteBack
from zero_bnb.format.zip_crc import without_zip_crc32

__all__ = [
    "copy_file",
    "digest_file",
    "FileRecord",
    "fsync_dir",
    "fsync_entry",
    "fsync_file",
    "io_event",
    "IoHook",
    "makedirs",
    "remove_tree",
    "save_torch",
    "set_io_hook",
    "write_text",
]

logger = logging.getLogger(__name__)

#: Called as ``hook(event, path)`` before each durable I/O step; ``event`` is one of
#: ``mkdir``, ``create``, ``write``, ``fsync``, ``fsync_dir``, ``rename``, ``replace``, ``remove``.
IoHook = Callable[[str, str], None]

_hook: IoHook | None = None
_CHUNK = 1 << 20
#: Creates a new file or fails: never truncates, never follows a symlink, never inherited by children.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
#: Writes at least this long are hashed on a helper thread while they are written (shorter ones inline).
_PARALLEL_HASH_BYTES = 1 << 20


def set_io_hook(hook: IoHook | None) -> IoHook | None:
    """Install ``hook`` (or remove it with ``None``) in this process; returns the previous one."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def io_event(event: str, path: str) -> None:
    """Report the durable I/O step ``event`` on ``path`` to the installed hook (:func:`set_io_hook`), before it runs."""
    if _hook is not None:
        _hook(event, path)


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A written file: its path (relative to the checkpoint's tag folder), size and digest (hex) of ``algorithm``
    (:data:`~zero_bnb.format.digests.ALGORITHMS`)."""

    path: str
    size: int
    digest: str
    algorithm: str = digests.SHA256


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it.

    With ``hasher`` (a pool), a write of at least :data:`_PARALLEL_HASH_BYTES` is hashed there while this thread
    copies it into the file; the write returns once both are done, so the caller may reuse its buffer. The digest is
    the process's :func:`~zero_bnb.format.digests.writing_algorithm`'s; a BLAKE3 one uses up to ``threads`` threads
    (:func:`~zero_bnb.format.digests.spare_threads` for a blocking save; 1 for an asynchronous save's writer, which
    runs beside training).
    """

    def __init__(self, handle, path: str, hasher: ThreadPoolExecutor | None = None,
                 write_back: WriteBack | None = None, threads: int = 1) -> None:
        self._handle = handle
        self._path = path
        self._hasher = hasher
        self._write_back = write_back
        self.algorithm = digests.writing_algorithm()
        self._threads = threads  # only a BLAKE3 hash has threads (digests.new, digests.update_large)
        self.hash = digests.new(self.algorithm, threads=self._threads)
        self.size = 0
        self.error: BaseException | None = None
        #: Set once the file's fill has returned or raised: later writes are dropped (see :meth:`write`).
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.closed:
            # Only torch's zip writer writes after that: a torch.save interrupted (Ctrl-C) before it entered its
            # `with` block writes the archive's end from the C++ destructor whenever it is freed; an error raised
            # there aborts the process (std::terminate). The file is abandoned by then: drop the bytes.
            return view.nbytes
        hashing = None
        if self._hasher is not None and view.nbytes >= _PARALLEL_HASH_BYTES:
            hashing = HelperCall.submit(self._hasher, self._update_in_pieces, view)
            if hashing is None:  # the interpreter is exiting (a save a thread finishes then): no new threads
                self._hasher = None
        try:
            io_event("write", self._path)
            written = self._write(view)
        except BaseException as error:
            self.error = error  # torch's C++ writer replaces it with a generic message; keep the cause
            raise
        finally:
            if hashing is not None:
                hashing.wait()  # the caller may free or reuse the buffer once this returns
        if hashing is None:
            self.hash.update(view)
        else:
            hashing.result()
        self.size += written
        return written

    def _write(self, view: memoryview) -> int:
        """Write ``view`` to the file; with a write-back, in :data:`~zero_bnb.format.write_back.WRITE_BACK_BYTES`
        pieces, each handed to it once written (a tensor's storage is one write: its first pieces then reach the disk
        while the rest is copied)."""
        if self._write_back is None:
            return self._handle.write(view)
        written = 0
        for start in range(0, view.nbytes, WRITE_BACK_BYTES):
            written += self._handle.write(view[start : start + WRITE_BACK_BYTES])
            self._write_back.advance(self.size + written)
        return written

    def _update_in_pieces(self, view: memoryview) -> None:
        digests.update_large(self.hash, self.algorithm, view, threads=self._threads)

    def flush(self) -> None:
        self._handle.flush()


def _durable_write(path: str, root: str, fill: Callable[[_HashingWriter], None]) -> FileRecord:
    io_event("create", path)
    # Helper threads per file (one hashes, one starts the disk's write-back of a buffered file): a pool kept between
    # saves would not survive a fork (fault-injection trials).
    with open_new(path, _CREATE_FLAGS) as handle, ThreadPoolExecutor(2) as helpers:
        direct = isinstance(handle, DirectFile)  # an asynchronous save's writer, beside training: one hashing thread
        write_back = None if direct else WriteBack(handle.fileno(), helpers)
        writer = _HashingWriter(handle, path, helpers, write_back, 1 if direct else digests.spare_threads())
        try:
            try:
                fill(writer)
            finally:
                writer.closed = True
                if write_back is not None:
                    write_back.close()  # before the pool waits for its task
        except Exception as error:
            if writer.error is not None and writer.error is not error:
                raise writer.error from error
            raise
        handle.flush()
        io_event("fsync", path)
        os.fsync(handle.fileno())
    return FileRecord(os.path.relpath(path, root), writer.size, writer.hash.hexdigest(), writer.algorithm)


def save_torch(obj: Any, path: str, *, root: str) -> FileRecord:
    """``torch.save(obj)`` to the new file ``path``, fsynced; the record's path is relative to ``root``.

    Like every writer here it creates ``path`` (``O_EXCL | O_NOFOLLOW``): an existing file or link
    there is an error, never written through.
    """
    def fill(writer: _HashingWriter) -> None:
        with without_zip_crc32():
            torch.save(obj, writer)

    return _durable_write(path, root, fill)


def write_text(text: str, path: str, *, root: str) -> FileRecord:
    """Write ``text`` (UTF-8) to ``path``, fsynced; the record's path is relative to ``root``."""
    return _durable_write(path, root, lambda writer: writer.write(text.encode("utf-8")))


def copy_file(source: str, path: str, *, root: str) -> FileRecord:
    """Copy ``source`` to ``path`` byte for byte, fsynced; the record's path is relative to ``root``."""

    def fill(writer: _HashingWriter) -> None:
        with open(source, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                writer.write(chunk)

    return _durable_write(path, root, fill)


def digest_file(path: str, algorithm: str = digests.SHA256) -> tuple[int, str]:
    """Size in bytes and ``algorithm`` digest (hex) of the file at ``path`` (opened without following a link), read in
    1 MiB chunks."""
    return digests.of_chunks(algorithm, _read_chunks(path), what=path)  # the algorithm checked before the file opens


def _read_chunks(path: str) -> Iterator[bytes]:
    """The content of the file at ``path`` (opened without following a link) in 1 MiB chunks."""
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)),
                   "rb") as handle:
        yield from iter(lambda: handle.read(_CHUNK), b"")


def fsync_dir(path: str) -> None:
    """Make the entries of folder ``path`` (created, renamed or removed files) durable."""
    io_event("fsync_dir", path)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_file(path: str) -> bool:
    """Make the content of the regular file ``path`` durable (not following a link); ``False`` when ``path`` is no
    regular file (a link, a FIFO, gone)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return False
        io_event("fsync", path)
        os.fsync(descriptor)
        return True
    finally:
        os.close(descriptor)


def makedirs(path: str, *, fresh: bool = False, durable: bool = False) -> None:
    """``os.makedirs(path, exist_ok=True)``, reported to the I/O hook; ``fresh``: ``path`` must not exist yet.

    ``durable``: the entry of every folder it creates is fsynced in its parent (POSIX may otherwise lose a new folder,
    and every checkpoint later saved in it, in a crash after the save returned); a parent that cannot be opened for
    reading gets a WARNING instead."""
    io_event("mkdir", path)
    created = []
    folder = os.path.abspath(path)
    while durable and not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        created.append(folder)
        folder = os.path.dirname(folder)
    if fresh:
        os.mkdir(path)
    else:
        os.makedirs(path, exist_ok=True)
    for folder in reversed(created):
        fsync_entry(folder)


def fsync_entry(folder: str) -> None:
    """Make ``folder``'s own entry in its parent durable (POSIX may otherwise lose a folder made or renamed there in a
    crash, with everything in it); a parent that cannot be opened for reading gets a WARNING instead. Local."""
    folder = os.path.abspath(folder)
    try:
        fsync_dir(os.path.dirname(folder))
    except PermissionError as error:  # a parent this user may write but not read (a drop folder): not fatal
        logger.warning("zero_bnb: the folder %s is not made durable in its parent (%s); a crash soon after this save "
                       "could lose it", folder, error)


def remove_tree(path: str, *, via: str | None = None) -> None:
    """Remove folder ``path`` and everything in it, if it exists; a link or file there is removed itself (never followed).

    With ``via`` (a free name in the same folder, which the next save's cleanup removes if a crash leaves it), the
    folder is first renamed there and removed under that name: ``path`` names the whole folder until it names
    nothing, so a loader that looks it up never finds it half removed.
    """
    if os.path.lexists(path):
        io_event("remove", path)
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            if via is not None:
                io_event("rename", path)
                os.rename(path, via)
                path = via
            shutil.rmtree(path)
