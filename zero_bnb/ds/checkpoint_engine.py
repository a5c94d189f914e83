"""DeepSpeed's ``torch.save`` checkpoint engine, made durable and able to defer its writes.

:class:`DurableCheckpointEngine` replaces the engine DeepSpeed builds (``ZeroBnbEngine._configure_checkpointing``):
inside a save, the files DeepSpeed writes go into the save's :class:`~zero_bnb.checkpoint.commit.SaveTransaction`
(fsynced, checksummed, recorded for the manifest) or, for an asynchronous save, are staged and left to the
background writer; inside a load it serves the objects the load's plan already read and checked. Local.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from typing import Any

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
    TorchCheckpointEngine,
)

from zero_bnb.checkpoint.commit import SaveTransaction
from zero_bnb.checkpoint.staging import StagingLimitError, StagingPool
from zero_bnb.format.durable import makedirs, save_torch
from zero_bnb.format.publish import replacing
from zero_bnb.format.unpickle import safe_load

__all__ = ["DurableCheckpointEngine"]

logger = logging.getLogger(__name__)


class DurableCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's ``torch.save`` checkpoint engine, writing durably into a :class:`SaveTransaction`.

    Files DeepSpeed writes (the model-states file) are fsynced, checksummed and recorded
    for the manifest like zero_bnb's own.
    """

    transaction: SaveTransaction | None = None
    #: ``{path: loaded object}`` prepared (read and checked) by a load's plan; served by :meth:`load`.
    planned: dict[str, Any] | None = None
    #: An asynchronous save's staging buffers: :meth:`save` then stages the object and defers the write
    #: (to :attr:`deferred`) instead of writing it.
    pool: StagingPool | None = None
    #: ``(path, staged object)`` of the writes an asynchronous save left to its background writer.
    deferred: list[tuple[str, Any]] | None = None

    def makedirs(self, path, exist_ok=False):
        if self.transaction is None:
            if not exist_ok and os.path.isdir(path):
                raise FileExistsError(path)
            makedirs(path)
            return
        with self.transaction.guard():  # DeepSpeed calls it outside any error handling of its own
            staging = self.transaction.staging_folder
            if not os.path.isdir(staging):  # never made again here: the commit names what removed it
                raise FileNotFoundError(errno.ENOENT, "the save's staging folder was removed while the save ran",
                                        staging)
            makedirs(path)

    def save(self, state_dict, path: str) -> None:
        """Write ``path`` as a new file in the save's staging folder; outside a save (DeepSpeed's
        ``save_16bit_model``), into a private folder renamed over ``path`` when complete."""
        transaction = self.transaction
        if transaction is None:
            with replacing(path) as temporary:
                save_torch(state_dict, temporary, root=os.path.dirname(temporary))
            return
        if not self.defer(path, lambda: self.pool.snapshot(state_dict), os.path.basename(path)):
            transaction.add([save_torch(state_dict, path, root=transaction.staging_folder)])

    def defer(self, path: str, stage: Callable[[], Any], what: str) -> bool:
        """In an asynchronous save, stage what ``path`` will hold (``stage()``, copying into :attr:`pool`) and leave
        its write to the background writer; ``False`` in a synchronous save, or (with a warning naming ``what``)
        when the staging limit is reached: the caller then writes it now. Local."""
        if self.pool is None or self.deferred is None:
            return False
        try:
            self.deferred.append((path, stage()))
        except StagingLimitError as error:
            logger.warning("zero_bnb: %s; writing %s before save_checkpoint returns", error, what)
            return False
        return True

    def load(self, path: str, map_location=None):
        """The planned object for ``path``, else ``torch.load(weights_only=True)`` (no code from the file runs)."""
        if self.planned is not None and path in self.planned:
            return self.planned[path]
        return safe_load(path, "DeepSpeed checkpoint file", deepspeed_classes=True)
