"""A checkpoint folder pinned for reading: every file opened once, relative to the folder's descriptor.

A save of the same tag publishes a new folder by rename and removes the old one. A reader that
named files by path could verify the old files and then parse new ones (or the reverse), and
load a mix of two checkpoints. :class:`PinnedFolder` opens the tag folder once, then every file
relative to that descriptor without following a symlink at any step, and keeps the descriptors:
whatever is renamed or removed afterwards, the bytes hashed are the bytes parsed. A file that
is gone before it could be opened means the folder was replaced while it was being read: that
is reported as such (:class:`~zero_bnb.errors.CheckpointReplacedError`), not as damage.

Local, no collectives; any process may call it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from zero_bnb.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError, CheckpointReplacedError
from zero_bnb.format import digests

__all__ = ["MAX_HELD", "PinnedFolder"]

_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
#: ``O_NONBLOCK``: opening a FIFO must not wait for a writer (it is refused as not a regular file).
_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_CHUNK = 1 << 20
#: Files held open at most (a save at DP=N has N + 3); beyond, files are opened relative to the pinned folder.
MAX_HELD = 256
#: Where this process can reopen one of its descriptors by name (the same file, even once unlinked).
_FD_FOLDER = "/proc/self/fd"


class PinnedFolder:
    """The folder ``path`` as it was when opened; files are read through descriptors held until :meth:`close`.

    Every file is opened at most once (the first :meth:`open`), so its content cannot be swapped
    between a check and a read.

    Callers pin a folder they have just found (:func:`zero_bnb.format.tags.resolve_tag`), so one that is gone
    when it is opened was taken away meanwhile: by a save of the same tag, which renames the previous folder
    aside and removes it.

    Raises:
        CheckpointReplacedError: ``path`` no longer exists.
        CheckpointFormatError: ``path`` is not a folder.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, _DIRECTORY)
        except FileNotFoundError:
            raise CheckpointReplacedError(
                f"checkpoint folder {path} went away after it was found (a concurrent save replaced it, or it was "
                f"removed); nothing was loaded from it. Load again once the save has finished"
            ) from None
        except NotADirectoryError:
            raise CheckpointFormatError(f"{path} is not a folder; a checkpoint tag names a folder") from None
        info = os.fstat(self._fd)
        self._identity = (info.st_dev, info.st_ino)
        self._folders: dict[str, int] = {"": self._fd}
        self._files: dict[str, int] = {}

    def close(self) -> None:
        """Close every descriptor. Memory-mapped tensors stay valid (they hold their own mapping)."""
        for fd in [*self._files.values(), *self._folders.values()]:
            os.close(fd)
        self._files, self._folders = {}, {}

    def __del__(self) -> None:
        if getattr(self, "_folders", None):
            self.close()

    def replaced(self) -> bool:
        """Whether ``path`` now names another folder than the one pinned (a save replaced it)."""
        try:
            info = os.stat(self.path)
        except OSError:
            return True
        return (info.st_dev, info.st_ino) != self._identity

    def _gone(self, relative: str) -> CheckpointError:
        if self.replaced():
            return CheckpointReplacedError(
                f"checkpoint {self.path} was replaced by a concurrent save while it was being read ({relative} went "
                f"away); nothing was loaded from it. Load again once the save has finished"
            )
        return CheckpointCorruptError(f"{os.path.join(self.path, relative)} is missing; the checkpoint is incomplete")

    def _folder(self, relative: str) -> int:
        if relative in self._folders:
            return self._folders[relative]
        parent, _, name = relative.rpartition("/")
        fd = self._openat(self._folder(parent), name, relative, _DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointFormatError(f"{os.path.join(self.path, relative)} is not a folder")
        self._folders[relative] = fd
        return fd

    def _openat(self, folder: int, name: str, relative: str, flags: int) -> int:
        try:
            return os.open(name, flags, dir_fd=folder)
        except FileNotFoundError:
            raise self._gone(relative) from None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
                raise CheckpointFormatError(
                    f"{os.path.join(self.path, relative)} is a symbolic link or lies under one; checkpoint files "
                    f"must be regular files inside the checkpoint folder"
                ) from None
            raise

    def open(self, relative: str) -> None:
        """Open regular file ``relative`` (``a/b`` form, already checked safe) and hold it, if not done yet.

        At most :data:`MAX_HELD` files are held; later ones are opened relative to the pinned folder
        each time they are read (the same file, or gone with the folder: never another one).

        Raises:
            CheckpointCorruptError: it does not exist.
            CheckpointReplacedError: it went away because a save replaced the folder.
            CheckpointFormatError: it or a folder above it is a symbolic link, or it is not a regular file.
        """
        if relative not in self._files and len(self._files) < MAX_HELD:
            self._files[relative] = self._open(relative)

    def _open(self, relative: str) -> int:
        parent, _, name = relative.rpartition("/")
        fd = self._openat(self._folder(parent), name, relative, _FILE)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointFormatError(f"{os.path.join(self.path, relative)} is not a regular file; checkpoint "
                                        f"files must be regular files")
        return fd

    @contextmanager
    def _descriptor(self, relative: str) -> Iterator[int]:
        self.open(relative)
        held = self._files.get(relative)
        fd = held if held is not None else self._open(relative)
        try:
            yield fd
        finally:
            if held is None:
                os.close(fd)

    def exists(self, relative: str) -> bool:
        """Whether ``relative`` can be opened as a regular file (a symlink or folder raises, see :meth:`open`)."""
        try:
            self.open(relative)
        except (CheckpointCorruptError, CheckpointReplacedError):
            return False
        return True

    def size(self, relative: str) -> int:
        with self._descriptor(relative) as fd:
            return os.fstat(fd).st_size

    def names(self, relative: str = "") -> list[str]:
        """The entries of the pinned folder ``relative`` (sorted)."""
        return sorted(os.listdir(self._folder(relative)))

    def _chunks(self, relative: str) -> Iterator[bytes]:
        with self._descriptor(relative) as fd:
            offset = 0
            while chunk := os.pread(fd, _CHUNK, offset):
                offset += len(chunk)
                yield chunk

    def read(self, relative: str, limit: int | None = None) -> bytes:
        """The content of ``relative`` (at most ``limit`` bytes), through its descriptor."""
        if limit is None:
            return b"".join(self._chunks(relative))
        with self._descriptor(relative) as fd:
            return os.pread(fd, limit, 0)

    def digest(self, relative: str, algorithm: str = digests.SHA256) -> tuple[int, str]:
        """Size and ``algorithm`` digest (hex; a BLAKE3 one with :func:`~zero_bnb.format.digests.spare_threads`) of
        the content of ``relative``, read through its descriptor."""
        return digests.of_chunks(algorithm, self._chunks(relative), threads=digests.spare_threads(),
                                 what=os.path.join(self.path, relative))

    @contextmanager
    def stream(self, relative: str) -> Iterator[BinaryIO]:
        """A binary file object reading ``relative`` from its start, valid inside the ``with`` block."""
        with self._descriptor(relative) as fd, os.fdopen(os.dup(fd), "rb") as handle:
            handle.seek(0)
            yield handle

    @contextmanager
    def path_of(self, relative: str) -> Iterator[str]:
        """A path that opens exactly the pinned file ``relative`` inside the ``with`` block (for readers that
        need a name, such as a memory map): ``/proc/self/fd/N`` where the system has it; else the path, checked
        to still name the same file."""
        with self._descriptor(relative) as fd:
            if os.path.isdir(_FD_FOLDER):
                yield os.path.join(_FD_FOLDER, str(fd))
                return
            path = os.path.join(self.path, relative)
            try:
                info, pinned = os.stat(path, follow_symlinks=False), os.fstat(fd)
            except OSError:
                raise self._gone(relative) from None
            if (info.st_dev, info.st_ino) != (pinned.st_dev, pinned.st_ino):
                raise self._gone(relative)
            yield path
