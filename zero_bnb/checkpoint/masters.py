"""Choose, per flat group, how a save stores the fp32 master weights (see :mod:`zero_bnb.format.masters`).

DeepSpeed writes every trained module weight into its model file; in fp32 training that weight
is the master, in bf16 training it is the master rounded to nearest even (``bit16.copy_(fp32)``
after every step). A group whose module weights are exactly that on every rank stores its masters
derived from them (fp32: nothing more; bf16: 16 bits each plus a short exception list); any other
group (fp16, ``zero_derived_module_weights``, ZeRO stage 3, a parameter missing from the model file, weights
loaded or changed after the last step) stores them whole. Every rank learns the same choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zero_bnb.checkpoint.partitioned import PartitionedOptimizer
from zero_bnb.core.residual import rounds_to
from zero_bnb.format.masters import FULL, MODULE, MODULE_LOW16, DerivedMasters, derive, module_slice, piece_digests
from zero_bnb.kernels.residual import split_rounded_bf16

__all__ = ["LocalMasters", "MasterPlan", "agree_masters", "derive_local_masters", "master_candidates",
           "stage_module_slices"]

logger = logging.getLogger(__name__)

_STORAGE_BY_DTYPE = {torch.float32: MODULE, torch.bfloat16: MODULE_LOW16}
#: Exceptions (12 bytes each) beyond one in this many elements cost more than storing the masters whole.
_MAX_EXCEPTION_RATIO = 6
#: Hash the module-weight pieces on a helper thread beside the rounding check and split (off: in turn, after them).
_HASH_BESIDE_SPLIT = True
_NOT_ROUNDING = ("its module weights are not its master weights rounded to their dtype (weights loaded or changed "
                 "after the last optimizer step?)")


@dataclass(frozen=True, slots=True)
class MasterPlan:
    """How one group's masters are saved (``storage``) and, when derived, this rank's part (``derived``)."""

    storage: str
    derived: DerivedMasters | None = None


def _candidate(optimizer: PartitionedOptimizer, group_index: int, weights: Mapping[str, torch.Tensor] | None,
               names: dict) -> tuple[str, str]:
    """The storage a group could use, and why not when it cannot (same answer on every rank)."""
    params = optimizer.group_params(group_index)
    if weights is None:
        return FULL, ("DeepSpeed's model file holds no module weights to derive them from (zero_derived_module_weights, "
                      "or ZeRO stage 3)")
    storage = _STORAGE_BY_DTYPE.get(params[0].dtype, FULL) if params else FULL
    if storage == FULL:
        return FULL, f"its module weights are {params[0].dtype if params else 'absent'}"
    absent = [names.get(p, "?") for p in params if names.get(p) not in weights or weights[names[p]] is not p]
    if absent:
        return FULL, f"parameters {absent[:3]} are not in DeepSpeed's model file under their names"
    return storage, ""


def _derive_local(optimizer: PartitionedOptimizer, index: int, names: dict, storage: str, master: torch.Tensor,
                  weight: torch.Tensor) -> tuple[DerivedMasters | None, int, str]:
    """This rank's derived part of group ``index`` (``None`` and why when its weights are not the rounded masters).

    The module-weight pieces are hashed on a helper thread while this one checks the rounding and splits the
    residual (both outside the GIL): on a free core the hashing costs no time.
    """
    start, end = optimizer.geometry(index).element_ranges()[optimizer.dp_rank]
    params = optimizer.param_entries(index, names)
    # A pool per call: one kept between saves would not survive a fork; at interpreter exit it refuses work.
    with ThreadPoolExecutor(1) as pool:
        try:
            digests = pool.submit(piece_digests, params, weight, start, end) if _HASH_BESIDE_SPLIT else None
        except RuntimeError:
            digests = None
        residual = None
        if storage == MODULE_LOW16:  # the rounding checked and the residual made in one pass
            residual = split_rounded_bf16(master, weight) if master.dtype == torch.float32 and \
                weight.dtype == torch.bfloat16 and master.shape == weight.shape else None
            rounding = residual is not None
        else:
            rounding = rounds_to(master, weight)
        if not rounding:
            if digests is not None:
                digests.cancel()
            return None, 0, _NOT_ROUNDING
        derived = derive(storage, master, weight, params, start, end, residual=residual,
                         digests=None if digests is None else digests.result())
    return derived, 0 if derived.residual is None else derived.residual.index.numel(), ""


def master_candidates(optimizer: PartitionedOptimizer, weights: Mapping[str, torch.Tensor] | None,
                      names: dict) -> list[tuple[str, str]]:
    """Per group, the storage its masters could use and why not when they cannot (the same on every rank). Local.

    Args:
        weights: the module weights DeepSpeed's model file will hold, by parameter name (the trained
            parameters themselves), or ``None`` if it holds none (``zero_derived_module_weights``, ZeRO stage 3).
        names: parameter -> name (``engine.param_names``).
    """
    return [_candidate(optimizer, index, weights, names) for index in range(optimizer.num_groups)]


def stage_module_slices(optimizer: PartitionedOptimizer, candidates: list[tuple[str, str]],
                        weights: Mapping[str, torch.Tensor] | None, names: dict,
                        stage: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor]:
    """For each group whose masters could derive, this rank's module weights taken by ``stage`` (the save's staging:
    a CPU view for a synchronous save, a host copy for an asynchronous one; its masters are staged whole with the
    shard), for :func:`derive_local_masters` to check in the save's writer. Local. Where the range lies back to back
    in one storage (DeepSpeed's flat 16-bit group, on the device too) ``stage`` gets one view of it: a view of the
    model file's staged copy where this rank staged that file, else one copy."""
    slices = {}
    for index, (storage, _) in enumerate(candidates):
        if storage != FULL:
            start, end = optimizer.geometry(index).element_ranges()[optimizer.dp_rank]
            params = optimizer.param_entries(index, names)
            slices[index] = stage(module_slice(params, {p.name: weights[p.name].detach() for p in params}, start, end))
    return slices


@dataclass(frozen=True, slots=True)
class LocalMasters:
    """One group's local finding (:func:`derive_local_masters`): the candidate storage, why not when it cannot be
    used here, this rank's derived part (``None``: store whole) and its exception count."""

    storage: str
    reason: str
    derived: DerivedMasters | None
    exceptions: int


def derive_local_masters(optimizer: PartitionedOptimizer, candidates: list[tuple[str, str]], names: dict,
                         inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> list[LocalMasters]:
    """Per group, this rank's part of the masters' decision (:func:`agree_masters` is the rest): the rounding
    checked and the residual split where the candidate allows (a failure is logged and stores that group whole).
    Local, no collectives: any thread may run it (:class:`~zero_bnb.checkpoint.staged.StagedSave` runs it beside
    the writing of DeepSpeed's files).

    ``inputs(index)`` gives this rank's master and module weights of a group that could derive, as the save staged
    them (:func:`stage_module_slices`).
    """
    found = []
    for index, (storage, reason) in enumerate(candidates):
        derived, exceptions = None, 0
        if storage != FULL:
            try:
                derived, exceptions, reason = _derive_local(optimizer, index, names, storage, *inputs(index))
            except Exception as error:  # noqa: BLE001  (one rank's failure must not strand the others)
                logger.warning("zero_bnb: group %d stores its fp32 master weights whole: deriving them on rank %d "
                               "failed: %r", index, optimizer.dp_rank, error)
                derived, exceptions, reason = None, 0, f"deriving them failed on rank {optimizer.dp_rank}: {error!r}"
        found.append(LocalMasters(storage, reason, derived, exceptions))
    return found


def agree_masters(optimizer: PartitionedOptimizer, found: list[LocalMasters], *, group: Any = None) -> list[MasterPlan]:
    """Per group, how this save stores the masters, from every rank's :func:`derive_local_masters`: derived where
    every rank could and the exceptions stay few, else whole.

    Collective over ``group`` (default: the optimizer's data-parallel group): every rank must call it.
    """
    local = [(entry.derived is not None or entry.storage == FULL, entry.exceptions) for entry in found]
    gathered: list[Any] = [None] * optimizer.dp_size
    dist.all_gather_object(gathered, local, group=optimizer.dp_process_group if group is None else group)
    result = []
    for index, entry in enumerate(found):
        storage, reason, derived = entry.storage, entry.reason, entry.derived
        ok = all(part[index][0] for part in gathered)
        exceptions = sum(part[index][1] for part in gathered)
        if storage != FULL and ok and exceptions * _MAX_EXCEPTION_RATIO >= max(optimizer.geometry(index).numel, 1):
            ok, reason = False, f"{exceptions} elements would need an exception"
        if storage != FULL and not ok:
            if optimizer.dp_rank == 0:
                logger.info("zero_bnb: group %d stores its fp32 master weights whole: %s", index,
                            reason or f"on another rank, {_NOT_ROUNDING}")
            storage, derived = FULL, None
        result.append(MasterPlan(storage, derived))
    return result
