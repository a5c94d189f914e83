"""The kernel cache's files: what may be loaded from it, the build lock, and what may be replaced in it.

The cached library is trusted by its name, as DeepSpeed's JIT-built ops are, so the name must not lead anywhere
else. No symbolic link is followed where trust is decided: the cache folder is opened and checked, the library
is opened in it with ``O_NOFOLLOW`` and checked with ``fstat`` (:func:`_check_trusted`: a regular file of this
user or root that no one else can write), and the dynamic loader is given that open file (``/proc/self/fd/N``)
or, where ``/proc`` is missing, a private copy of its checked bytes, never the name again.

Concurrent builders of one key take an exclusive ``flock`` on ``{name}.lock`` for at most
``$ZERO_BNB_KERNEL_LOCK_TIMEOUT`` seconds (default 60); one not granted by then is a :class:`KernelLockTimeout`
naming the lock file and, from ``/proc/locks``, the process that holds it. zero_bnb replaces only its own files
(:func:`check_replaceable`), by renaming a privately compiled file over them. Local: no collectives.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import math
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator

__all__ = ["CACHE_ENV", "DEFAULT_LOCK_TIMEOUT", "LOCK_TIMEOUT_ENV", "KernelBuildError", "KernelCacheError",
           "KernelLockTimeout", "build_lock", "cache_dir", "check_folder", "check_replaceable", "load_cached",
           "lock_timeout", "make_folder"]

logger = logging.getLogger(__name__)

#: Where the compiled library is cached (default ``~/.cache/zero_bnb/kernels``).
CACHE_ENV = "ZERO_BNB_KERNEL_DIR"
#: How long a builder waits for another's build lock, in seconds (default :data:`DEFAULT_LOCK_TIMEOUT`).
LOCK_TIMEOUT_ENV = "ZERO_BNB_KERNEL_LOCK_TIMEOUT"
#: Seconds: a build takes about 3 s, 30 s on a busy 2-core machine.
DEFAULT_LOCK_TIMEOUT = 60.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
#: O_PATH: the folder need not be readable (mode 0711), only searchable, as for a path lookup.
_FOLDER_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
#: Where an open descriptor can be reopened by the loader (a module attribute so tests can take it away).
_PROC_FD = "/proc/self/fd"


class KernelBuildError(RuntimeError):
    """The fused CPU update could not be compiled or loaded."""


class KernelCacheError(KernelBuildError):
    """The kernel cache cannot be used: its folder is not writable, a file at the kernel's name is not one zero_bnb
    may load or replace, its build lock was not granted in time, or its lock timeout setting is invalid. The message
    names the fix (a compiler is not the problem)."""


class KernelLockTimeout(KernelCacheError):
    """Another process held the kernel's build lock longer than ``$ZERO_BNB_KERNEL_LOCK_TIMEOUT`` seconds."""


def cache_dir() -> str:
    """The folder holding compiled kernels (``$ZERO_BNB_KERNEL_DIR`` or ``~/.cache/zero_bnb/kernels``)."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zero_bnb", "kernels")
    return os.environ.get(CACHE_ENV) or default


def lock_timeout() -> float:
    """Seconds to wait for another builder's lock: ``$ZERO_BNB_KERNEL_LOCK_TIMEOUT`` or :data:`DEFAULT_LOCK_TIMEOUT`.

    Raises:
        KernelCacheError: the variable is not a finite number of seconds >= 0.
    """
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise KernelCacheError(
            f"{LOCK_TIMEOUT_ENV}={raw!r} is not a number of seconds >= 0; set it to how long a build may wait for "
            f"another process's build of the kernel (e.g. {LOCK_TIMEOUT_ENV}=300), or unset it (default "
            f"{DEFAULT_LOCK_TIMEOUT:g})"
        )
    return value


def _refuse(path: str, why: str) -> KernelCacheError:
    return KernelCacheError(
        f"refusing to load the cached kernel {path}: {why}; have it removed (zero_bnb never deletes a file it did "
        f"not write) or set {CACHE_ENV} to a folder only you can write, then run `zero-bnb build-kernels`"
    )


def _check_folder(path: str, folder_stat: os.stat_result) -> None:
    """Refuse a cache folder that a user other than this one (or root) owns, or could add files to without the
    sticky bit (``/tmp``'s, which keeps others from replacing this user's files)."""
    if folder_stat.st_uid not in (os.getuid(), 0):
        raise _refuse(path, f"its folder belongs to uid {folder_stat.st_uid}, not to you (uid {os.getuid()}), so "
                            f"another user could have replaced it")
    if folder_stat.st_mode & 0o022 and not folder_stat.st_mode & stat.S_ISVTX:
        raise _refuse(path, f"its folder is writable by others (mode {oct(folder_stat.st_mode & 0o7777)}) without "
                            f"the sticky bit, so another user could have replaced it")


def _check_trusted(path: str, file_stat: os.stat_result, folder_stat: os.stat_result) -> None:
    """Refuse an opened cached library (``fstat``, so it is the file that will be loaded) that is not a regular
    file, that a user other than this one (or root) owns or could write, or that is a hard link in a folder others
    can write (another user's link to some file of root's)."""
    if not stat.S_ISREG(file_stat.st_mode):
        raise _refuse(path, f"it is not a regular file ({stat.filemode(file_stat.st_mode)})")
    if file_stat.st_uid not in (os.getuid(), 0):
        raise _refuse(path, f"it belongs to uid {file_stat.st_uid}, not to you (uid {os.getuid()}), so another user "
                            f"could have replaced it")
    if file_stat.st_mode & 0o022:
        raise _refuse(path, f"it is writable by others (mode {oct(file_stat.st_mode & 0o7777)}), so another user "
                            f"could have replaced it")
    if file_stat.st_nlink > 1 and folder_stat.st_mode & 0o022:
        raise _refuse(path, f"it has {file_stat.st_nlink} hard links in a folder others can write, so it may be "
                            f"another user's link to a file zero_bnb did not build")


def check_folder(path: str) -> None:
    """:func:`_check_folder` for the folder of the library ``path`` (the folder exists).

    Raises:
        KernelCacheError: it cannot be inspected, or another user could add or replace files in it.
    """
    folder = os.path.dirname(path) or "."
    try:
        folder_stat = os.stat(folder)
    except OSError as error:
        raise KernelCacheError(f"cannot inspect the kernel cache folder {folder}: {error}; set {CACHE_ENV} to a "
                               f"writable folder") from error
    _check_folder(path, folder_stat)


def _open_trusted(path: str) -> int | None:
    """Open the cached library at ``path`` read-only without following a link and check it; its descriptor, or
    ``None`` when there is none (or its folder does not exist).

    ``O_NONBLOCK``: opening a FIFO at the name does not wait for a writer (it is refused as not a regular file).

    Raises:
        KernelCacheError: the folder or the file fails a check, or cannot be opened (the message names the fix).
    """
    folder = os.path.dirname(path) or "."
    try:  # the folder's own path may hold links (a moved ~/.cache): the folder opened is the one checked
        folder_descriptor = os.open(folder, _FOLDER_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        raise KernelCacheError(f"cannot inspect the kernel cache {path}: {error}; set {CACHE_ENV} to a writable "
                               f"folder") from error
    try:
        folder_stat = os.fstat(folder_descriptor)
        _check_folder(path, folder_stat)
        try:
            descriptor = os.open(os.path.basename(path), os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK,
                                 dir_fd=folder_descriptor)
        except FileNotFoundError:
            return None
        except OSError as error:
            target = None
            if error.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link (EMLINK on FreeBSD)
                with contextlib.suppress(OSError):
                    target = os.readlink(os.path.basename(path), dir_fd=folder_descriptor)
            if target is not None:
                raise _refuse(path, f"it is a symbolic link (to {target}), which zero_bnb never follows there (it "
                                    f"could be pointed elsewhere after the check)") from error
            raise KernelCacheError(f"cannot open the cached kernel {path}: {error}; set {CACHE_ENV} to a folder "
                                   f"only you can write") from error
    finally:
        os.close(folder_descriptor)
    try:
        _check_trusted(path, os.fstat(descriptor), folder_stat)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


#: Libraries this process loaded, by the (device, inode) of the checked file, with that file's descriptor. Kept open
#: (ctypes never unloads a library anyway): the loader knows a library by the name it was given and hands a loaded
#: name's handle back, so a closed ``/proc/self/fd/N`` reused for another file would get the old library; and the
#: open file keeps its inode number from being reused by another file while it is a key here.
_loaded: dict[tuple[int, int], tuple[int, ctypes.CDLL]] = {}
_loading = threading.Lock()


def _load_copy(descriptor: int, path: str) -> ctypes.CDLL:
    """Load a private copy of the checked bytes (where ``/proc/self/fd`` is missing); the copy is removed once loaded.

    The copy goes into a new ``0700`` folder in the cache folder (a file system the library could be loaded from),
    else in the temporary folder.
    """
    try:
        private = tempfile.mkdtemp(prefix=".zero_bnb_load-", dir=os.path.dirname(path) or ".")
    except OSError:
        private = tempfile.mkdtemp(prefix="zero_bnb_load-")
    copy = os.path.join(private, os.path.basename(path))
    try:
        with open(os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o700), "wb") as out:
            offset = 0
            while chunk := os.pread(descriptor, 1 << 20, offset):
                out.write(chunk)
                offset += len(chunk)
        return ctypes.CDLL(copy)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(copy)
        os.rmdir(private)


def load_cached(path: str) -> ctypes.CDLL | None:
    """Load the cached library at ``path`` as the file :func:`_open_trusted` checked; ``None`` when there is none.

    Raises:
        KernelCacheError: it is a link, not a regular file, or another user could have written it.
        OSError: the loader refused it (damaged: empty, truncated, not a library).
    """
    descriptor = _open_trusted(path)
    if descriptor is None:
        return None
    with _loading:
        file_stat = os.fstat(descriptor)
        known = _loaded.get((file_stat.st_dev, file_stat.st_ino))
        if known is not None:
            os.close(descriptor)
            return known[1]
        by_descriptor = f"{_PROC_FD}/{descriptor}"
        try:
            reopens = os.path.samestat(os.stat(by_descriptor), file_stat)
        except OSError:
            reopens = False
        try:
            library = ctypes.CDLL(by_descriptor) if reopens else _load_copy(descriptor, path)
        except BaseException:
            os.close(descriptor)
            raise
        _loaded[(file_stat.st_dev, file_stat.st_ino)] = (descriptor, library)
        return library


def check_replaceable(path: str, why: str) -> None:
    """Refuse to replace what is at ``path`` unless it is absent or a regular file of this user.

    Raises:
        KernelCacheError: it is a link, not a regular file, or another user's (names it, ``why`` and the fix).
    """
    try:
        entry = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as error:
        raise KernelCacheError(f"cannot inspect {path}: {error}; set {CACHE_ENV} to a folder only you can write") \
            from error
    if stat.S_ISREG(entry.st_mode) and entry.st_uid == os.getuid():
        return
    what = ("a symbolic link" if stat.S_ISLNK(entry.st_mode) else
            f"not a regular file ({stat.filemode(entry.st_mode)})" if not stat.S_ISREG(entry.st_mode) else
            f"a file of uid {entry.st_uid}")
    raise KernelCacheError(
        f"cannot rebuild the cached kernel {path} ({why}): it is {what}, and zero_bnb replaces only regular files of "
        f"yours (uid {os.getuid()}); have it removed, or set {CACHE_ENV} to a folder only you can write"
    )


def make_folder(folder: str) -> None:
    """Create the cache folder (``0o755`` when this call creates it).

    Raises:
        KernelCacheError: it cannot be created (names the folder, the error and the fix).
    """
    try:
        if not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            os.chmod(folder, 0o755)  # not group-writable under umask 002: _check_folder would refuse it
    except OSError as error:
        raise KernelCacheError(
            f"cannot create the kernel cache folder {folder}: {error}; set {CACHE_ENV} to a writable folder"
        ) from error


def _describe(pid: str) -> str:
    """``pid 123 (python3, state T (stopped), uid 1000)`` from ``/proc/123/status``."""
    if pid == "0":
        return "a process of another PID namespace (container)"
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as handle:
            status = dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)
    except OSError:
        return f"pid {pid} (not visible from this process)"
    return (f"pid {pid} ({status.get('Name', '?')}, state {status.get('State', '?')}, uid "
            f"{status.get('Uid', '?').split()[0]})")


def _lock_holder(descriptor: int) -> str:
    """Who holds the ``flock`` on the file open at ``descriptor``, from ``/proc/locks``, in words."""
    opened = os.fstat(descriptor)
    device = f"{os.major(opened.st_dev):02x}:{os.minor(opened.st_dev):02x}:{opened.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            locks = [line.split() for line in handle if "->" not in line]  # "->": a waiter, not a holder
    except OSError as error:
        return f"a process zero_bnb cannot name (/proc/locks: {error})"
    flocks = [fields for fields in locks if len(fields) >= 6 and fields[1] == "FLOCK"]
    holders = [fields[4] for fields in flocks if fields[5] == device]
    if holders:
        return ", ".join(_describe(pid) for pid in holders)
    # overlay file systems may report another device for the lock than stat does
    holders = [fields[4] for fields in flocks if fields[5].rsplit(":", 1)[-1] == str(opened.st_ino)]
    if holders:
        return "probably " + ", ".join(_describe(pid) for pid in holders)
    return "a process not listed in /proc/locks (another machine's, if the folder is on a network file system)"


def _acquire(descriptor: int, lock_path: str, timeout: float) -> bool:
    """Take the exclusive ``flock`` within ``timeout`` seconds; ``False`` where the file system cannot lock.

    Raises:
        KernelLockTimeout: it was not granted in time (names the lock file, its holder and the fixes).
    """
    deadline, pause = time.monotonic() + timeout, 0.01
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as error:
            logger.info("zero_bnb: cannot lock %s (%s); building without the lock", lock_path, error)
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise KernelLockTimeout(
                f"the kernel build lock {lock_path} was not granted within {timeout:g} s: it is held by "
                f"{_lock_holder(descriptor)}. Another build of this kernel is running or stuck (a stopped process "
                f"keeps the lock until it exits); wait for it and run `zero-bnb build-kernels` again, end that "
                f"process if it is stuck, set {LOCK_TIMEOUT_ENV} to wait longer (seconds), or set {CACHE_ENV} to a "
                f"folder only you can write"
            )
        if pause == 0.01:
            logger.info("zero_bnb: waiting up to %g s for the kernel build lock %s", timeout, lock_path)
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.25)


@contextlib.contextmanager
def build_lock(lock_path: str, timeout: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (concurrent builders of one key wait for the first), waiting at
    most ``timeout`` seconds for it.

    Where the file cannot be created or locked (read-only folder, NFS without a lock daemon, another user's lock
    file), nothing is held and each process builds privately (the rename keeps that safe).

    Raises:
        KernelLockTimeout: another process held it for ``timeout`` seconds.
    """
    try:
        descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    except OSError as error:
        logger.info("zero_bnb: cannot create %s (%s); building without the lock", lock_path, error)
        yield
        return
    try:
        _acquire(descriptor, lock_path, timeout)
        yield
    finally:
        os.close(descriptor)  # releases the flock
