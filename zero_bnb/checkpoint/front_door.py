"""A front door's save: its checkpoint folder counts as complete only once every file in it is written and durable.

Trainer (``checkpoint-N``) and Accelerate (``checkpoint_N``) write files of their own around zero_bnb's save into
one folder: model weights before it, RNG states, scheduler and ``trainer_state.json`` after it. A job killed in
between (or while an asynchronous save is still being written) leaves a folder that the front door's automatic
resume takes for the newest checkpoint, and that does not load. Around such a save (:func:`front_door_save`):

1. the main process marks the folder unfinished (:func:`zero_bnb.format.progress.mark_saving`) before the first
   file is written there: at once for Trainer, whose weights come first, or when the zero_bnb engine starts its
   save into that folder (:func:`mark_if_saving_into`) for Accelerate, which refuses a folder that already exists;
2. the front door saves as usual; what it deletes afterwards (Trainer's ``save_total_limit`` rotation) is held
   (:meth:`FrontDoorSave.defer`);
3. once the front door's save returned on every rank (a barrier) and zero_bnb's checkpoint is committed (at once,
   or in the background writer after an asynchronous save), the main process makes every file durable, removes the
   mark (:func:`~zero_bnb.format.progress.finish_saving`) and only then runs the held deletions.

A save that fails, or a job killed at any instant before step 3 ends, leaves the mark: automatic resume passes
the folder over (:mod:`zero_bnb.integrations.resume`) and the older checkpoints were not deleted. Nothing in an
interrupted folder is deleted by zero_bnb (its next save into the same folder removes only its own staging
folder).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from zero_bnb.checkpoint.pending import after_pending_saves
from zero_bnb.checkpoint.collective import agree
from zero_bnb.format.progress import finish_saving, mark_saving

__all__ = ["FrontDoorSave", "current_front_door_save", "front_door_save", "mark_if_saving_into"]

logger = logging.getLogger(__name__)

_LOCAL = threading.local()


class FrontDoorSave:
    """One front door's save into ``folder`` (see the module docstring); made by :func:`front_door_save`.

    Args:
        folder: the front door's checkpoint folder.
        door: ``"trainer"`` or ``"accelerate"`` (recorded in the mark).
        main: whether this process writes the mark (the front door's main process).
    """

    def __init__(self, folder: str, door: str, main: bool) -> None:
        self.folder = os.path.abspath(folder)
        self.door = door
        self.main = main
        self._token: str | None = None
        self._after: list[tuple[Callable[[], object], str]] = []

    def mark(self) -> None:
        """Mark the folder unfinished (the main process, once; a no-op elsewhere). Local."""
        if self.main and self._token is None:
            self._token = mark_saving(self.folder, self.door)

    def defer(self, action: Callable[[], object], what: str) -> None:
        """Run ``action`` (a deletion of older checkpoints) only once this save is complete; never if it fails."""
        self._after.append((action, what))

    def finish(self) -> None:
        """Make the folder durable, remove the mark, then run the held deletions (the main process, after the save
        is committed). Local."""
        if self._token is not None and not finish_saving(self.folder, self._token):
            for _, what in self._after:
                logger.warning("zero_bnb: %s did not run: %s is not marked complete", what, self.folder)
            return
        for action, what in self._after:
            try:
                action()
            except Exception as error:  # noqa: BLE001 - the front door's own deletion; logged like it would be
                logger.error("zero_bnb: %s failed after %s was complete: %r", what, self.folder, error)


def current_front_door_save() -> FrontDoorSave | None:
    """The front door's save running on this thread, if any."""
    return getattr(_LOCAL, "save", None)


def mark_if_saving_into(save_dir: str) -> None:
    """Mark the front door's folder now if this thread's front-door save writes into ``save_dir`` (the zero_bnb
    engine calls it before its save writes anything). Collective when a front-door save runs (every rank is inside
    one): a failure to mark is raised on every rank."""
    save = current_front_door_save()
    if save is None:
        return
    initialized, world = _world()
    mark = save.mark if os.path.abspath(save_dir) == save.folder else (lambda: None)
    if initialized and world > 1:
        agree(mark)
    else:
        mark()


def _marks(main: bool, initialized: bool) -> bool:
    """Whether this process writes and removes the mark: a main process of the front door that is the first process
    of its node (one per folder on a node's own disk, Trainer's ``save_on_each_node``; one, not every process, when a
    misconfigured Accelerate calls them all main)."""
    local = os.environ.get("LOCAL_RANK", "")
    if local.isascii() and local.isdigit():
        return main and int(local) == 0
    return main and (not initialized or dist.get_rank() == 0)


def _world() -> tuple[bool, int]:
    initialized = dist.is_available() and dist.is_initialized()
    return initialized, dist.get_world_size() if initialized else 1


@contextmanager
def front_door_save(folder: str, door: str, *, main: bool, mark_first: bool) -> Iterator[FrontDoorSave]:
    """Run a front door's save of ``folder`` inside the block (see the module docstring).

    Collective: every rank calls it around the front door's save (an agreement or barrier at each end when a process
    group exists). ``main`` is true on the process that writes the front door's own main files (Trainer's
    ``args.should_save``, Accelerate's ``is_main_process``); of those, the first process of each node writes and
    removes the mark and runs the held deletions. ``mark_first`` marks the folder before the block; else
    the zero_bnb engine's save marks it (:func:`mark_if_saving_into`). On an error in the block nothing more happens:
    the mark stays and the held deletions are dropped.
    """
    initialized, world = _world()
    save = FrontDoorSave(folder, door, _marks(main, initialized))
    if mark_first:
        if initialized and world > 1:
            agree(save.mark)  # no rank writes into the folder before it is marked; a failure raised on every rank
        else:
            save.mark()
    previous = current_front_door_save()
    _LOCAL.save = save
    try:
        yield save
    finally:
        _LOCAL.save = previous
    if initialized and world > 1:
        dist.barrier()  # every rank's files are written
    if save.main:
        after_pending_saves(save.finish, f"marking {save.folder} complete")
