"""Which Lightning checkpoint folder to load: ``ckpt_path="last"`` resumes from the newest complete checkpoint.

With DeepSpeed a Lightning checkpoint (``last.ckpt``, ``epoch=1-step=8.ckpt``) is one zero_bnb save folder, whose
tag is re-saved in place. Lightning's ``ckpt_path="last"`` takes the ``last*.ckpt`` modified last; when a save of it
was killed, that folder holds no checkpoint (a first save) or the checkpoint before the one that was interrupted,
while a ``ModelCheckpoint`` top-k folder saved just before may be newer and complete. :func:`complete_checkpoint`
takes, for a ``last`` checkpoint, the complete folder committed last among it and the ``*.ckpt`` folders of the
``ModelCheckpoint`` directories (one WARNING names what was passed over: an interrupted save, or a ``last.ckpt`` whose
re-save after a newer top-k checkpoint never began). An explicit
path that is not a ``last`` checkpoint and holds an interrupted save is refused, naming the newest complete one.
Local, read-only; every rank computes the same answer from the same folders.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from zero_bnb.errors import CheckpointUsageError
from zero_bnb.format.progress import folder_status
from zero_bnb.integrations.resume import is_main_process, refuse_interrupted, warn_passed_over

__all__ = ["complete_checkpoint"]

logger = logging.getLogger(__name__)

_EXTENSION = ".ckpt"
_LAST = "last"  # ModelCheckpoint.CHECKPOINT_NAME_LAST


def _candidates(folders: Iterable[str], also: str) -> list[str]:
    """Complete ``*.ckpt`` folders in ``folders`` and ``also``'s folder, committed last first."""
    found: dict[str, float] = {}
    for folder in {*folders, os.path.dirname(os.path.abspath(also))}:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(_EXTENSION) and os.path.isdir(path):
                status = folder_status(path)
                if not status.interrupted and status.tag is not None and status.committed_at is not None:
                    found[os.path.normpath(path)] = status.committed_at
    return sorted(found, key=found.get, reverse=True)


def complete_checkpoint(path: Any, folders: Iterable[str]) -> Any:
    """The checkpoint folder to load for Lightning's ``path`` (``folders``: the ``ModelCheckpoint`` directories).

    Raises:
        CheckpointUsageError: ``path`` holds an interrupted save and is not a ``last`` checkpoint (the message names
            the newest complete one), or it is a ``last`` checkpoint and no complete checkpoint is left.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return path  # a file, a remote URL: Lightning's own handling
    status = folder_status(os.fspath(path))
    last = os.path.basename(os.path.normpath(path)).startswith(_LAST)
    if not last and not status.superseded and status.tag is not None:
        return path
    candidates = _candidates(folders, os.fspath(path))
    if last:
        if not candidates:
            raise CheckpointUsageError(
                f"{path} holds an interrupted save and no complete checkpoint is beside it ({status.describe()}). "
                f"Start without ckpt_path, or remove {path} yourself once you no longer need it"
            )
        if candidates[0] != os.path.normpath(path):
            if status.superseded or status.tag is None:
                warn_passed_over([status], candidates[0], 'Lightning\'s ckpt_path="last"')
            elif is_main_process():  # a kill between ModelCheckpoint's top-k save and its re-save of last.ckpt
                logger.warning("zero_bnb: Lightning's ckpt_path=\"last\" resumes from %s, committed after %s (a save "
                               "of the latter was to follow)", candidates[0], path)
        return candidates[0]
    refuse_interrupted(os.fspath(path), candidates[0] if candidates else None, "ckpt_path", "pass that path")
    if status.tag is None:
        raise CheckpointUsageError(f"ckpt_path={os.fspath(path)!r} holds no complete checkpoint ({status.describe()})"
                                   + (f"; the newest complete one beside it is {candidates[0]}" if candidates else ""))
    return path
