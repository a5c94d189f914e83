"""Durable file operations for checkpoints: every byte fsynced, every file checksummed.

All of zero_bnb's checkpoint writes go through this module, which

* computes each file's SHA-256 while it is written (no second read; large writes are hashed on a helper thread
  while the calling thread copies them into the file, both outside the GIL),
* writes ``torch.save`` files without the zip format's CRC-32 (:mod:`zero_bnb.format.zip_crc`: ``torch.load`` never
  checks it, the SHA-256 in the manifest is what a load verifies), which makes serialising about three times cheaper,
* flushes and fsyncs files and the folders that name them before a save is published (an asynchronous save's
  writer writes around the page cache: :mod:`zero_bnb.format.direct_io`),
* creates every file it writes itself, under a name nobody else chose, with ``O_CREAT | O_EXCL |
  O_NOFOLLOW`` (never opening an existing path, so a symlink planted where a file goes cannot
  redirect a write), inside a fresh staging folder or a fresh private folder (:class:`StagedFile`),
* publishes a finished folder with ``rename`` and replaces single files (``latest``, the tools'
  outputs, ``zero_to_fp32.py``) by renaming them out of their private folder, so a reader sees the
  old version or the new one, never a half-written one, and a failure leaves nothing temporary
  (a writer that is killed leaves its private folder, which the next writer of that file removes),
* reports each step to an optional I/O hook (:func:`set_io_hook`), which fault-injection
  tests use to kill or fail a process at an exact point of a save.

Pure local I/O: no collectives; any rank may call these functions.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from zero_bnb.format.direct_io import open_new
from zero_bnb.format.lock import try_flock
from zero_bnb.format.zip_crc import without_zip_crc32

__all__ = [
    "TEMP_SUFFIX",
    "copy_file",
    "digest_file",
    "FileRecord",
    "finish_publish",
    "fsync_dir",
    "fsync_file",
    "IoHook",
    "makedirs",
    "note_published",
    "noting_publications",
    "Publication",
    "PublishedNotDurableError",
    "publish_folder",
    "remove_tree",
    "replace_text",
    "replacing",
    "save_torch",
    "set_io_hook",
    "StagedFile",
    "write_text",
]

logger = logging.getLogger(__name__)

#: Called as ``hook(event, path)`` before each durable I/O step; ``event`` is one of
#: ``mkdir``, ``create``, ``write``, ``fsync``, ``fsync_dir``, ``rename``, ``replace``, ``remove``.
IoHook = Callable[[str, str], None]

_hook: IoHook | None = None
_CHUNK = 1 << 20
#: Suffix of the private folders single files are written in before they are renamed into place.
TEMP_SUFFIX = ".zero_bnb-tmp"
#: Creates a new file or fails: never truncates, never follows a symlink, never inherited by children.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
#: Opens a folder itself (a link there is refused), for its flock.
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CLAIM_ATTEMPTS = 5
#: Writes at least this long are hashed on a helper thread while they are written (shorter ones inline).
_PARALLEL_HASH_BYTES = 1 << 20
#: The helper thread hashes in pieces this long: they stay in the L2 cache (about 15% less CPU than 1 MiB pieces on
#: the 2-core Xeon of benchmarks/results/save_profile.md).
_HASH_PIECE = 1 << 15


@dataclass(slots=True)
class Publication:
    """An output renamed into place, complete (see :func:`noting_publications`).

    ``durable`` is false from the rename until the folder that names it was synced: until then readers see the new
    output, but a power failure or a crash of the machine may bring back the previous one (or none).
    """

    path: str
    durable: bool = False


class PublishedNotDurableError(OSError):
    """The output ``filename`` was renamed into place, complete, but syncing the folder that names it failed.

    Readers see the new output now; only its durability is unconfirmed (a power failure or a crash of the machine may
    bring back the previous one). Unlike any other ``OSError`` of this module, the destination was changed. ``errno``
    is the failed sync's; ``__cause__`` is its error.
    """


_published: list[Publication] | None = None


@contextmanager
def noting_publications() -> Iterator[list[Publication]]:
    """Collect, in the yielded list, the outputs published (renamed into place, complete) inside the block by
    :func:`note_published`, and whether each was made durable: what a command interrupted afterwards must not call
    unpublished. Local; not nested across threads."""
    global _published
    previous, _published = _published, []
    try:
        yield _published
    finally:
        _published = previous


def note_published(path: str, *, durable: bool = True) -> None:
    """Record that the output ``path`` is now in place and complete (see :func:`noting_publications`); ``durable``:
    the folder naming it was synced too (a second call with ``durable=True`` marks an earlier record so)."""
    if _published is None:
        return
    for record in _published:
        if record.path == path:
            record.durable = record.durable or durable
            return
    _published.append(Publication(path, durable))


def _sync_published(path: str, folder: str) -> None:
    """``fsync_dir(folder)``, the folder naming ``path``, which was just renamed into place.

    Raises:
        PublishedNotDurableError: the sync failed (``path`` is in place all the same).
    """
    try:
        fsync_dir(folder)
    except OSError as error:
        raise PublishedNotDurableError(error.errno, f"{path} was put in place, but syncing its folder {folder} failed "
                                                    f"({type(error).__name__}: {error.strerror or error})", path) from error


def set_io_hook(hook: IoHook | None) -> IoHook | None:
    """Install ``hook`` (or remove it with ``None``) in this process; returns the previous one."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def _event(event: str, path: str) -> None:
    if _hook is not None:
        _hook(event, path)


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A written file: its path (relative to the checkpoint's tag folder), size and SHA-256."""

    path: str
    size: int
    sha256: str


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it.

    With ``hasher`` (a one-thread pool), a write of at least :data:`_PARALLEL_HASH_BYTES` is hashed there while this
    thread copies it into the file; the write returns once both are done, so the caller may reuse its buffer.
    """

    def __init__(self, handle, path: str, hasher: ThreadPoolExecutor | None = None) -> None:
        self._handle = handle
        self._path = path
        self._hasher = hasher
        self.hash = hashlib.sha256()
        self.size = 0
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        hashing = None
        if self._hasher is not None and view.nbytes >= _PARALLEL_HASH_BYTES:
            try:
                hashing = self._hasher.submit(self._update_in_pieces, view)
            except RuntimeError:  # the interpreter is exiting (a save a thread finishes then): no new threads
                self._hasher = None
        try:
            _event("write", self._path)
            written = self._handle.write(view)
        except BaseException as error:
            self.error = error  # torch's C++ writer replaces it with a generic message; keep the cause
            raise
        finally:
            if hashing is not None:
                _settle(hashing)  # the caller may free or reuse the buffer once this returns
        if hashing is None:
            self.hash.update(view)
        else:
            hashing.result()
        self.size += written
        return written

    def _update_in_pieces(self, view: memoryview) -> None:
        for start in range(0, view.nbytes, _HASH_PIECE):
            self.hash.update(view[start : start + _HASH_PIECE])

    def flush(self) -> None:
        self._handle.flush()


def _settle(future: Future) -> None:
    """Wait until ``future`` is done, even through an interrupt (Ctrl-C), which is re-raised after: the buffer it
    reads may be freed as soon as the interrupt unwinds the writer."""
    interrupted: KeyboardInterrupt | None = None
    while not future.done():
        try:
            wait([future])
        except KeyboardInterrupt as error:
            interrupted = error
    if interrupted is not None:
        raise interrupted


def _durable_write(path: str, root: str, fill: Callable[[_HashingWriter], None]) -> FileRecord:
    _event("create", path)
    # One helper thread per file: a pool kept between saves would not survive a fork (fault-injection trials).
    with open_new(path, _CREATE_FLAGS) as handle, ThreadPoolExecutor(1) as hasher:
        writer = _HashingWriter(handle, path, hasher)
        try:
            fill(writer)
        except Exception as error:
            if writer.error is not None and writer.error is not error:
                raise writer.error from error
            raise
        handle.flush()
        _event("fsync", path)
        os.fsync(handle.fileno())
    return FileRecord(os.path.relpath(path, root), writer.size, writer.hash.hexdigest())


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


def digest_file(path: str) -> tuple[int, str]:
    """Size in bytes and SHA-256 (hex) of the file at ``path`` (opened without following a link), read in 1 MiB
    chunks."""
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)),
                   "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def fsync_dir(path: str) -> None:
    """Make the entries of folder ``path`` (created, renamed or removed files) durable."""
    _event("fsync_dir", path)
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
        _event("fsync", path)
        os.fsync(descriptor)
        return True
    finally:
        os.close(descriptor)


def makedirs(path: str, *, fresh: bool = False) -> None:
    """``os.makedirs(path, exist_ok=True)``, reported to the I/O hook; ``fresh``: ``path`` must not exist yet."""
    _event("mkdir", path)
    if fresh:
        os.mkdir(path)
    else:
        os.makedirs(path, exist_ok=True)


def remove_tree(path: str, *, via: str | None = None) -> None:
    """Remove folder ``path`` and everything in it, if it exists; a link or file there is removed itself (never followed).

    With ``via`` (a free name in the same folder, which the next save's cleanup removes if a crash leaves it), the
    folder is first renamed there and removed under that name: ``path`` names the whole folder until it names
    nothing, so a loader that looks it up never finds it half removed.
    """
    if os.path.lexists(path):
        _event("remove", path)
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            if via is not None:
                _event("rename", path)
                os.rename(path, via)
                path = via
            shutil.rmtree(path)


def _same_file(path: str, descriptor: int) -> bool:
    """Whether ``path`` still names the file or folder open as ``descriptor``."""
    try:
        current = os.lstat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino)


def _flock_folder(descriptor: int, operation: int) -> bool:
    """:func:`try_flock` on a folder opened read-only; ``False`` also where ``flock`` needs a file open for writing.

    Linux's NFS client emulates ``flock`` by a byte-range lock, whose exclusive form needs a descriptor open for
    writing (``EBADF`` otherwise), and a folder cannot be opened for writing: there a folder's flock is unsupported,
    like on a file system without locks.

    Raises:
        BlockingIOError: ``LOCK_NB`` and another open file holds it.
    """
    try:
        return try_flock(descriptor, operation)
    except BlockingIOError:
        raise
    except OSError as error:
        if error.errno == errno.EBADF:
            return False
        raise


def _remove_stale_private_folders(parent: str, name: str) -> None:
    """Remove the private folders ``.{name}.XXXX.zero_bnb-tmp`` in ``parent`` whose writer is gone (killed).

    A writer holds its folder's ``flock`` while it lives (:class:`StagedFile`), so a folder whose flock can be taken
    has no live writer; one whose flock is held is left alone. On a file system without ``flock`` nothing is removed:
    a warning names the folder and how to remove it. Links, files and other names are never touched.
    """
    prefix = f".{name}."
    try:
        entries = os.listdir(parent)
    except OSError:
        return  # the writer's own mkdtemp names the problem
    for entry in entries:
        middle = entry[len(prefix):-len(TEMP_SUFFIX)] if entry.startswith(prefix) and entry.endswith(TEMP_SUFFIX) else ""
        if not middle or "." in middle:  # not a name mkdtemp gives a private folder of ``name``
            continue
        path = os.path.join(parent, entry)
        try:
            descriptor = os.open(path, _FOLDER_FLAGS)
        except OSError:
            continue  # a link, a file, or gone meanwhile: not a folder zero_bnb left
        try:
            if not _flock_folder(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB):
                logger.warning("zero_bnb: %s is a temporary folder a writer left; this file system cannot flock a folder, so "
                               "zero_bnb cannot tell whether that writer still runs. Once no writer of %s runs, remove "
                               "it: rm -rf %r", path, os.path.join(parent, name), path)
                continue
            if _same_file(path, descriptor):  # under its flock: no writer can claim it meanwhile
                _event("remove", path)
                shutil.rmtree(path)
                logger.info("zero_bnb: removed %s, left by a writer that was killed", path)
        except BlockingIOError:
            pass  # a live writer holds it
        except OSError as error:
            logger.warning("zero_bnb: could not remove %s, a temporary folder a killed writer left (%r); remove it: "
                           "rm -rf %r", path, error, path)
        finally:
            os.close(descriptor)


def _claim_private_folder(parent: str, name: str) -> tuple[str, int]:
    """A fresh private folder ``.{name}.XXXX.zero_bnb-tmp`` in ``parent`` and an open descriptor holding its flock.

    The flock marks the folder as in use until the descriptor is closed (or the process dies). A folder removed as
    stale between its creation and its flock is replaced by another.
    """
    for _ in range(_CLAIM_ATTEMPTS):
        folder = tempfile.mkdtemp(prefix=f".{name}.", suffix=TEMP_SUFFIX, dir=parent)
        try:
            descriptor = os.open(folder, _FOLDER_FLAGS)
        except FileNotFoundError:
            continue
        try:
            _flock_folder(descriptor, fcntl.LOCK_EX)  # a remover holds it only while it removes
            if _same_file(folder, descriptor):
                return folder, descriptor
        except BaseException:
            os.close(descriptor)
            raise
        os.close(descriptor)
    raise OSError(f"could not create a private folder for {name} in {parent}: each new one was removed before it "
                  f"could be used ({_CLAIM_ATTEMPTS} attempts)")


class StagedFile:
    """A file written in a fresh private folder beside its destination, published by one rename.

    ``StagedFile(dest)`` creates ``.{name}.XXXX.zero_bnb-tmp/`` (mode 0700, a name nobody could
    plant) in ``dest``'s folder and holds its ``flock`` until :meth:`discard`; it first removes the
    private folders of ``dest`` that killed writers left (no live process holds their flock). Write
    :attr:`path` (zero_bnb's writers, or a library's own ``torch.save``/``save_file``: nobody else can
    put a link there), then :meth:`publish` renames it over ``dest`` (a link at ``dest`` is
    replaced, never followed) and :meth:`discard` removes the private folder, published or not.
    ``note``: the destination is a command's output, recorded with :func:`note_published` once
    renamed and again once its folder is synced. Local: any process.
    """

    def __init__(self, destination: str, *, note: bool = False) -> None:
        self.destination = destination
        parent = os.path.dirname(os.path.abspath(destination))
        name = os.path.basename(destination)
        _event("mkdir", parent)
        _remove_stale_private_folders(parent, name)
        self.folder, self._descriptor = _claim_private_folder(parent, name)
        self.path = os.path.join(self.folder, name)
        #: Record the destination with :func:`note_published` (an output of a command), renamed and then durable.
        self.note = note
        #: Renamed over the destination: from then on the destination is the new file.
        self.published = False
        #: And the destination's folder synced: the new file survives a power failure.
        self.durable = False

    def publish(self) -> None:
        """Flush the written file to disk, rename it over the destination (atomic), then sync the destination's folder.

        Raises:
            OSError: before the rename: the destination is unchanged.
            PublishedNotDurableError: the sync after the rename failed; the destination is the new file.
        """
        descriptor = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            _event("fsync", self.path)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        _event("replace", self.destination)
        os.replace(self.path, self.destination)
        self.published = True
        if self.note:
            note_published(self.destination, durable=False)
        _sync_published(self.destination, os.path.dirname(os.path.abspath(self.destination)))
        self.durable = True
        if self.note:
            note_published(self.destination)

    def discard(self) -> None:
        """Remove the private folder (and the file, if it was not published), then let its flock go. Idempotent;
        never raises."""
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._descriptor >= 0:
            descriptor, self._descriptor = self._descriptor, -1
            os.close(descriptor)


@contextmanager
def replacing(destination: str, *, note: bool = False) -> Iterator[str]:
    """Yield a path to write; when the block succeeds it atomically replaces ``destination``.

    If the block (or the rename) fails, ``destination`` is unchanged and nothing temporary is
    left (see :class:`StagedFile`). A failure after the rename (syncing the folder) raises
    :class:`PublishedNotDurableError`: ``destination`` is then the new file. ``note``: record
    ``destination`` with :func:`note_published` once renamed (an output of a command).
    """
    staged = StagedFile(destination, note=note)
    try:
        yield staged.path
        staged.publish()
    finally:
        staged.discard()


def replace_text(text: str, path: str) -> None:
    """Atomically replace the small file ``path`` with ``text``: readers see old or new, never a mix."""
    with replacing(path) as temporary:
        write_text(text, temporary, root=os.path.dirname(temporary))


def publish_folder(staging: str, final: str, aside: str, trash: str) -> None:
    """Move the finished folder ``staging`` to ``final``; an existing ``final`` is moved to ``aside``.

    An existing ``final`` is first renamed to ``aside``, then ``staging`` takes its place. If the
    second rename fails, ``aside`` is renamed back and the error raised: nothing was published.
    Once it returns, the new folder is visible; the caller then calls :func:`finish_publish`
    (whose failure means "published, but not made durable or tidied"). A crash between the two
    renames leaves ``final`` absent and the previous folder complete at ``aside``, where loaders
    look for it. ``trash`` is a free name that crash cleanup removes (see :func:`remove_tree`'s ``via``):
    a leftover ``aside`` is removed through it.
    """
    moved_aside = os.path.lexists(final)
    if moved_aside:
        remove_tree(aside, via=trash)
        _event("rename", final)
        os.rename(final, aside)
    try:
        _event("rename", staging)
        os.rename(staging, final)
    except BaseException:
        if moved_aside:
            os.rename(aside, final)
        raise
    note_published(final, durable=False)


def finish_publish(final: str, aside: str, trash: str) -> None:
    """After :func:`publish_folder`: make the rename durable, then remove the previous folder at ``aside`` (renamed
    to ``trash`` first: a loader that found it at ``aside`` reads it whole or is told it was replaced).

    Raises:
        PublishedNotDurableError: syncing the folder naming ``final`` failed (``final`` is the new folder).
    """
    _sync_published(final, os.path.dirname(final) or ".")
    note_published(final)
    remove_tree(aside, via=trash)
