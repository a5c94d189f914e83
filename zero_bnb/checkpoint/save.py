"""Write a :class:`~zero_bnb.checkpoint.partitioned.PartitionedOptimizer` optimizer as DP-independent files.

:func:`stage_local_payload` takes what this rank writes (its shard, on rank 0 also the replicated file) out of
training's reach, :meth:`LocalPayload.write` writes it (local); :func:`manifest_draft` describes the whole
checkpoint at the call and is completed on rank 0 once every rank has reported its files. Publishing the folder is
:mod:`zero_bnb.checkpoint.commit`'s job.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from zero_bnb.checkpoint.masters import MasterPlan
from zero_bnb.checkpoint.partitioned import PartitionedOptimizer
from zero_bnb.checkpoint.state_checks import classify_group_state
from zero_bnb.core.kinds import is_partitioned, saved_length
from zero_bnb.core.state_spec import StateKind
from zero_bnb.format.durable import FileRecord, makedirs
from zero_bnb.format.manifest import SUBDIR, GroupEntry, Manifest
from zero_bnb.format.masters import FULL
from zero_bnb.format.stock_files import MODEL_STATES
from zero_bnb.format.payload import (
    ReplicatedGroup,
    ReplicatedPayload,
    ShardGroup,
    ShardPayload,
    write_replicated,
    write_shard,
)

__all__ = ["LocalPayload", "Stage", "copy_to_cpu", "manifest_draft", "split_by_kind", "stage_local_payload"]


#: How a save takes a tensor it will write: as a compact CPU tensor written before training goes on (a synchronous
#: save), or copied into a reused staging buffer (:meth:`zero_bnb.checkpoint.staging.StagingPool.tensor`, an
#: asynchronous one).
Stage = Callable[[torch.Tensor], torch.Tensor]


def copy_to_cpu(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a compact CPU tensor (the :data:`Stage` of a synchronous save, which writes it before training
    goes on): itself where it is a CPU tensor filling its own storage (``torch.save`` would write nothing more),
    else a copy."""
    value = value.detach()
    if (value.device.type == "cpu" and value.is_contiguous() and value.storage_offset() == 0
            and value.untyped_storage().nbytes() == value.numel() * value.element_size()):
        return value
    return value.to("cpu", copy=True).contiguous()


def _hyperparameters(optimizer: PartitionedOptimizer, group_index: int) -> dict[str, Any]:
    group = optimizer.base_group(group_index)
    return {k: v for k, v in group.items() if k != "params"}


@dataclasses.dataclass(frozen=True, slots=True)
class LocalPayload:
    """What one rank's optimizer files hold, copied out of training's reach (see :func:`stage_local_payload`)."""

    shard: ShardPayload
    replicated: ReplicatedPayload | None

    def with_masters(self, masters: Sequence[MasterPlan]) -> LocalPayload:
        """This payload with each group's masters stored as ``masters`` says (staged whole, then derived where the
        save's writer decided they can be: :func:`~zero_bnb.checkpoint.masters.agree_masters`); the masters kept
        whole as compact CPU tensors (a synchronous save staged them as views)."""
        groups = tuple(dataclasses.replace(group, fp32=None if group.fp32 is None else copy_to_cpu(group.fp32))
                       if plan.storage == FULL else dataclasses.replace(group, fp32=None, derived=plan.derived)
                       for group, plan in zip(self.shard.groups, masters, strict=True))
        return dataclasses.replace(self, shard=dataclasses.replace(self.shard, groups=groups))

    def write(self, tag_folder: str) -> list[FileRecord]:
        """Write this rank's shard, and on rank 0 the replicated-state file, durably. Local.

        Returns:
            The files written, with paths relative to ``tag_folder``.
        """
        folder = os.path.join(tag_folder, SUBDIR)
        if not os.path.isdir(tag_folder):  # never made again here: the commit then names what removed it
            raise FileNotFoundError(errno.ENOENT, "the save's staging folder was removed while the save ran", tag_folder)
        makedirs(folder)
        records = [write_shard(self.shard, folder, root=tag_folder)]
        if self.replicated is not None:
            records.append(write_replicated(self.replicated, folder, root=tag_folder))
        return records


def split_by_kind(states: Iterable[tuple[str, StateKind, Any]], partitioned: Callable[[StateKind, Any], Any],
                  whole: Stage) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A group's state as the format stores it: ``(sharded, replicated, counters)`` by each key's kind. Sharded
    values (element-wise and block-wise) are taken by ``partitioned(kind, value)`` (a save: this rank's real
    elements), replicated ones by ``whole``, counters by ``whole`` when tensors, else deep-copied. Local; the one
    split of every writer (a save's :func:`stage_local_payload`, the offline tools'
    :func:`zero_bnb.tools.offline.write_checkpoint`)."""
    sharded, replicated, counters = {}, {}, {}
    for key, kind, value in states:
        if is_partitioned(kind):
            sharded[key] = partitioned(kind, value)
        elif kind is StateKind.REPLICATED:
            replicated[key] = whole(value)
        else:
            counters[key] = whole(value) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    return sharded, replicated, counters


def stage_local_payload(optimizer: PartitionedOptimizer, masters: Sequence[MasterPlan],
                        stage: Stage = copy_to_cpu, stage_master: Stage | None = None) -> LocalPayload:
    """This rank's shard and (rank 0) replicated state, each tensor copied by ``stage`` (the masters kept whole by
    ``stage_master``, default ``stage``). Local: no collectives.

    Each shard holds, per flat group, the fp32 master weights (whole, or derived as ``masters`` says) and the
    element-wise and block-wise state of the real elements this rank owns (padding stripped); hyperparameters and
    counters are copied as they are now.
    """
    stage_master = stage if stage_master is None else stage_master
    rank = optimizer.dp_rank
    shard_groups, replicated_groups = [], []
    for group_index in range(optimizer.num_groups):
        geometry = optimizer.geometry(group_index)
        sharded, replicated, counters = split_by_kind(
            ((item.entry.key, item.entry.kind, item.value) for item in classify_group_state(optimizer, group_index)),
            lambda kind, value: stage(value.detach()[..., :saved_length(kind, geometry, rank)]), stage)
        plan = masters[group_index]
        fp32 = None if plan.storage != FULL else stage_master(
            optimizer.master_partition(group_index).detach()[..., :saved_length(StateKind.ELEMENTWISE, geometry, rank)])
        shard_groups.append(ShardGroup(fp32, sharded, plan.derived))
        replicated_groups.append(ReplicatedGroup(copy.deepcopy(_hyperparameters(optimizer, group_index)), counters,
                                                 replicated))
    shard = ShardPayload(rank, optimizer.dp_size, tuple(shard_groups))
    replicated_payload = None if rank != 0 else ReplicatedPayload(tuple(replicated_groups),
                                                                  copy.deepcopy(optimizer.wrapper_scalars()))
    return LocalPayload(shard, replicated_payload)


def manifest_draft(
    optimizer: PartitionedOptimizer,
    names: dict[torch.nn.Parameter, str],
    non_finite: dict[str, list[str]],
) -> Callable[[list[FileRecord], Sequence[MasterPlan]], Manifest]:
    """The manifest of this save, described now (hyperparameters as they are at the call), completed by the
    returned function with the files of all ranks and how the masters were stored, once they are written.

    Local; the geometry is the same on every rank, so any rank could build it (rank 0 does).
    """
    groups = []
    for group_index in range(optimizer.num_groups):
        geometry = optimizer.geometry(group_index)
        precision = optimizer.state_precision(group_index)
        groups.append(dict(
            numel=geometry.numel, params=optimizer.param_entries(group_index, names),
            states=tuple(item.entry for item in classify_group_state(optimizer, group_index)),
            element_ranges=geometry.element_ranges(), block_ranges=geometry.block_ranges(),
            param_group=copy.deepcopy(_hyperparameters(optimizer, group_index)),
            extra={"state_precision": precision} if precision else {},
        ))
    base = optimizer.optimizer
    fields = dict(
        dp_world_size=optimizer.dp_size, block_size=optimizer.zero_bnb_spec.block_size,
        optimizer_class=f"{type(base).__module__}.{type(base).__qualname__}",
        optimizer_spec=optimizer.zero_bnb_spec.name, non_finite=copy.deepcopy(non_finite),
    )

    def complete(files: list[FileRecord], masters: Sequence[MasterPlan]) -> Manifest:
        entries = tuple(GroupEntry.describe(
            group["numel"], group["params"], group["states"], group["element_ranges"], group["block_ranges"],
            group["param_group"], masters=plan.storage, **group["extra"]) for group, plan in zip(groups, masters, strict=True))
        return Manifest.create(files=files, groups=entries, **fields,
                               module_file=MODEL_STATES if any(plan.storage != FULL for plan in masters) else "")

    return complete
