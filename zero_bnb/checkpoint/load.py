"""Open a checkpoint for loading and plan the load, refusing bad input before anything is modified.

:func:`open_for_load` checks the manifest, the presence, type and size of every file, the
digest of every file (split across ranks), the optimizer family and block size, and opens
the payload files (checked against the manifest). :func:`plan_load` then checks compatibility
with the running model and optimizer and reads everything the load will write. Both run under
:func:`~zero_bnb.checkpoint.collective.agree`: if one rank finds a problem, every rank raises
the same error, and neither the model nor the optimizer has been touched.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zero_bnb.checkpoint import regroup
from zero_bnb.checkpoint.collective import agree
from zero_bnb.checkpoint.derived import DERIVED_PARAMS_KEY, restore_derived
from zero_bnb.checkpoint.frozen import plan_frozen_fragments
from zero_bnb.checkpoint.model_file import check_model_states, plan_trained_weights, trained_shapes
from zero_bnb.checkpoint.partitioned import PartitionedOptimizer
from zero_bnb.checkpoint.restore import (
    RestorePlan,
    SavedState,
    check_family,
    master_weights,
    plan_restore,
)
from zero_bnb.checkpoint.stock_import import StockCheckpoint
from zero_bnb.errors import CheckpointReplacedError
from zero_bnb.format.reader import CheckpointReader
from zero_bnb.format.unpickle import safe_load

__all__ = ["LoadPlan", "Opened", "apply_module_weights", "open_for_load", "plan_load"]

logger = logging.getLogger(__name__)


def _pinned_everywhere(reader: CheckpointReader, tag_folder: str) -> None:
    """Raise on every rank unless every rank pinned the same save of ``tag_folder``. Collective."""
    identities: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, reader.identity)
    if len(set(identities)) > 1:
        raise CheckpointReplacedError(
            f"checkpoint {tag_folder} was replaced by a concurrent save while it was being loaded (the ranks opened "
            f"{len(set(identities))} different versions of it); nothing was loaded. Load again once the save has "
            f"finished"
        )


def _kind(tag_folder: str) -> str:
    """``"zero_bnb"`` or ``"stock"``: what the folder the tag was just resolved to holds. Local."""
    if CheckpointReader.exists(tag_folder):
        return "zero_bnb"
    if not os.path.isdir(tag_folder):
        raise CheckpointReplacedError(
            f"checkpoint folder {tag_folder} went away after it was found (a concurrent save is replacing it, or it "
            f"was removed); nothing was loaded. Load again once the save has finished"
        )
    return "stock"


def _agreed_kind(tag_folder: str) -> str:
    """:func:`_kind` on every rank, the same everywhere (ranks that disagree saw the folder before and after a
    save replaced it), so that all ranks take the same reader and the same collectives. Collective."""
    kind = agree(lambda: _kind(tag_folder))
    kinds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(kinds, kind)
    if len(set(kinds)) > 1:
        found = [rank for rank, seen in enumerate(kinds) if seen == "zero_bnb"]
        raise CheckpointReplacedError(
            f"checkpoint {tag_folder} was replaced by a concurrent save while it was being opened (rank(s) {found} "
            f"found zero_bnb files in it, the others none); nothing was loaded. Load again once the save has finished"
        )
    return kind


def _open_zero_bnb(engine, tag_folder: str, optimizer_states: bool, module_only: bool) -> Opened:
    optimizer = engine.optimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    reader = agree(lambda: CheckpointReader(tag_folder))  # pinned: every later read is of this save's files
    try:
        _pinned_everywhere(reader, tag_folder)
        if engine.zero_bnb_config.checkpoint_verify:
            agree(lambda: reader.verify(rank, world))
            reader.verified = True  # every rank checked its share (agree raised on all ranks had one failed)

        def prepared() -> SavedState:
            if optimizer_states:
                check_family(optimizer, reader.manifest)  # before the files, whose layout depends on it, are opened
            reader.preload()
            # the checkpoint's groups differ (bitsandbytes overrides), or a weights-only load into a changed model
            return regroup.for_engine(engine, reader, module_only=module_only)

        saved = agree(prepared)  # plan_load checks the rest (check_compatible first) before anything changes
    except BaseException:
        reader.close()
        raise
    if reader.manifest.non_finite and rank == 0:
        logger.warning(
            "zero_bnb: checkpoint %s was saved with NaN/Inf in %s", tag_folder, reader.manifest.non_finite
        )
    return Opened(saved, reader)


@dataclass
class Opened:
    """A checkpoint opened by :func:`open_for_load`: its state, and the pinned reader of a zero_bnb one
    (``None`` for a stock DeepSpeed checkpoint), which :func:`plan_load` reads the model file from."""

    saved: SavedState
    reader: CheckpointReader | None

    def close(self) -> None:
        """Release the pinned files (what was read stays valid)."""
        if self.reader is not None:
            self.reader.close()


def open_for_load(engine, load_dir: str, folder_tag: str, *, optimizer_states: bool, module_only: bool = False) -> Opened:
    """The checkpoint ``load_dir/folder_tag``, checked and ready for :func:`plan_load`.

    Collective: every rank of the engine's world must call it. A zero_bnb checkpoint is pinned
    (every rank reads the files of one save, even if the tag is re-saved meanwhile) and
    verified (checksums unless ``zero_checkpoint_verify`` is false); a folder without
    zero_bnb files is read as a stock DeepSpeed ZeRO-1 checkpoint.

    Args:
        engine: the :class:`~zero_bnb.ds.engine.ZeroBnbEngine` that will load it.
        load_dir: the folder given to ``load_checkpoint``.
        folder_tag: the folder name under ``load_dir`` (see :func:`zero_bnb.format.tags.resolve_tag`).
        optimizer_states: whether the optimizer state will be loaded (else only parameter
            names and shapes must match).
        module_only: a weights-only load (``load_module_only``): the model may have new or fewer parameters
            (:func:`~zero_bnb.checkpoint.regroup.masters_by_name`; ``load_module_strict`` is the model file's check).

    Raises:
        zero_bnb.errors.CheckpointError: on every rank, naming the file or difference found;
            :class:`~zero_bnb.errors.CheckpointReplacedError` if a save replaced the folder meanwhile.
        deepspeed.runtime.zero.utils.ZeRORuntimeException: a stock checkpoint at another DP size.
    """
    tag_folder = os.path.join(load_dir, folder_tag)
    if _agreed_kind(tag_folder) == "zero_bnb":
        return _open_zero_bnb(engine, tag_folder, optimizer_states, module_only)
    return Opened(agree(lambda: regroup.for_engine(engine, StockCheckpoint.open(engine, load_dir, folder_tag),
                                                   module_only=module_only)), None)


@dataclass
class LoadPlan:
    """Everything a load will write, read and checked before anything changes (see :func:`plan_load`);
    the trained module weights are set from the checked masters by :func:`apply_module_weights`."""

    optimizer: RestorePlan
    model_file: str
    model_states: dict[str, Any]
    saved: SavedState
    trained: dict[torch.nn.Parameter, str]
    #: Trained parameters' names -> model-file weights that are their masters cast to the parameter's dtype, bit for
    #: bit (masters derived from them, every piece checked by one rank of the plan): copied instead of rebuilt.
    as_cast: dict[str, torch.Tensor] = field(default_factory=dict)


def plan_load(engine, opened: Opened, model_file: str, *, optimizer_states: bool, strict: bool,
              module_only: bool = False, scheduler_states: bool = True, custom_load_fn: bool = False) -> LoadPlan:
    """Read and check every part of a load on this rank, changing nothing: the optimizer's
    partitions (:func:`~zero_bnb.checkpoint.restore.plan_restore`) and every entry of DeepSpeed's model
    file its loader applies (:func:`~zero_bnb.checkpoint.model_file.check_model_states`: module, counters,
    LR scheduler).

    Each rank reads only the saved ranges of its own new partitions. The module weights of trained
    parameters are not read here: the apply phase sets them to the master weights cast to the module's
    dtype, whatever dtype the checkpoint's module was in (each rank casts its partition, the ranks
    all-gather). With ``custom_load_fn`` (a user function DeepSpeed hands the module entries to), the
    entries are planned as the master weights cast instead, which reads every rank's masters.

    Local; the engine runs it under :func:`~zero_bnb.checkpoint.collective.agree` so that a failure on
    any rank stops the load on every rank before anything is modified.
    """
    saved = opened.saved
    optimizer = plan_restore(engine.optimizer, saved, engine.param_names, load_optimizer_states=optimizer_states)
    if opened.reader is None:
        model_states = safe_load(model_file, "DeepSpeed model file", deepspeed_classes=True)
    else:  # the bytes of the save that was verified, whatever now lies at model_file; mapped: the trained
        # weights in it are never read (see plan_trained_weights)
        model_states = opened.reader.load(os.path.basename(model_file), "DeepSpeed model file",
                                          deepspeed_classes=True, mmap=True)
    fresh = getattr(saved, "fresh", frozenset())  # parameters of a weights-only load with no saved master
    if fresh:
        numels = {name: int(getattr(param, "ds_numel", param.numel())) for param, name in engine.param_names.items()}
        regroup.keep_fresh_masters(engine.optimizer, optimizer, fresh, engine.param_names,
                                   regroup.saved_fresh_weights(fresh, model_states, numels, model_file))
    plan_frozen_fragments(engine.module, engine.param_names, model_states, opened.reader, engine.optimizer.dp_rank,
                          model_file)
    trained = {param: engine.param_names[param] for param in engine.optimizer.trained_params()
               if engine.param_names[param] not in fresh}
    master = master_weights(saved)  # reads a parameter's saved ranges only when asked for it
    if isinstance(model_states, dict) and DERIVED_PARAMS_KEY in model_states:
        live = {} if custom_load_fn else {name: param for param, name in trained.items()}
        restore_derived(model_states, lambda name: live[name] if name in live else master(name))
    check_model_states(engine, model_states, model_file, strict=strict, module_only=module_only,
                       scheduler_states=scheduler_states, trained=trained_shapes(engine.module, trained))
    plan_trained_weights(engine.module, trained, model_states, master if custom_load_fn else None)
    as_cast = {}
    if opened.reader is not None:  # this rank's share of the derived masters' module weights, the rest by the others
        opened.reader.check_module_weights(dist.get_rank(), dist.get_world_size())
        as_cast = opened.reader.module_weights_as_cast({name: param.dtype for param, name in trained.items()})
    return LoadPlan(optimizer, model_file, model_states, saved, trained, as_cast)


def apply_module_weights(optimizer: PartitionedOptimizer, plan: LoadPlan) -> None:
    """Set every trained module weight to its fp32 master weight cast to the module's dtype, bit for bit what
    ``master.to(dtype)`` gives (:func:`plan_load` left them to this). Call once the optimizer's partitions
    are applied.

    On the CPU, each rank copies every trained parameter's masters straight from the checkpoint's
    pieces (memory-mapped, checked by the plan) into the parameter: a memory copy, which beats a
    collective there (gloo moves far fewer bytes per second than a page-cache copy). Where the
    masters derive from DeepSpeed's module weights and those are the masters cast (``plan.as_cast``),
    the module weights are copied instead, so no rank rebuilds another rank's masters. On an
    accelerator, each rank casts its applied partition into the flat group the module's weights are
    views of and the ranks all-gather it, as DeepSpeed's step does: no rank reads another's masters.

    Collective: every rank of the engine's data-parallel group must call it.
    """
    params = list(plan.trained)
    if params and all(param.device.type == "cpu" for param in params):
        master = master_weights(plan.saved)
        with torch.no_grad():
            for param, name in plan.trained.items():
                if name in plan.as_cast:
                    param.data.copy_(plan.as_cast[name].view(param.shape))
                elif param.is_contiguous():
                    master(name, out=param.data.view(-1))
                else:
                    param.data.copy_(master(name))
    else:
        optimizer.cast_masters_into_module()
