"""Automatic resume through a front door takes the newest *complete* checkpoint, never an interrupted save.

Each front door lists its checkpoint folders its own way and takes the newest: Trainer's ``get_last_checkpoint`` the
``checkpoint-N`` folder with the largest N, Accelerate's ``load_state()`` the ``checkpoints/checkpoint_N`` with the
largest N, Lightning's ``ckpt_path="last"`` the ``last*.ckpt`` modified last. A folder a killed save left behind
(:mod:`zero_bnb.checkpoint.front_door`, :mod:`zero_bnb.format.progress`) is passed over here, with one WARNING on
the main process that names it and the checkpoint used; a folder given explicitly that holds an interrupted save is
refused with an error naming the newest complete one. Folders without zero_bnb's records are judged as the front
door always judged them. Local, read-only.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable

import torch.distributed as dist

from zero_bnb.errors import CheckpointUsageError
from zero_bnb.format.progress import FolderStatus, first_complete, folder_status

__all__ = ["accelerate_checkpoints", "is_main_process", "newest_complete", "refuse_interrupted", "trainer_checkpoints", "warn_passed_over"]

logger = logging.getLogger(__name__)

_TRAINER = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils._re_checkpoint
_NUMBER = re.compile(r"[0-9]+")


def is_main_process() -> bool:
    """Whether this process is rank 0 (of the process group, else of the launcher's ``RANK``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    rank = os.environ.get("RANK", "0")
    return not (rank.isascii() and rank.isdigit()) or int(rank) == 0


def _numbered(folder: str, number: Callable[[str], int | None]) -> list[str]:
    """The sub-folders of ``folder`` that ``number`` numbers, largest number first."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    numbered = [(n, name) for name in names if (n := number(name)) is not None
                and os.path.isdir(os.path.join(folder, name))]
    return [os.path.join(folder, name) for _, name in sorted(numbered, reverse=True)]


def trainer_checkpoints(output_dir: str) -> list[str]:
    """Trainer's ``checkpoint-N`` folders in ``output_dir``, newest (largest N) first."""
    return _numbered(output_dir, lambda name: int(m.group(1)) if (m := _TRAINER.match(name)) else None)


def accelerate_checkpoints(folder: str) -> list[str]:
    """The entries of Accelerate's ``{project_dir}/checkpoints`` ordered as ``load_state()`` orders them (by the first
    number in the name), newest first."""
    return _numbered(folder, lambda name: int(m.group(0)) if (m := _NUMBER.search(name)) else None)


def warn_passed_over(passed: list[FolderStatus], found: str | None, request: str) -> None:
    """One WARNING (main process) naming the folders ``request`` passed over and what it resumes from instead."""
    if passed and is_main_process():
        logger.warning("zero_bnb: %s passes over %d interrupted save%s: %s. %s", request, len(passed),
                       "" if len(passed) == 1 else "s", "; ".join(status.describe() for status in passed),
                       f"Resuming from {found}, the newest complete checkpoint" if found else
                       "No complete checkpoint is left")


def newest_complete(candidates: Iterable[str], request: str, require: str | None = None) -> str | None:
    """The first of ``candidates`` (newest first) whose save was not interrupted (with the tag folder ``require``, if
    given); the ones passed over are named in one WARNING (on the main process) that says what ``request`` resumes
    from."""
    found, passed = first_complete(candidates, require)
    warn_passed_over(passed, found, request)
    return found


def refuse_interrupted(path: str, newest: str | None, argument: str, fix: str, require: str | None = None) -> None:
    """Raise when ``path``, given explicitly as ``argument``, holds an interrupted save.

    Raises:
        CheckpointUsageError: names the interrupted save, the newest complete checkpoint ``newest`` and ``fix``.
    """
    status = folder_status(path, require)
    if not status.interrupted:
        return
    instead = (f"The newest complete checkpoint beside it is {newest}: {fix}" if newest else
               "No complete checkpoint is beside it")
    anyway = (f"; to load it anyway (zero_bnb's checkpoint {status.tag!r} in it is complete, the front door's own "
              f"files beside it may be from the interrupted save), remove its mark {status.front_door.path}"
              if status.front_door is not None and status.tag is not None and not status.staging else "")
    raise CheckpointUsageError(
        f"{argument}={path!r} holds an interrupted save, not a checkpoint: {status.describe()}. {instead}. zero_bnb "
        f"does not delete interrupted folders (they hold files it did not write){anyway}"
    )
