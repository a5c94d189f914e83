"""The exceptions zero_bnb raises for checkpoints, in one hierarchy.

Every message names what was wrong, the values involved and what to do. Collective
operations (save, load) raise the same error class with the same message on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointUsageError",
    "NonFiniteStateError",
    "ReplicatedStateMismatch",
    "error_class",
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
