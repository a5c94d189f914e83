"""One writer at a time per save folder: an exclusive lock file with its holder's host and pid.

Two jobs saving into the same folder at once would otherwise interleave their renames and
publish one job's manifest with the other's files. Every zero_bnb writer (an engine's save
on rank 0, an offline tool) holds :class:`SaveFolderLock` on the save folder from before it
stages anything until its checkpoint is published or discarded.

The lock is ``{save_dir}/.zero_bnb.lock``, created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (atomic
on local and NFSv3+ file systems) and holding the holder's host, pid, process start time and a
random token. Its holder also keeps an advisory ``flock`` on the open file until it removes it.
A lock left by a process that died (same host, pid gone or reused) is stale and is taken over. A lock
from another host cannot be checked for life: its holder renews the lock file's modification time every
:data:`RENEW_S` seconds while it holds it, and one not renewed for :data:`LEASE_S` seconds (a holder killed by a
preemption, whose job was requeued on another node) is stale too; until then the error names the holder and how to
remove it.

Taking over is exclusive: a taker first takes the ``flock`` of the very file it judged stale
(a live holder's flock refuses it at once), checks that this file is still the one at the
lock's path, re-reads it, and only then removes it and competes for a new one with ``O_EXCL``
like everybody else. Only a flock holder removes a lock file, so two takers can never remove
each other's fresh lock: exactly one writer holds the lock, always.

Local: one process calls it (rank 0 of a save, or a tool).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import socket
import stat
import threading
import time
import uuid
from types import TracebackType

from zero_bnb.errors import CheckpointSaveError

__all__ = ["LOCK_NAME", "SaveFolderLock", "holder_alive", "read_holder", "try_flock"]

logger = logging.getLogger(__name__)

LOCK_NAME = ".zero_bnb.lock"
#: A lock file that is still empty or unreadable after this many seconds is a crashed writer's.
_UNREADABLE_STALE_S = 30.0
#: A holder renews its lock file's modification time this often (seconds) while it holds it.
RENEW_S = 15.0
#: A lock from another host not renewed for this long (seconds) is stale: its holder is gone.
LEASE_S = 120.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_ATTEMPTS = 5


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


def holder_alive(holder: dict) -> bool | None:
    """Whether the process a lock record (:func:`read_holder`) names is alive: ``None`` when it ran on another host
    or the record is unreadable (nobody can tell from here)."""
    if not holder or holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return None
    if not 0 < holder["pid"] < 1 << 31:
        return None  # not a process id (a negative one would name a process group)
    return _alive(holder["pid"], holder.get("start"))


def read_holder(save_dir: str) -> dict | None:
    """The record of the save lock in ``save_dir`` (host, pid, purpose, since), ``{}`` if it is unreadable, ``None``
    when there is no lock (or its path is not a regular file). Local, read-only."""
    try:
        return SaveFolderLock(save_dir, "reading")._holder()
    except CheckpointSaveError:
        return None


def try_flock(descriptor: int, operation: int) -> bool:
    """``flock``; ``False`` where the file system does not support it (NFS without a lock daemon).

    Raises:
        BlockingIOError: ``LOCK_NB`` and another open file holds it.
    """
    try:
        fcntl.flock(descriptor, operation)
    except BlockingIOError:
        raise
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise
    return True


class _Fsync:
    """An fsync of one descriptor in a helper thread, started at once; :meth:`wait` joins it."""

    def __init__(self, descriptor: int) -> None:
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, args=(descriptor,), name="zero_bnb-lock-fsync", daemon=True)
        self._thread.start()

    def _run(self, descriptor: int) -> None:
        try:
            os.fsync(descriptor)
        except OSError as error:
            self.error = error

    def wait(self, *, raise_error: bool = True) -> None:
        self._thread.join()
        if self.error is not None and raise_error:
            raise self.error


class _Renewal:
    """Renews a held lock file's modification time every :data:`RENEW_S` seconds (a daemon thread) until stopped."""

    def __init__(self, descriptor: int) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(descriptor,), name="zero_bnb-lock-renewal", daemon=True)
        self._thread.start()

    def _run(self, descriptor: int) -> None:
        while not self._stopped.wait(RENEW_S):
            try:
                os.utime(descriptor)
            except OSError as error:  # the file system refused: the lease then runs out
                logger.debug("zero_bnb: the save lock's renewal stopped: %r", error)
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class SaveFolderLock:
    """Exclusive lock on a save folder, as a context manager (``with SaveFolderLock(d, "tag"): ...``)."""

    def __init__(self, save_dir: str, purpose: str) -> None:
        self.path = os.path.join(save_dir, LOCK_NAME)
        self.purpose = purpose
        self.token = uuid.uuid4().hex
        self.held = False
        self._descriptor = -1
        self._syncing: _Fsync | None = None
        self._renewing: _Renewal | None = None

    def _check_regular(self) -> bool:
        """Whether the lock path exists (``False``: it does not).

        Raises:
            CheckpointSaveError: the lock path is not a regular file (a folder, a symlink, a FIFO:
                never opened, so nothing can block); the message says to remove it.
        """
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(mode):
            raise CheckpointSaveError(
                f"{self.path} exists but is not a regular file, so it cannot be zero_bnb's save lock. Nothing was "
                f"written. Remove {self.path} and save again"
            )
        return True

    @staticmethod
    def _record(descriptor: int) -> dict:
        """The lock record read from ``descriptor``, ``{}`` if it is unreadable or not what :meth:`acquire` writes."""
        try:
            record = json.loads(os.pread(descriptor, 4096, 0))
        except (OSError, ValueError, RecursionError):
            return {}
        if not isinstance(record, dict):
            return {}
        pid, since = record.get("pid"), record.get("since")
        if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31) or not (
                isinstance(since, (int, float)) and math.isfinite(since) and 0 <= since < 1e11):
            return {}  # not what acquire() writes: garbage, handled like an unreadable lock
        return record

    def _holder(self) -> dict | None:
        """The current lock's record, ``{}`` if it is unreadable, ``None`` if there is no lock.

        Raises:
            CheckpointSaveError: the lock path is not a regular file (see :meth:`_check_regular`).
        """
        if not self._check_regular():
            return None
        try:
            descriptor = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        try:
            return self._record(descriptor)
        finally:
            os.close(descriptor)

    @staticmethod
    def _stale(holder: dict, descriptor: int) -> bool:
        age = time.time() - os.fstat(descriptor).st_mtime
        if not holder:
            return age > _UNREADABLE_STALE_S
        if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
            return age > LEASE_S  # not renewed by its holder (see the module docstring)
        return not _alive(holder["pid"], holder.get("start"))

    def acquire(self, *, durable: bool = True) -> None:
        """Take the lock, taking over a stale one (exclusively: see the module docstring).

        Args:
            durable: fsync the holder's record before returning; ``False``: a helper thread fsyncs it at once and
                this returns without waiting (an asynchronous save's call: beside another process writing to the
                disk this fsync took 13-55 ms); :meth:`make_durable` waits for it. The record is written either
                way; the fsync is what puts it on an NFS server for other hosts to read.

        Raises:
            CheckpointSaveError: another live writer holds it (named, with the fix).
        """
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
                             "token": self.token, "purpose": self.purpose, "since": time.time()})
        holder: dict = {}
        for _ in range(_ATTEMPTS):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o644)
            except FileExistsError:
                holder = self._take_over_stale()
                continue
            try:
                try_flock(descriptor, fcntl.LOCK_EX)  # a taker may hold it for a moment: it then sees a fresh lock
                os.write(descriptor, record.encode("utf-8"))
                if durable:
                    os.fsync(descriptor)
            except BaseException:
                os.remove(self.path)
                os.close(descriptor)
                raise
            self._descriptor = descriptor
            self.held = True
            if not durable:
                self._syncing = _Fsync(descriptor)
            self._renewing = _Renewal(descriptor)
            return
        self._refuse(holder)

    def _take_over_stale(self) -> dict:
        """Remove the existing lock file if it is stale; returns its record. Holds its flock meanwhile.

        Raises:
            CheckpointSaveError: the lock is held by a live writer, or is not a regular file.
        """
        if not self._check_regular():
            return {}  # released meanwhile
        try:
            descriptor = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError as error:
            if error.errno == errno.ELOOP:  # replaced by a symlink meanwhile
                self._check_regular()
            raise
        try:
            try:
                if not try_flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB):
                    holder = self._record(descriptor)
                    if not self._stale(holder, descriptor):
                        self._refuse(holder)
                    raise CheckpointSaveError(
                        f"{self.path} was left by a writer that is gone ({holder or 'unreadable'}), but this file "
                        f"system does not support flock, so zero_bnb cannot take the lock over safely. Nothing was "
                        f"written. Delete {self.path} and save again"
                    )
            except BlockingIOError:
                self._refuse(self._record(descriptor))  # a live holder keeps its flock
            try:
                current = os.lstat(self.path)
            except FileNotFoundError:
                return {}  # removed meanwhile (by its holder, or a taker): compete for a new one
            opened = os.fstat(descriptor)
            if (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino):
                return {}  # replaced meanwhile: look again
            holder = self._record(descriptor)
            if not self._stale(holder, descriptor):
                self._refuse(holder)
            logger.warning("zero_bnb: removing the stale save lock %s left by %s", self.path, holder or "a crash")
            os.remove(self.path)  # under its flock: nobody else can remove or replace this file meanwhile
            return holder
        finally:
            os.close(descriptor)

    def _refuse(self, holder: dict) -> None:
        since = holder.get("since")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
        raise CheckpointSaveError(
            f"another job is writing into {os.path.dirname(self.path) or '.'}: {self.path} is held by host "
            f"{holder.get('host', '?')!r}, pid {holder.get('pid', '?')} ({holder.get('purpose', '?')}, since {when}). "
            f"Nothing was written. Wait for that job to finish or save into another folder; a lock from another host "
            f"is taken over {LEASE_S:.0f} s after its holder last renewed it; if no such job is running, you may "
            f"delete {self.path}"
        )

    def make_durable(self) -> None:
        """Wait until the holder's record is fsynced (after ``acquire(durable=False)``: the helper thread's fsync,
        whose error is raised here); nothing after ``acquire()`` (it fsynced), a second time, or once released.

        Raises:
            OSError: the fsync failed.
        """
        syncing, self._syncing = self._syncing, None
        if syncing is not None:
            syncing.wait()

    def release(self) -> None:
        """Remove the lock if this object still holds it (under its flock), then let the flock go."""
        if not self.held:
            return
        syncing, self._syncing = self._syncing, None
        if syncing is not None:  # never close the descriptor under a running fsync (a new file could take its number)
            syncing.wait(raise_error=False)
        renewing, self._renewing = self._renewing, None
        if renewing is not None:  # nor under a renewal
            renewing.stop()
        self.held = False
        descriptor, self._descriptor = self._descriptor, -1
        try:
            current = os.lstat(self.path)
            opened = os.fstat(descriptor)
            if (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
                os.remove(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(descriptor)

    def __enter__(self) -> SaveFolderLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.release()
