"""The exceptions zero_bnb raises for checkpoints, in one hierarchy.

Every message names what was wrong, the values involved and what to do. Collective
operations (save, load) raise the same error class with the same message on every rank.
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "NonFiniteStateError",
    "ReplicatedStateMismatch",
    "error_class",
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
        ReplicatedStateMismatch,
        NonFiniteStateError,
    )
}


def error_class(name: str) -> type[CheckpointError]:
    """The checkpoint error class called ``name`` (``CheckpointError`` for any other name)."""
    return _CLASSES.get(name, CheckpointError)
