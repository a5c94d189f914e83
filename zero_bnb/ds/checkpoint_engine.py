"""DeepSpeed's ``torch.save`` checkpoint engine, made durable and able to defer its writes, and the record of the
save or load under way.

:class:`DurableCheckpointEngine` replaces the engine DeepSpeed builds (``ZeroBnbEngine._configure_checkpointing``):
inside a save (:class:`SaveCall`), the files DeepSpeed writes are staged and left to the save's writer
(:class:`~zero_bnb.checkpoint.staged.StagedSave`: at once for a synchronous save, in the background for an
asynchronous one), which writes them into the save's :class:`~zero_bnb.checkpoint.commit.SaveTransaction`
(fsynced, checksummed, recorded for the manifest); inside a load (:class:`LoadCall`) it serves the objects the
load's plan already read and checked. Local.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
    TorchCheckpointEngine,
)
from deepspeed.runtime.zero.utils import ZeRORuntimeException
import torch.distributed as dist

from zero_bnb.checkpoint.commit import SaveTransaction
from zero_bnb.checkpoint.staging import InlineStaging, StagingLimitError, StagingPool
from zero_bnb.format.durable import makedirs, save_torch
from zero_bnb.format.publish import replacing
from zero_bnb.format.unpickle import safe_load

__all__ = ["DurableCheckpointEngine", "LoadCall", "SaveCall", "configure_checkpointing"]

logger = logging.getLogger(__name__)


@dataclass
class SaveCall:
    """One ``save_checkpoint`` call, as DeepSpeed's methods it runs through see it (``ZeroBnbEngine._calling``).

    Attributes:
        transaction: the save's transaction (begun).
        staging: how what it writes is taken out of training's reach (nothing copied: a synchronous save).
        deferred: ``(path, staged object)`` of the files left to the save's writer, in DeepSpeed's order.
        dropped: model-file entries left out (``zero_derived_module_weights``: rebuilt from the masters on load).
    """

    transaction: SaveTransaction
    staging: InlineStaging | StagingPool
    deferred: list[tuple[str, Any]] = field(default_factory=list)
    dropped: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class LoadCall:
    """One ``load_checkpoint`` call, as DeepSpeed's methods it runs through see it (``ZeroBnbEngine._calling``).

    Attributes:
        plan: the load's agreed plan (:class:`zero_bnb.checkpoint.load.LoadPlan`).
        planned: ``{path: object}`` the plan already read and checked (DeepSpeed's model file, under a stand-in
            path), served by :meth:`DurableCheckpointEngine.load`.
    """

    plan: Any
    planned: dict[str, Any]


class DurableCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's ``torch.save`` checkpoint engine, writing durably into a :class:`SaveTransaction`.

    Files DeepSpeed writes (the model-states file) are fsynced, checksummed and recorded
    for the manifest like zero_bnb's own.
    """

    #: The save or load under way (``None`` outside one): set and cleared with the engine's, by one context manager.
    call: SaveCall | LoadCall | None = None

    @property
    def transaction(self) -> SaveTransaction | None:
        """The transaction of the save under way, if any."""
        return self.call.transaction if isinstance(self.call, SaveCall) else None

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
        if not self.defer(path, lambda: self.call.staging.snapshot(state_dict), os.path.basename(path)):
            transaction.add([save_torch(state_dict, path, root=transaction.staging_folder)])

    def defer(self, path: str, stage: Callable[[], Any], what: str) -> bool:
        """In a save, stage what ``path`` will hold (``stage()``, through the call's staging) and leave its write to
        the save's writer; ``False`` outside a save, or (with a warning naming ``what``) when an asynchronous save's
        staging limit is reached: the caller then writes it now. Local."""
        call = self.call
        if not isinstance(call, SaveCall):
            return False
        try:
            call.deferred.append((path, stage()))
        except StagingLimitError as error:
            logger.warning("zero_bnb: %s; writing %s before save_checkpoint returns", error, what)
            return False
        return True

    def load(self, path: str, map_location=None):
        """The planned object for ``path``, else ``torch.load(weights_only=True)`` (no code from the file runs)."""
        if isinstance(self.call, LoadCall) and path in self.call.planned:
            return self.call.planned[path]
        return safe_load(path, "DeepSpeed checkpoint file", deepspeed_classes=True)


#: DeepSpeed's ``checkpoint`` config keys of its writers (``deepspeed.runtime.checkpoint_engine``, 0.17.1+; older
#: releases have no writer and leave ``checkpoint_config`` without the key)
CHECKPOINT_WRITER, CHECKPOINT_WRITER_DECOUPLED = "writer", "decoupled"


def configure_checkpointing(engine, configure: Callable[[], None]) -> None:
    """``engine._configure_checkpointing``: DeepSpeed's own (``configure``), with its checkpoint engine replaced by a
    :class:`DurableCheckpointEngine`. DeepSpeed's decoupled writer turns on zero_bnb's asynchronous saves; another
    writer (``fast``, datastates) is refused, naming the fix. Local."""
    checkpoint_config = engine._config.checkpoint_config
    writer = checkpoint_config.get(CHECKPOINT_WRITER)
    if writer is not None and not writer.get(CHECKPOINT_WRITER_DECOUPLED):
        raise ZeRORuntimeException(
            f"zero_bnb commits checkpoints atomically with its own writer, but the config selects DeepSpeed's "
            f"checkpoint.writer {writer.get('type', 'fast')!r}; remove checkpoint.writer from the config (for saves "
            f"in the background set \"zero_checkpoint_async\": true, or checkpoint.writer.decoupled: true)"
        )
    if writer is not None:
        # DeepSpeed's decoupled writer asks for saves in the background: zero_bnb's asynchronous saves
        # (zero_checkpoint_async), committed by its own writer (DeepSpeed's needs the deepspeed launcher's
        # CROSS_SIZE and would skip the atomic commit).
        if dist.get_rank() == 0:
            logger.info("zero_bnb: checkpoint.writer.decoupled is set: saves are asynchronous (zero_checkpoint_async)")
        engine.zero_bnb_config = dataclasses.replace(engine.zero_bnb_config, checkpoint_async=True)
        checkpoint_config[CHECKPOINT_WRITER] = None  # DeepSpeed builds its torch.save engine, replaced below
    try:
        configure()
    finally:
        checkpoint_config[CHECKPOINT_WRITER] = writer
    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ZeRORuntimeException(
            f"zero_bnb commits checkpoints atomically with its own writer, but the config selects "
            f"{type(engine.checkpoint_engine).__name__}; remove checkpoint.writer and datastates from the config"
        )
    engine.checkpoint_engine = DurableCheckpointEngine(engine._config)
