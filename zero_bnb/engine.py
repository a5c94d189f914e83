"""``DeepSpeedEngine`` with zero_bnb's partitioning and elastic ZeRO checkpoints.

This module and :mod:`zero_bnb.zero_optimizer` are the only code that touches DeepSpeed
internals. The engine is a real ``DeepSpeedEngine``; it differs only in

* the ZeRO optimizer it builds (:class:`~zero_bnb.zero_optimizer.BlockAlignedZeroOptimizer`),
* the optimizer files it writes (:mod:`zero_bnb.save`) and reads (:mod:`zero_bnb.restore`),
  so that ``load_checkpoint`` works at any DP size.

Model weights, LR scheduler, client state and ``latest`` stay DeepSpeed's own files.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import deepspeed.runtime.engine as ds_engine_module
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from zero_bnb.config import ZeroBnbConfig
from zero_bnb.restore import CheckpointReader, restore_optimizer
from zero_bnb.save import save_checkpoint_shards, verify_replicated_state
from zero_bnb.state_spec import StateRule, spec_for
from zero_bnb.stock_import import StockCheckpoint
from zero_bnb.zero_optimizer import BlockAlignedZeroOptimizer

__all__ = ["ZeroBnbEngine", "swapped_attribute"]

logger = logging.getLogger(__name__)

_PATCH_LOCK = threading.RLock()


@contextmanager
def swapped_attribute(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """Rebind ``owner.name`` for the duration of a ``with`` block (serialised by a lock).

    DeepSpeed builds its engine and ZeRO optimizer from module-level names; this is how
    zero_bnb substitutes its subclasses without copying DeepSpeed's constructor calls.
    """
    if not hasattr(owner, name):
        raise RuntimeError(
            f"{getattr(owner, '__name__', owner)} has no attribute {name!r}: this DeepSpeed version is outside "
            f"zero_bnb's supported range (see pyproject.toml)"
        )
    with _PATCH_LOCK:
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        try:
            yield
        finally:
            setattr(owner, name, original)


class ZeroBnbEngine(DeepSpeedEngine):
    """A ``DeepSpeedEngine`` (ZeRO stage 1) whose checkpoints load at any DP size.

    Built by :func:`zero_bnb.initialize`; takes ``DeepSpeedEngine``'s arguments plus the
    parsed :class:`~zero_bnb.config.ZeroBnbConfig`.
    """

    def __init__(self, *args: Any, zero_bnb_config: ZeroBnbConfig, **kwargs: Any) -> None:
        self.zero_bnb_config = zero_bnb_config
        super().__init__(*args, **kwargs)

    # -- construction -------------------------------------------------------------------------

    def _state_rule(self, spec) -> StateRule:
        config = self.zero_bnb_config
        keys = config.unsharded_state_keys
        if keys is None:
            keys = spec.replicated_by_default
            if keys and self.global_rank == 0:
                logger.info(
                    "zero_bnb: zero_unsharded_state_keys not set; keeping %s replicated (the default for %s)",
                    list(keys),
                    spec.name,
                )
        return StateRule(unsharded_keys=frozenset(keys), max_numel=config.unsharded_state_max_numel)

    def _configure_zero_optimizer(self, optimizer):
        stage = self.zero_optimization_stage()
        if stage != 1:
            raise ZeRORuntimeException(
                f"zero_bnb supports ZeRO stage 1, but zero_optimization.stage is {stage}; set it to 1"
            )
        spec = spec_for(optimizer)
        factory = functools.partial(BlockAlignedZeroOptimizer, zero_bnb_spec=spec, zero_bnb_rule=self._state_rule(spec))
        with swapped_attribute(ds_engine_module, "DeepSpeedZeroOptimizer", factory):
            zero_optimizer = super()._configure_zero_optimizer(optimizer)
        if not isinstance(zero_optimizer, BlockAlignedZeroOptimizer):
            raise ZeRORuntimeException(
                f"DeepSpeed built {type(zero_optimizer).__name__} instead of zero_bnb's ZeRO optimizer; features that "
                f"replace it (zenflow, bf16 with fp32 gradient accumulation) are not supported by zero_bnb yet"
            )
        return zero_optimizer

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's ``save_checkpoint``, with the optimizer written DP-independently.

        Collective: all ranks must call it. Replicated optimizer state is verified across
        ranks before any file is written.
        """
        verify_replicated_state(self.optimizer)
        return super().save_checkpoint(
            save_dir,
            tag=tag,
            client_state={} if client_state is None else client_state,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    def _save_zero_checkpoint(self, save_path, tag):
        save_checkpoint_shards(self.optimizer, os.path.join(save_path, str(tag)), self.param_names)

    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        if self.load_universal_checkpoint():
            raise ZeRORuntimeException(
                "checkpoint.load_universal is set, but zero_bnb engines load their own checkpoints at any DP size; "
                "remove checkpoint.load_universal from the config"
            )
        tag_folder = os.path.join(load_dir, str(tag))
        if CheckpointReader.exists(tag_folder):
            saved = CheckpointReader(tag_folder)
            source = "zero_bnb"
        else:
            saved = StockCheckpoint.open(self, load_dir, tag)
            source = "stock DeepSpeed"
        restore_optimizer(self.optimizer, saved, self.param_names, load_optimizer_states=load_optimizer_states)
        if self.global_rank == 0:
            logger.info(
                "zero_bnb: loaded %s checkpoint %s saved at DP=%d into DP=%d",
                source,
                tag_folder,
                saved.manifest.dp_world_size,
                self.optimizer.dp_size,
            )
        return True
