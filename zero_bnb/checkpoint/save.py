"""Write a :class:`~zero_bnb.checkpoint.partitioned.PartitionedOptimizer` optimizer as DP-independent files.

:func:`write_local_files` is local (each rank writes its own shard, rank 0 also the
replicated file); :func:`build_manifest` describes the whole checkpoint and is called on
rank 0 once every rank has reported its files. Publishing the folder is
:mod:`zero_bnb.checkpoint.commit`'s job.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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

__all__ = ["build_manifest", "write_local_files"]


def _valid_slice(value: torch.Tensor, count: int) -> torch.Tensor:
    """The real-element part (along the last, partition axis) of a partition-local tensor, as a compact CPU copy."""
    return value.detach()[..., :count].to("cpu", copy=True).contiguous()


def _hyperparameters(optimizer: PartitionedOptimizer, group_index: int) -> dict[str, Any]:
    group = optimizer.base_group(group_index)
    return {k: v for k, v in group.items() if k != "params"}


def write_local_files(optimizer: PartitionedOptimizer, tag_folder: str, masters: Sequence[MasterPlan]) -> list[FileRecord]:
    """Write this rank's shard, and on rank 0 the replicated-state file, durably.

    Local: no collectives. Each shard holds, per flat group, the fp32 master weights (whole, or
    derived as ``masters`` says: :func:`~zero_bnb.checkpoint.masters.plan_masters`) and the
    element-wise and block-wise state of the real elements this rank owns (padding stripped).

    Returns:
        The files written, with paths relative to ``tag_folder``.
    """
    folder = os.path.join(tag_folder, SUBDIR)
    makedirs(folder)
    rank = optimizer.dp_rank
    shard_groups, replicated_groups = [], []
    for group_index in range(optimizer.num_groups):
        geometry = optimizer.geometry(group_index)
        sharded, replicated, counters = {}, {}, {}
        for item in classify_group_state(optimizer, group_index):
            key, kind, value = item.entry.key, item.entry.kind, item.value
            if is_partitioned(kind):
                sharded[key] = _valid_slice(value, saved_length(kind, geometry, rank))
            elif kind is StateKind.REPLICATED:
                replicated[key] = value.detach().to("cpu", copy=True)
            else:
                counters[key] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
        plan = masters[group_index]
        fp32 = None if plan.storage != FULL else _valid_slice(
            optimizer.master_partition(group_index), saved_length(StateKind.ELEMENTWISE, geometry, rank))
        shard_groups.append(ShardGroup(fp32, sharded, plan.derived))
        replicated_groups.append(ReplicatedGroup(_hyperparameters(optimizer, group_index), counters, replicated))
    records = [write_shard(ShardPayload(rank, optimizer.dp_size, tuple(shard_groups)), folder, root=tag_folder)]
    if rank == 0:
        payload = ReplicatedPayload(tuple(replicated_groups), optimizer.wrapper_scalars())
        records.append(write_replicated(payload, folder, root=tag_folder))
    return records


def build_manifest(
    optimizer: PartitionedOptimizer,
    names: dict[torch.nn.Parameter, str],
    files: list[FileRecord],
    non_finite: dict[str, list[str]],
    masters: Sequence[MasterPlan],
) -> Manifest:
    """The manifest of a checkpoint whose files (of all ranks) are ``files``, its masters stored as ``masters``.

    Local; the geometry is the same on every rank, so any rank could build it (rank 0 does).
    """
    groups = []
    for group_index in range(optimizer.num_groups):
        geometry = optimizer.geometry(group_index)
        precision = optimizer.state_precision(group_index)
        groups.append(GroupEntry.describe(
            geometry.numel, optimizer.param_entries(group_index, names),
            tuple(item.entry for item in classify_group_state(optimizer, group_index)),
            geometry.element_ranges(), geometry.block_ranges(), _hyperparameters(optimizer, group_index),
            masters=masters[group_index].storage, **({"state_precision": precision} if precision else {}),
        ))
    base = optimizer.optimizer
    return Manifest.create(
        dp_world_size=optimizer.dp_size, block_size=optimizer.zero_bnb_spec.block_size,
        optimizer_class=f"{type(base).__module__}.{type(base).__qualname__}",
        optimizer_spec=optimizer.zero_bnb_spec.name, groups=tuple(groups), files=files, non_finite=non_finite,
        module_file=MODEL_STATES if any(plan.storage != FULL for plan in masters) else "",
    )
