"""The exceptions zero_bnb raises for checkpoints, in one hierarchy.

Every message names what was wrong, the values involved and what to do. Collective
operations (save, load) raise the same error class with the same message on every rank.
"""

from __future__ import annotations

import errno
import pickle
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointReplacedError",
    "CheckpointSaveError",
    "CheckpointUsageError",
    "NonFiniteStateError",
    "ReplicatedStateMismatch",
    "error_class",
    "failure_kind",
    "malformed",
]


class CheckpointError(ValueError):
    """Base class: a checkpoint cannot be written or read as asked."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint folder is missing, incomplete, or written in an unknown format."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or does not match its recorded checksum."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was written for another model or optimizer than the running one."""


class CheckpointReplacedError(CheckpointError):
    """A save of the same tag replaced the checkpoint while it was being loaded; nothing was loaded from it."""


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank; the previous checkpoint and ``latest`` were left as they were."""


class CheckpointUsageError(CheckpointError):
    """A call or command asked for something that cannot be done safely (nothing was touched):
    an unsafe or reserved tag, an output over its own input, an existing output without ``force``."""


class ReplicatedStateMismatch(CheckpointError):
    """A state entry that must be identical on every rank is not."""


class NonFiniteStateError(CheckpointError):
    """Master weights or optimizer state hold NaN or Inf values."""


_CLASSES = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointFormatError,
        CheckpointCorruptError,
        CheckpointMismatchError,
        CheckpointReplacedError,
        CheckpointSaveError,
        CheckpointUsageError,
        ReplicatedStateMismatch,
        NonFiniteStateError,
    )
}


def error_class(name: str) -> type[CheckpointError]:
    """The checkpoint error class called ``name`` (``CheckpointError`` for any other name)."""
    return _CLASSES.get(name, CheckpointError)


@contextmanager
def malformed(what: str) -> Iterator[None]:
    """Turn a lookup or type error while reading ``what`` (a file of unexpected structure) into
    :class:`CheckpointFormatError` naming it; checkpoint errors pass through unchanged."""
    try:
        yield
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError) as error:
        raise CheckpointFormatError(
            f"{what} is malformed ({type(error).__name__}: {str(error)[:200]}); it was not written by DeepSpeed or "
            f"zero_bnb, or it was edited"
        ) from error


#: errno -> (what happened, what to do), for the OS errors a checkpoint read or write meets in practice.
_OS_FAILURES = {
    errno.ENOSPC: ("the disk is full", "free space or save elsewhere"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or raise the quota"),
    errno.EACCES: ("permission denied", "fix the folder's permissions or run as its owner"),
    errno.EPERM: ("operation not permitted", "fix the folder's permissions or run as its owner"),
    errno.EROFS: ("the file system is read-only", "save to a writable folder"),
    errno.EMFILE: ("this process has too many open files", "raise the limit (ulimit -n) or close files"),
    errno.ENFILE: ("the system has too many open files", "close files or raise the system limit"),
    errno.EIO: ("an I/O error of the storage", "check the disk or the network file system"),
}


def failure_kind(error: BaseException) -> str:
    """What kind of failure ``error`` is, and what to do, in words (for the messages of saves and reads).

    Distinguishes the environment (a full disk, permissions, open-file limits: fixable by the user), data that
    cannot be serialized (an unpicklable ``client_state``), zero_bnb's own refusals (their message says the fix),
    memory, and anything else, which is a bug in zero_bnb, DeepSpeed or the caller's code: the traceback is logged.
    """
    if isinstance(error, CheckpointError):
        return "refused"
    if isinstance(error, MemoryError):
        return "out of memory (free memory, or load on a machine with more)"
    if isinstance(error, OSError) and error.errno in _OS_FAILURES:
        what, fix = _OS_FAILURES[error.errno]
        return f"{what} ({errno.errorcode[error.errno]}): {fix}"
    if isinstance(error, OSError):
        return f"an operating-system error ({errno.errorcode.get(error.errno, error.errno)}): check the storage"
    text = str(error)
    if isinstance(error, pickle.PicklingError) or (isinstance(error, (TypeError, AttributeError)) and "pickle" in text):
        return ("an object that cannot be saved (client_state and the optimizer's state must hold tensors and plain "
                "Python data, not functions, locks or open files)")
    return "an unexpected error, probably a bug: the full traceback is in this rank's log; please report it"
