"""Whether a save folder holds a complete checkpoint or an interrupted save: what automatic resume and ``verify`` read.

Two records make a folder's state readable without loading anything:

* zero_bnb's own save (:mod:`zero_bnb.checkpoint.commit`) writes into a hidden staging folder
  ``.{tag}.zero_bnb-staging-<token>`` while it runs, under the folder's lock (``.zero_bnb.lock``: host, pid, since),
  and moves ``latest`` only once the tag folder is complete. A staging folder that is still there names a save that
  was interrupted (or is running: its lock's holder is alive); the next save into the folder removes it.
* A front door (Trainer's ``checkpoint-N``, Accelerate's ``checkpoint_N``) writes files of its own beside zero_bnb's
  (weights, RNG states, ``trainer_state.json``). Its folder carries :data:`SAVING_NAME` from before its first file
  until every file, zero_bnb's and the front door's, is written and durable (:func:`mark_saving`,
  :func:`finish_saving`, called by :mod:`zero_bnb.checkpoint.front_door`). A folder that still has it was
  interrupted, whatever else it holds.

:func:`folder_status` reads both; :func:`first_complete` picks, from a front door's candidates newest first, the
first one whose save was not interrupted. Local; no collectives.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import stat
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from zero_bnb.errors import CheckpointError, CheckpointSaveError
from zero_bnb.format.durable import fsync_dir, fsync_entry, fsync_file, makedirs, remove_tree
from zero_bnb.format.publish import replace_text
from zero_bnb.format.lock import LOCK_NAME, holder_alive, read_holder
from zero_bnb.format.manifest import MANIFEST_NAME, SUBDIR
from zero_bnb.format.tags import LATEST_NAME, resolve_tag

__all__ = ["SAVING_NAME", "STAGING_SUFFIX", "FolderStatus", "InterruptedSave", "finish_saving", "first_complete",
           "folder_status", "mark_saving"]

logger = logging.getLogger(__name__)

#: The marker of a front door's save in progress, in the front door's checkpoint folder.
SAVING_NAME = ".zero_bnb-saving.json"
#: What the name of zero_bnb's staging folder holds after its tag: ``.{tag}.zero_bnb-staging-<token>``.
STAGING_SUFFIX = ".zero_bnb-staging"
#: What the private name of a front door's new folder holds while its marker is put in: ``.{name}.zero_bnb-new-<id>``.
_NEW_SUFFIX = ".zero_bnb-new"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_MAX_RECORD = 4096


@dataclass(frozen=True, slots=True)
class InterruptedSave:
    """A save that did not finish: what it was, where it left its files, when it began and who ran it.

    Attributes:
        what: ``"zero_bnb save of tag 'global_step6'"`` or ``"trainer save"`` (the front door that marked it).
        path: the staging folder or the marker file.
        started: when it began (seconds since the epoch; the staging folder's or marker's time).
        process: ``"pid 123 on host 'node1'"`` where known, else ``"an unknown process"``.
        running: its process is alive on this host (``None``: unknown, another host or no record).
    """

    what: str
    path: str
    started: float
    process: str
    running: bool | None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        state = {True: "still running", False: "its process is gone", None: "its process is unknown"}[self.running]
        return f"{self.what} started {when} by {self.process} ({state}; {self.path})"


@dataclass(frozen=True, slots=True)
class FolderStatus:
    """What a save folder holds (:func:`folder_status`).

    Attributes:
        path: the folder.
        tag: the tag folder ``latest`` names, present (``None``: no ``latest``, or it is damaged or names nothing).
        committed_at: when that tag was committed (its manifest's time; the tag folder's for other checkpoints).
        front_door: the front door's save that has not finished in this folder (its marker), if any.
        staging: zero_bnb saves into this folder that have not finished (their staging folders).
        problem: why ``latest`` names no usable tag, when it exists but does not.
        lacks: the tag folder the front door loads (Accelerate's ``pytorch_model``), when it is required and absent
            (``""``: the folder itself cannot be listed).
    """

    path: str
    tag: str | None
    committed_at: float | None
    front_door: InterruptedSave | None
    staging: tuple[InterruptedSave, ...]
    problem: str = ""
    lacks: str | None = None

    @property
    def interrupted(self) -> bool:
        """Whether the newest save into this folder did not finish, so the folder is not a checkpoint to resume
        from: a front door's save is marked unfinished, zero_bnb's save left only a staging folder, or the tag folder
        the front door loads is missing."""
        return self.front_door is not None or (self.tag is None and bool(self.staging)) or self.lacks is not None

    @property
    def superseded(self) -> bool:
        """Whether a later save into this folder did not finish: its committed tag is older than what was asked."""
        return bool(self.staging) or self.front_door is not None

    def unfinished(self) -> tuple[InterruptedSave, ...]:
        """Every unfinished save in this folder, the front door's first."""
        return ((self.front_door,) if self.front_door else ()) + self.staging

    def describe(self) -> str:
        """One line: what the folder holds."""
        saves = "; ".join(save.describe() for save in self.unfinished())
        if self.lacks == "" and self.problem:
            return f"{self.path}: {self.problem}"
        if self.lacks is not None and not saves:
            return f"{self.path}: holds no checkpoint {self.lacks!r} (a save killed before its first file)"
        if self.interrupted:
            return f"{self.path}: interrupted save ({saves})"
        held = f"checkpoint {self.tag!r}" if self.tag else "no zero_bnb 'latest'"
        return f"{self.path}: {held}" + (f"; unfinished: {saves}" if saves else "")


def _clean(record: dict | None) -> dict:
    """The fields of a marker or lock record that make sense (anyone may have written it): a pid, a host name, a
    start time; the rest dropped."""
    record = record or {}
    clean: dict = {}
    pid, host, started = record.get("pid"), record.get("host"), record.get("started", record.get("since"))
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31:
        clean["pid"] = pid
    if isinstance(host, str) and 0 < len(host) <= 255 and host.isprintable():
        clean["host"] = host
    if isinstance(started, (int, float)) and not isinstance(started, bool) and math.isfinite(started) \
            and 0 <= started < 1e11:
        clean["started"] = float(started)
    for key in ("start", "front_door", "purpose"):
        if isinstance(record.get(key), str) and len(record[key]) <= 200 and record[key].isprintable():
            clean[key] = record[key]
    return clean


def _process(record: dict) -> tuple[str, bool | None]:
    if "pid" not in record:
        return "an unknown process", None
    return f"pid {record['pid']} on host {record.get('host', '?')!r}", holder_alive(record)


def _read_record(path: str) -> dict | None:
    """A small JSON object read without following a link, or ``None`` (missing, not a regular file, not JSON)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        record = json.loads(os.pread(descriptor, _MAX_RECORD, 0))
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        os.close(descriptor)
    return record if isinstance(record, dict) else {}


def _mtime(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _front_door(folder: str) -> InterruptedSave | None:
    path = os.path.join(folder, SAVING_NAME)
    if not os.path.lexists(path):
        return None
    record = _clean(_read_record(path))
    process, running = _process(record)
    door = record.get("front_door", "")
    return InterruptedSave(what=f"{door if door.isidentifier() else 'front door'} save", path=path,
                           started=record.get("started", _mtime(path)), process=process, running=running)


def _staging(folder: str, names: Iterable[str]) -> tuple[InterruptedSave, ...]:
    """zero_bnb's saves into ``folder`` that did not finish: their staging folders, or, once a staging folder was
    renamed into place, the lock a save releases last."""
    found = sorted(name for name in names if name.startswith(".") and STAGING_SUFFIX in name)
    lock = os.path.join(folder, LOCK_NAME)
    holder = read_holder(folder) if LOCK_NAME in names else None
    process, running = _process(_clean(holder))
    saves = tuple(InterruptedSave(what=f"zero_bnb save of tag {name[1:].split(STAGING_SUFFIX)[0]!r}",
                                  path=os.path.join(folder, name), started=_mtime(os.path.join(folder, name)),
                                  process=process, running=running) for name in found)
    if not saves and holder is not None:
        clean = _clean(holder)
        saves = (InterruptedSave(what=f"zero_bnb save ({clean.get('purpose', 'a zero_bnb save')[:80]}) that had not "
                                      f"released its lock", path=lock, started=clean.get("started", _mtime(lock)),
                                 process=process, running=running),)
    return saves


def folder_status(path: str, require: str | None = None) -> FolderStatus:
    """What the save folder ``path`` holds: the committed tag ``latest`` names, and the saves that did not finish.

    ``require``: a tag folder the front door loads by name (Accelerate's ``pytorch_model``); without it the folder
    counts as interrupted. Reads names, ``latest``, the marker and the lock record; no checkpoint file. Local,
    read-only.
    """
    try:
        names = os.listdir(path)
    except OSError as error:  # nothing in it can be loaded either: counted as interrupted
        return FolderStatus(path, None, None, None, (), problem=f"cannot be listed: {error.strerror or error}",
                            lacks="")
    tag, committed_at, problem = None, None, ""
    if LATEST_NAME in names:
        try:
            tag = resolve_tag(path, None, warn=False)
        except CheckpointError as error:
            problem = str(error)
        if tag is not None:
            manifest = os.path.join(path, tag, SUBDIR, MANIFEST_NAME)
            committed_at = _mtime(manifest) or _mtime(os.path.join(path, tag))
    lacks = require if require is not None and not os.path.isdir(os.path.join(path, require)) else None
    return FolderStatus(path, tag, committed_at, _front_door(path), _staging(path, names), problem, lacks)


def first_complete(candidates: Iterable[str], require: str | None = None) -> tuple[str | None, list[FolderStatus]]:
    """The first of ``candidates`` (a front door's checkpoint folders, newest first) whose save was not interrupted
    (with the tag folder ``require``, if given), and the statuses of those passed over before it. Folders without
    zero_bnb's records count as complete (the front door judges them as it always did). Local, read-only."""
    passed: list[FolderStatus] = []
    for candidate in candidates:
        status = folder_status(candidate, require)
        if not status.interrupted:
            return candidate, passed
        passed.append(status)
    return None, passed


def mark_saving(folder: str, front_door: str) -> str:
    """Put the marker of ``front_door``'s save in progress into ``folder``, durably, before the front door writes
    anything there; returns the marker's token (for :func:`finish_saving`). A folder that does not exist yet appears
    with the marker already in it (made under a private name, then renamed), so no instant shows it unmarked. One
    process (the front door's main one) calls it."""
    try:
        return _mark(folder, front_door)
    except OSError as error:
        raise CheckpointSaveError(
            f"{front_door} cannot mark {folder} as being saved ({type(error).__name__}: {error}); nothing was written "
            f"into it. Check that {folder} is a folder you can write (and {os.path.join(folder, SAVING_NAME)} not a "
            f"folder or link)"
        ) from error


def _mark(folder: str, front_door: str) -> str:
    token = uuid.uuid4().hex
    record = json.dumps({"front_door": front_door, "started": time.time(), "host": socket.gethostname(),
                         "pid": os.getpid(), "token": token}) + "\n"
    parent, name = os.path.split(os.path.abspath(folder))
    makedirs(parent)
    if not os.path.lexists(folder):
        private = os.path.join(parent, f".{name}{_NEW_SUFFIX}-{token[:12]}")
        makedirs(private, fresh=True)
        try:
            replace_text(record, os.path.join(private, SAVING_NAME))
            try:
                if os.path.lexists(folder):
                    raise FileExistsError(folder)
                os.rename(private, folder)  # an empty folder made there meanwhile would be replaced: the same
                fsync_dir(parent)
                return token
            except OSError:  # the folder appeared meanwhile, not empty (another process): mark it where it is
                pass
        finally:
            remove_tree(private)
    replace_text(record, os.path.join(folder, SAVING_NAME))  # fsynced, and its folder
    return token


def _committed_tags(folder: str, names: list[str]) -> set[str]:
    """Tag folders of zero_bnb checkpoints in ``folder`` (made durable by their own commit)."""
    return {name for name in names if os.path.isfile(os.path.join(folder, name, SUBDIR, MANIFEST_NAME))}


def _fsync_tree(folder: str, skip: set[str]) -> None:
    """fsync every regular file and folder under ``folder`` (no link followed), except the top-level names in
    ``skip``; the folder itself last."""
    for root, folders, files in os.walk(folder, topdown=True):
        if root == folder:
            folders[:] = [name for name in folders if name not in skip]
            files = [name for name in files if name not in skip]
        for name in files:
            fsync_file(os.path.join(root, name))  # a link is not followed, a file removed meanwhile skipped
        if root != folder:
            fsync_dir(root)
    fsync_dir(folder)


def finish_saving(folder: str, token: str) -> bool:
    """Make every file in ``folder`` durable (zero_bnb's committed tags already are), then remove the marker
    :func:`mark_saving` put there with ``token``, durably: from then on the folder counts as complete. A marker that
    is not the one written with ``token`` (replaced by someone else) is left, with a warning. Returns whether the
    folder now counts as complete. One process (the one that marked it) calls it."""
    names = os.listdir(folder)
    _fsync_tree(folder, _committed_tags(folder, names) | {SAVING_NAME})
    fsync_entry(folder)  # a folder the front door made itself (Accelerate's os.makedirs): else a crash may lose it whole
    path = os.path.join(folder, SAVING_NAME)
    record = _read_record(path)
    if not record or record.get("token") != token:
        logger.warning("zero_bnb: %s is not the marker this save wrote (replaced meanwhile?); it is left in place, "
                       "so %s counts as an interrupted save", path, folder)
        return False
    remove_tree(path)
    fsync_dir(folder)
    return True
