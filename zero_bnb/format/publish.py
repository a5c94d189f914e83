"""Publishing under a final name: a file written in a private folder beside its destination and renamed over it
(:class:`StagedFile`, :func:`replacing`), a finished folder renamed into place (:func:`publish_folder`,
:func:`finish_publish`), and the record of what a command published (:func:`noting_publications`).

A reader sees the old version or the new one, never a half-written one; a failure leaves nothing temporary (a writer
that is killed leaves its private folder, which the next writer of that name removes, never one a live writer holds:
its ``flock``). Every step is reported to :func:`zero_bnb.format.durable.io_event`. Pure local I/O: no collectives;
any rank may call these functions.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from zero_bnb.format.durable import fsync_dir, io_event, remove_tree, write_text
from zero_bnb.format.lock import try_flock

__all__ = [
    "FOLDER_FLAGS",
    "TEMP_SUFFIX",
    "Publication",
    "PublishedNotDurableError",
    "StagedFile",
    "finish_publish",
    "note_published",
    "noting_publications",
    "publish_folder",
    "replace_text",
    "replacing",
]

logger = logging.getLogger(__name__)

#: Suffix of the private folders single files are written in before they are renamed into place.
TEMP_SUFFIX = ".zero_bnb-tmp"
#: Opens a folder itself (a link there is refused): for its flock, or to work inside it by descriptor.
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CLAIM_ATTEMPTS = 5


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
            descriptor = os.open(path, FOLDER_FLAGS)
        except OSError:
            continue  # a link, a file, or gone meanwhile: not a folder zero_bnb left
        try:
            if not _flock_folder(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB):
                logger.warning("zero_bnb: %s is a temporary folder a writer left; this file system cannot flock a folder, so "
                               "zero_bnb cannot tell whether that writer still runs. Once no writer of %s runs, remove "
                               "it: rm -rf %r", path, os.path.join(parent, name), path)
                continue
            if _same_file(path, descriptor):  # under its flock: no writer can claim it meanwhile
                io_event("remove", path)
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
            descriptor = os.open(folder, FOLDER_FLAGS)
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
        io_event("mkdir", parent)
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
            io_event("fsync", self.path)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        io_event("replace", self.destination)
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
        io_event("rename", final)
        os.rename(final, aside)
    try:
        io_event("rename", staging)
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
