"""One writer at a time per save folder: an exclusive lock file with its holder's host and pid.

Two jobs saving into the same folder at once would otherwise interleave their renames and
publish one job's manifest with the other's files. Every zero_bnb writer (an engine's save
on rank 0, an offline tool) holds :class:`SaveFolderLock` on the save folder from before it
stages anything until its checkpoint is published or discarded.

The lock is ``{save_dir}/.zero_bnb.lock``, created with ``O_CREAT | O_EXCL`` (atomic on local
and NFSv3+ file systems) and holding the holder's host, pid, process start time and a random
token. A lock left by a process that died (same host, pid gone or reused) is stale and is
taken over; a lock from another host is never taken over automatically: the error names the
holder and how to remove it.

Local: one process calls it (rank 0 of a save, or a tool).
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
from types import TracebackType

from zero_bnb.errors import CheckpointSaveError

__all__ = ["LOCK_NAME", "SaveFolderLock"]

logger = logging.getLogger(__name__)

LOCK_NAME = ".zero_bnb.lock"
#: A lock file that is still empty or unreadable after this many seconds is a crashed writer's.
_UNREADABLE_STALE_S = 30.0


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), or ``None`` when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    current = _start_time(pid)
    return start is None or current is None or current == start


class SaveFolderLock:
    """Exclusive lock on a save folder, as a context manager (``with SaveFolderLock(d, "tag"): ...``)."""

    def __init__(self, save_dir: str, purpose: str) -> None:
        self.path = os.path.join(save_dir, LOCK_NAME)
        self.purpose = purpose
        self.token = uuid.uuid4().hex
        self.held = False

    def _holder(self) -> dict | None:
        """The current lock's record, ``{}`` if it is unreadable, ``None`` if there is no lock.

        Raises:
            CheckpointSaveError: the lock path is not a regular file (a folder, a symlink, a FIFO:
                never opened, so nothing can block); the message says to remove it.
        """
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(mode):
            raise CheckpointSaveError(
                f"{self.path} exists but is not a regular file, so it cannot be zero_bnb's save lock. Nothing was "
                f"written. Remove {self.path} and save again"
            )
        try:
            descriptor = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(descriptor, encoding="utf-8") as handle:
                record = json.loads(handle.read(4096))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        if not isinstance(record, dict):
            return {}
        pid, since = record.get("pid"), record.get("since")
        if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31) or not (
                isinstance(since, (int, float)) and math.isfinite(since) and 0 <= since < 1e11):
            return {}  # not what acquire() writes: garbage, handled like an unreadable lock
        return record

    def _stale(self, holder: dict) -> bool:
        if not holder:
            try:
                return time.time() - os.path.getmtime(self.path) > _UNREADABLE_STALE_S
            except OSError:
                return True
        if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
            return False
        return not _alive(holder["pid"], holder.get("start"))

    def acquire(self) -> None:
        """Take the lock, taking over a stale one.

        Raises:
            CheckpointSaveError: another live writer holds it (named, with the fix).
        """
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
                             "token": self.token, "purpose": self.purpose, "since": time.time()})
        for _ in range(3):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile
                if not self._stale(holder):
                    self._refuse(holder)
                logger.warning("zero_bnb: removing the stale save lock %s left by %s", self.path, holder or "a crash")
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(record)
                handle.flush()
                os.fsync(handle.fileno())
            self.held = True
            return
        self._refuse(self._holder() or {})

    def _refuse(self, holder: dict) -> None:
        since = holder.get("since")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
        raise CheckpointSaveError(
            f"another job is writing into {os.path.dirname(self.path) or '.'}: {self.path} is held by host "
            f"{holder.get('host', '?')!r}, pid {holder.get('pid', '?')} ({holder.get('purpose', '?')}, since {when}). "
            f"Nothing was written. Wait for that job to finish or save into another folder; if no such job is "
            f"running (it died on another host), delete {self.path}"
        )

    def release(self) -> None:
        """Remove the lock if this object still holds it."""
        if not self.held:
            return
        self.held = False
        holder = self._holder()
        if holder and holder.get("token") == self.token:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> SaveFolderLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.release()
