"""Write a :class:`~zero_bnb.zero_optimizer.BlockAlignedZeroOptimizer` as a DP-independent checkpoint.

Every function that takes the optimizer is collective: all ranks of its data-parallel group
must call it, in the same order, or the job hangs.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zero_bnb import versions
from zero_bnb.checkpoint_format import (
    REPLICATED_NAME,
    SUBDIR,
    GroupEntry,
    Manifest,
    StateEntry,
    shard_name,
    write_manifest,
    write_torch,
)
from zero_bnb.state_spec import StateKind, UnsupportedOptimizerError, classify_state
from zero_bnb.zero_optimizer import BlockAlignedZeroOptimizer

__all__ = [
    "WRAPPER_SCALARS",
    "ReplicatedStateMismatch",
    "classify_group_state",
    "save_checkpoint_shards",
    "verify_replicated_state",
]

logger = logging.getLogger(__name__)

#: Scalars of DeepSpeed's ZeRO wrapper that a resume must restore (fp16 loss scaling).
WRAPPER_SCALARS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")


class ReplicatedStateMismatch(RuntimeError):
    """A state entry that must be identical on every rank is not."""


@dataclass(frozen=True, slots=True)
class _Classified:
    entry: StateEntry
    value: Any


def _base_state(optimizer: BlockAlignedZeroOptimizer, group_index: int) -> dict[str, Any]:
    return dict(optimizer.optimizer.state.get(optimizer.master_partition(group_index), {}))


def classify_group_state(optimizer: BlockAlignedZeroOptimizer, group_index: int) -> list[_Classified]:
    """Kind of every state entry of this rank's partition of group ``group_index`` (local, no collectives)."""
    partition_numel = optimizer.geometry(group_index).partition_numel
    classified = []
    for key, value in sorted(_base_state(optimizer, group_index).items()):
        kind, reason = classify_state(
            key, value, spec=optimizer.zero_bnb_spec, rule=optimizer.zero_bnb_rule, partition_numel=partition_numel
        )
        if kind is StateKind.PARTITION_SCALAR:
            raise UnsupportedOptimizerError(
                f"optimizer state {key!r} of group {group_index} holds one value per partition, which cannot be "
                f"re-split at another DP size; change the optimizer settings that create it"
            )
        dtype = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else type(value).__name__
        classified.append(_Classified(StateEntry(key, kind, dtype, reason), value))
    return classified


def _digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous().reshape(-1)
        return f"{tuple(value.shape)}:{value.dtype}:" + hashlib.sha256(data.view(torch.uint8).numpy()).hexdigest()
    return repr(value)


def verify_replicated_state(optimizer: BlockAlignedZeroOptimizer) -> None:
    """Check that replicated tensors, counters and state layouts agree on every rank.

    Collective over the data-parallel group. Every rank raises the same error, so none of
    them goes on to write a file.

    Raises:
        ReplicatedStateMismatch: names the key, its shape, the ranks that differ and the fix.
    """
    local = {}
    for group_index in range(optimizer.num_groups):
        for item in classify_group_state(optimizer, group_index):
            entry = item.entry
            local[(group_index, entry.key)] = (
                entry.kind.value,
                entry.dtype,
                entry.reason,
                _digest(item.value) if entry.kind in (StateKind.REPLICATED, StateKind.COUNTER) else "",
            )
    gathered: list[Any] = [None] * optimizer.dp_size
    dist.all_gather_object(gathered, local, group=optimizer.dp_process_group)

    keys = sorted(set().union(*(set(g) for g in gathered)))
    for group_index, key in keys:
        views = [g.get((group_index, key)) for g in gathered]
        if all(view == views[0] for view in views):
            continue
        differing = [rank for rank, view in enumerate(views) if view != views[0]]
        first = views[0] or views[differing[0]]
        kind, dtype, reason, _ = first
        shape = first[3].split(":", 1)[0] if first[3] else "?"
        fix = (
            "list exact keys in zero_unsharded_state_keys or lower zero_unsharded_state_max_numel"
            if "zero_unsharded_state_max_numel" in reason
            else "remove it from zero_unsharded_state_keys"
            if "zero_unsharded_state_keys" in reason
            else "make sure every rank steps the optimizer the same number of times"
        )
        raise ReplicatedStateMismatch(
            f"optimizer state {key!r} of group {group_index} (kind {kind}, {dtype}, shape {shape}) was tagged "
            f"{kind} ({reason}) but differs between rank 0 and rank(s) {differing}; {fix}. Nothing was saved."
        )


def _valid_slice(value: torch.Tensor, count: int) -> torch.Tensor:
    """The real-element part of a partition-local state tensor, as a compact CPU copy."""
    return value.detach()[:count].to("cpu", copy=True).contiguous()


def save_checkpoint_shards(
    optimizer: BlockAlignedZeroOptimizer, tag_folder: str, param_names: dict[torch.nn.Parameter, str]
) -> str:
    """Write this rank's shard, and on rank 0 the replicated file and the manifest (last).

    Collective over the data-parallel group; call :func:`verify_replicated_state` first.

    Args:
        optimizer: the engine's ZeRO optimizer.
        tag_folder: DeepSpeed's ``{save_dir}/{tag}`` folder; files go to its ``zero_bnb/``.
        param_names: parameter -> name, for the manifest (``engine.param_names``).

    Returns:
        The ``zero_bnb`` folder written.
    """
    folder = os.path.join(tag_folder, SUBDIR)
    rank, dp = optimizer.dp_rank, optimizer.dp_size
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier(group=optimizer.dp_process_group)

    shard_groups, replicated_groups, group_entries = [], [], []
    for group_index in range(optimizer.num_groups):
        geometry = optimizer.geometry(group_index)
        e_start, e_end = geometry.element_range(rank)
        b_start, b_end = geometry.block_range(rank)
        n_elements, n_blocks = e_end - e_start, b_end - b_start
        master = optimizer.master_partition(group_index)
        sharded, replicated, counters, entries = {}, {}, {}, []
        for item in classify_group_state(optimizer, group_index):
            entries.append(item.entry)
            if item.entry.kind is StateKind.ELEMENTWISE:
                sharded[item.entry.key] = _valid_slice(item.value, n_elements)
            elif item.entry.kind is StateKind.BLOCKWISE:
                sharded[item.entry.key] = _valid_slice(item.value, n_blocks)
            elif item.entry.kind is StateKind.REPLICATED:
                replicated[item.entry.key] = item.value.detach().to("cpu", copy=True)
            else:
                value = item.value
                counters[item.entry.key] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
        shard_groups.append({"fp32": _valid_slice(master, n_elements), "state": sharded})
        hyper = {k: v for k, v in optimizer.optimizer.param_groups[group_index].items() if k != "params"}
        replicated_groups.append({"param_group": hyper, "counters": counters, "replicated": replicated})
        group_entries.append(
            GroupEntry(
                numel=geometry.numel,
                params=optimizer.param_entries(group_index, param_names),
                states=tuple(entries),
                element_ranges=tuple(geometry.element_ranges()),
                block_ranges=tuple(geometry.block_ranges()),
            )
        )

    write_torch({"rank": rank, "dp": dp, "groups": shard_groups}, os.path.join(folder, shard_name(rank, dp)))
    if rank == 0:
        wrapper = {name: getattr(optimizer, name) for name in WRAPPER_SCALARS}
        write_torch({"groups": replicated_groups, "zero_wrapper": wrapper}, os.path.join(folder, REPLICATED_NAME))
    dist.barrier(group=optimizer.dp_process_group)
    if rank == 0:
        base = optimizer.optimizer
        manifest = Manifest(
            dp_world_size=dp,
            block_size=optimizer.zero_bnb_spec.block_size,
            optimizer_class=f"{type(base).__module__}.{type(base).__qualname__}",
            optimizer_spec=optimizer.zero_bnb_spec.name,
            groups=tuple(group_entries),
            shards=tuple(shard_name(r, dp) for r in range(dp)),
            versions=versions.installed(),
        )
        write_manifest(manifest, folder)
        logger.info("zero_bnb: saved %d shards (DP=%d) to %s", dp, dp, folder)
    dist.barrier(group=optimizer.dp_process_group)
    return folder
