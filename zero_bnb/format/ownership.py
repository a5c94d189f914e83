"""What zero_bnb may replace or remove: only what it can show it wrote.

Two kinds of proof:

* A **checkpoint tag folder** is zero_bnb's when it holds a zero_bnb manifest and nothing but the files that
  manifest lists (by path and size) and the manifest itself (:func:`checkpoint_strangers`). A save of the same
  tag replaces such a folder; anything else there (a stock DeepSpeed checkpoint, a user's folder, a user's file
  added to a zero_bnb checkpoint) makes the save refuse, naming what it found.
* An **output folder** of the weight writers (``zero_to_fp32``, ``write_shards``) keeps a record of the files
  zero_bnb wrote there, :data:`RECORD_NAME` (path, size and SHA-256 of each), written before a file is put in
  place and after the old ones are gone (:class:`OutputRecord`). A file is zero_bnb's to replace or remove only
  while its bytes are the recorded ones.

Local, no collectives.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass

from zero_bnb.errors import CheckpointError
from zero_bnb.format.durable import digest_file, fsync_dir
from zero_bnb.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, SUBDIR, Manifest, decode_manifest, owner_only
from zero_bnb.format.publish import FOLDER_FLAGS, replacing
from zero_bnb.format.stock_files import MODEL_STATES, UNIVERSAL_STATE

__all__ = ["CHECKPOINT_MARKERS", "RECORD_FORMAT", "RECORD_NAME", "OutputRecord", "checkpoint_strangers", "distrust",
           "remove_own_files"]

logger = logging.getLogger(__name__)
_WARNED: set[tuple[str, str]] = set()

#: The record of what zero_bnb wrote into an output folder (hidden, beside the weights).
RECORD_NAME = ".zero_bnb-outputs.json"
RECORD_FORMAT = "zero_bnb-outputs/1"
#: What marks a folder as a checkpoint (zero_bnb's manifest, a universal checkpoint's state, stock DeepSpeed's model
#: file of stages 1/2); relative to the tag folder.
CHECKPOINT_MARKERS = (os.path.join(SUBDIR, MANIFEST_NAME), UNIVERSAL_STATE, MODEL_STATES)


def distrust(info: os.stat_result) -> str | None:
    """Why a proof file (a manifest, an output record) with status ``info`` (from ``lstat`` or ``fstat``) proves
    nothing: not a regular file, owned by another user, or writable by the group or others; ``None`` if it is
    trusted. Local, pure."""
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    user = os.geteuid() if hasattr(os, "geteuid") else info.st_uid
    if info.st_uid != user:
        return f"it is owned by user id {info.st_uid}, not by the running user ({user})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(name for bit, name in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user"))
                           if info.st_mode & bit)
        return f"it is writable by {who} (mode {stat.filemode(info.st_mode)})"
    return None


def _warn_distrusted(path: str, reason: str, means: str) -> None:
    if (path, reason) not in _WARNED:  # once per file and reason: a save checks a folder more than once
        _WARNED.add((path, reason))
        logger.warning("zero_bnb: %s proves nothing: %s; %s. If you wrote it, make it yours and writable only by you "
                       "(chown, chmod go-w)", path, reason, means)


_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True, slots=True)
class _Proof:
    """A tag folder's trusted manifest and the status of the file it was read from."""

    manifest: Manifest
    info: os.stat_result


def _open_folder(parts: list[str], base: int) -> int:
    """A descriptor of folder ``base/parts...``, each step opened without following a link (raises ``OSError``)."""
    fd = os.dup(base)
    try:
        for part in parts:
            inner = os.open(part, FOLDER_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _proof(tag_folder: str) -> _Proof | None:
    """The manifest of ``tag_folder`` when it proves anything: read through descriptors opened without following a
    link (the tag folder, ``zero_bnb/``, the manifest), checked by :func:`distrust` on the open file it is read
    from; ``None`` otherwise (no manifest, unreadable, damaged, distrusted)."""
    path = os.path.join(tag_folder, SUBDIR, MANIFEST_NAME)
    try:
        top = os.open(tag_folder, FOLDER_FLAGS)
    except OSError:
        return None
    try:
        folder = _open_folder([SUBDIR], top)
        try:
            fd = os.open(MANIFEST_NAME, _FILE_FLAGS, dir_fd=folder)
        finally:
            os.close(folder)
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            reason = distrust(info)
            if reason is not None:
                _warn_distrusted(path, reason, "every file of the folder counts as not written by zero_bnb")
                return None
            raw = handle.read(MAX_MANIFEST_BYTES + 1)
        return _Proof(decode_manifest(raw, path), info)
    except (CheckpointError, OSError, ValueError):
        return None
    finally:
        os.close(top)


def _proven(info: os.stat_result, size: int, proof: _Proof) -> bool:
    """Whether a listed file with status ``info`` (``lstat``) is the one the manifest names: a regular file of the
    listed size, owned by the manifest's owner, not modified after the manifest."""
    return (stat.S_ISREG(info.st_mode) and info.st_size == size and info.st_uid == proof.info.st_uid
            and info.st_mtime_ns <= proof.info.st_mtime_ns)


def _folders_on_the_way(paths: list[str]) -> set[str]:
    """Every folder (relative, ending with the separator) that holds one of ``paths``, at any depth."""
    return {os.sep.join(parts[:depth]) + os.sep for parts in (path.rstrip(os.sep).split(os.sep) for path in paths)
            for depth in range(1, len(parts))}


def checkpoint_strangers(tag_folder: str) -> list[str]:
    """Entries of ``tag_folder`` (paths relative to it; folders end with the separator) that are not files of the
    zero_bnb checkpoint its manifest describes: ``[]`` when it is such a checkpoint and holds nothing else, or is
    empty. Without a manifest that proves anything (:func:`_proof`) every entry is a stranger. Links are strangers;
    so are a folder that cannot be listed (what it holds is unknown), a folder holding no file at all (a user's empty
    folder: zero_bnb writes none), a listed file at another size, owned by another user, or changed after the manifest
    was written (modified later than it: the save writes the manifest last; a copy that keeps times, ``cp -a`` or
    ``rsync -a``, keeps this true). A manifest :func:`distrust` refuses (another user's, or one others can write),
    or one reached through a link, proves nothing."""
    entries: list[str] = []
    folders_seen: list[str] = []

    def unlistable(error: OSError) -> None:
        entries.append(os.path.relpath(error.filename or tag_folder, tag_folder) + os.sep)

    for root, folders, files in os.walk(tag_folder, onerror=unlistable, followlinks=False):
        for name in files + [folder for folder in folders if os.path.islink(os.path.join(root, folder))]:
            entries.append(os.path.relpath(os.path.join(root, name), tag_folder))
        folders_seen += [os.path.relpath(os.path.join(root, folder), tag_folder) + os.sep for folder in folders
                         if not os.path.islink(os.path.join(root, folder))]
    # folders with no file in them, at any depth (a user's empty folders: those with files are named by their files)
    holding = _folders_on_the_way(entries)
    empty = [folder for folder in folders_seen if folder not in holding]
    if not entries and not empty:
        return []
    proof = _proof(tag_folder)
    if proof is None:
        return sorted(entries + empty)
    manifest_path = os.path.join(SUBDIR, MANIFEST_NAME)
    sizes = {record.path: record.size for record in proof.manifest.files}
    strangers = list(empty)
    for path in entries:
        if path == manifest_path:
            continue
        try:
            info = os.lstat(os.path.join(tag_folder, path))
        except OSError:
            strangers.append(path)
            continue
        if path not in sizes or not _proven(info, sizes[path], proof):
            strangers.append(path)
    return sorted(strangers)


@dataclass(frozen=True, slots=True)
class _Stamp:
    size: int
    sha256: str


class OutputRecord:
    """The files zero_bnb wrote into ``folder``, by name (see the module docstring).

    While an output replaces another, a name may have two recorded versions (the file in place and the one about to
    replace it): both are zero_bnb's, so an interrupted replacement can be resumed. :meth:`settle` keeps the one in
    place. A record that cannot be read (damaged, another program's) or that :func:`distrust` refuses (another
    user's, or one others can write) proves nothing: every file is then a stranger.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, RECORD_NAME)
        self.files: dict[str, list[_Stamp]] = {}
        self._proven: dict[str, tuple[int, int, int]] = {}
        try:
            with open(self.path, encoding="utf-8") as handle:
                reason = distrust(os.fstat(handle.fileno()))  # the file read is the file checked
                if reason is not None:
                    _warn_distrusted(self.path, reason, "no file in the folder counts as written by zero_bnb")
                    return
                data = json.load(handle)
            if isinstance(data, dict) and data.get("format") == RECORD_FORMAT and isinstance(data.get("files"), dict):
                self.files = {name: [_Stamp(int(entry["size"]), str(entry["sha256"])) for entry in entries]
                              for name, entries in data["files"].items()
                              if os.path.basename(name) == name and isinstance(entries, list)}
        except (OSError, ValueError, KeyError, TypeError):
            self.files = {}

    def owns(self, name: str) -> bool:
        """Whether ``folder/name`` is a regular file whose bytes are ones zero_bnb recorded writing. A file proven
        once is not hashed again while it is the same file, unchanged (inode, size and modification time)."""
        path = os.path.join(self.folder, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return False
        stamps = self.files.get(name, [])
        if not stamps or not stat.S_ISREG(info.st_mode) or all(info.st_size != stamp.size for stamp in stamps):
            return False
        identity = (info.st_ino, info.st_size, info.st_mtime_ns)
        if self._proven.get(name) == identity:
            return True
        if _Stamp(*digest_file(path)) not in stamps:
            return False
        self._proven[name] = identity
        return True

    def note(self, name: str, path: str) -> _Stamp:
        """Record ``path``'s bytes as a version of zero_bnb's output ``name`` (saved by :meth:`save`); its stamp."""
        stamp = _Stamp(*digest_file(path))
        self.files[name] = [s for s in self.files.get(name, []) if s != stamp] + [stamp]
        return stamp

    def settle(self, in_place: dict[str, _Stamp]) -> None:
        """After a replacement: ``in_place`` (name: the stamp :meth:`note` gave) are the versions now in place;
        other recorded names are forgotten once their file is gone."""
        self.files = {name: ([in_place[name]] if name in in_place else stamps) for name, stamps in self.files.items()
                      if name in in_place or os.path.lexists(os.path.join(self.folder, name))}

    def save(self) -> None:
        """Write the record durably (atomically replaced)."""
        data = {"format": RECORD_FORMAT, "files": {
            name: [{"size": stamp.size, "sha256": stamp.sha256} for stamp in stamps]
            for name, stamps in sorted(self.files.items())}}
        with replacing(self.path) as temporary, open(temporary, "w", encoding="utf-8") as handle:
            owner_only(handle.fileno())
            json.dump(data, handle, indent=1)
            handle.write("\n")
        fsync_dir(self.folder)


def remove_own_files(tag_folder: str) -> tuple[list[str], int]:
    """Remove from ``tag_folder`` (a replaced checkpoint, already out of the loaders' way) the files its trusted
    manifest lists and proves zero_bnb wrote (:func:`checkpoint_strangers`), the manifest last, and the folders that
    held them once empty; nothing else. Each file is checked again just before it is removed, through descriptors
    opened without following a link, so a link swapped in meanwhile sends nothing anywhere. Local; the caller holds
    the save folder's lock.

    Returns:
        The entries kept (relative paths, :func:`checkpoint_strangers`) and the bytes removed.

    Raises:
        OSError: a removal failed (what was removed before stays removed; the rest stays).
    """
    strangers = checkpoint_strangers(tag_folder)
    proof = None if os.path.islink(tag_folder) else _proof(tag_folder)
    if proof is None:
        return strangers, 0
    kept = set(strangers)
    manifest_path = os.path.join(SUBDIR, MANIFEST_NAME)
    listed = [(record.path, record.size) for record in proof.manifest.files if record.path not in kept]
    removed = 0
    emptied: set[str] = set()
    top = os.open(tag_folder, FOLDER_FLAGS)
    try:
        for path, size in [*sorted(listed), (manifest_path, proof.info.st_size)]:  # the proof goes last
            parts = path.split(os.sep)
            folder = _open_folder(parts[:-1], top)
            try:
                info = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
                same = ((info.st_dev, info.st_ino) == (proof.info.st_dev, proof.info.st_ino) if path == manifest_path
                        else _proven(info, size, proof))
                if not same:  # changed since the check: it is not ours any more
                    continue
                os.unlink(parts[-1], dir_fd=folder)
                os.fsync(folder)
            finally:
                os.close(folder)
            removed += size
            emptied.update(os.sep.join(parts[:depth]) for depth in range(1, len(parts)))
        for path in sorted(emptied, key=lambda folder: folder.count(os.sep), reverse=True):  # deepest first
            parts = path.split(os.sep)
            parent = _open_folder(parts[:-1], top)
            try:
                inner = _open_folder(parts[-1:], parent)
                try:
                    empty = not os.listdir(inner)
                finally:
                    os.close(inner)
                if empty:
                    os.rmdir(parts[-1], dir_fd=parent)
                    os.fsync(parent)
            finally:
                os.close(parent)
    finally:
        os.close(top)
    return strangers, removed
