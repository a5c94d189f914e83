"""Checks run on the live optimizer state before a checkpoint is written.

* :func:`classify_group_state`: the kind of every state entry (local).
* :func:`verify_replicated_state`: replicated tensors and counters are identical on every
  rank (collective).
* :func:`find_non_finite`: which parameters hold NaN/Inf in master weights or float
  optimizer state (collective).

Every function that takes the optimizer and is marked collective must be called by all
ranks of its data-parallel group, in the same order, or the job hangs. Collective checks
raise the same error on every rank, so no rank goes on to write a file.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zero_bnb.checkpoint.partitioned import PartitionedOptimizer
from zero_bnb.core.kinds import is_partitioned, local_range, non_finite_params, saved_length
from zero_bnb.core.state_spec import ClassifiedBy, StateKind, UnsupportedOptimizerError, classify_state
from zero_bnb.errors import NonFiniteStateError, ReplicatedStateMismatch
from zero_bnb.format.manifest import StateEntry

__all__ = ["Classified", "classify_group_state", "find_non_finite", "verify_replicated_state"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Classified:
    """One state entry of a rank's partition: how it is saved, and its value."""

    entry: StateEntry
    value: Any
    by: ClassifiedBy


def _base_state(optimizer: PartitionedOptimizer, group_index: int) -> dict[str, Any]:
    return dict(optimizer.optimizer.state.get(optimizer.master_partition(group_index), {}))


def classify_group_state(optimizer: PartitionedOptimizer, group_index: int) -> list[Classified]:
    """Kind of every state entry of this rank's partition of group ``group_index`` (local, no collectives)."""
    partition_numel = optimizer.geometry(group_index).partition_numel
    classified = []
    for key, value in sorted(_base_state(optimizer, group_index).items()):
        kind, by, reason = classify_state(
            key, value, spec=optimizer.zero_bnb_spec, rule=optimizer.zero_bnb_rule, partition_numel=partition_numel
        )
        if kind is StateKind.PARTITION_SCALAR:
            raise UnsupportedOptimizerError(
                f"optimizer state {key!r} of group {group_index} holds one value per partition, which cannot be "
                f"re-split at another DP size; change the optimizer settings that create it"
            )
        classified.append(Classified(StateEntry.describe(key, kind, value, reason), value, by))
    return classified


def _digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous().reshape(-1)
        return f"{tuple(value.shape)}:{value.dtype}:" + hashlib.sha256(data.view(torch.uint8).numpy()).hexdigest()
    return repr(value)


#: What to do when state tagged replicated by a user rule differs across ranks, by the rule.
_FIXES = {
    ClassifiedBy.THRESHOLD: "list exact keys in zero_unsharded_state_keys or lower zero_unsharded_state_max_numel",
    ClassifiedBy.NAMED: "remove it from zero_unsharded_state_keys",
}


def verify_replicated_state(optimizer: PartitionedOptimizer) -> None:
    """Check that replicated tensors, counters and state layouts agree on every rank.

    Collective over the data-parallel group; every rank raises the same error.

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
                item.by,
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
        kind, dtype, reason, digest, by = first
        shape = digest.split(":", 1)[0] if digest else "?"
        fix = _FIXES.get(by, "make sure every rank steps the optimizer the same number of times")
        raise ReplicatedStateMismatch(
            f"optimizer state {key!r} of group {group_index} (kind {kind}, {dtype}, shape {shape}) was tagged "
            f"{kind} ({reason}) but differs between rank 0 and rank(s) {differing}; {fix}. Nothing was saved."
        )


def _local_non_finite(optimizer: PartitionedOptimizer, names: dict) -> dict[str, list[str]]:
    """Parameter name -> saved tensors holding NaN/Inf, for this rank's partitions only."""
    found: dict[str, set[str]] = {}
    rank = optimizer.dp_rank
    for group_index in range(optimizer.num_groups):
        geometry = optimizer.geometry(group_index)
        master = optimizer.master_partition(group_index).detach()
        tensors = [("fp32", StateKind.ELEMENTWISE, master[..., : saved_length(StateKind.ELEMENTWISE, geometry, rank)])]
        for item in classify_group_state(optimizer, group_index):
            value, kind = item.value, item.entry.kind
            if is_partitioned(kind) and isinstance(value, torch.Tensor) and value.is_floating_point():
                tensors.append((item.entry.key, kind, value.detach()[..., : saved_length(kind, geometry, rank)]))
        params = optimizer.param_entries(group_index, names)
        for key, kind, tensor in tensors:
            for name in non_finite_params(tensor, kind, local_range(kind, geometry, rank), params, geometry.block_size):
                found.setdefault(name, set()).add(key)
    return {name: sorted(keys) for name, keys in found.items()}


def find_non_finite(optimizer: PartitionedOptimizer, names: dict, mode: str) -> dict[str, list[str]]:
    """Report NaN/Inf in master weights and float optimizer state, by parameter name.

    Collective over the data-parallel group (except with ``mode="off"``, which returns ``{}``
    at once on every rank). One read pass over the partition's float tensors.

    Args:
        optimizer: the engine's ZeRO optimizer.
        names: parameter -> name (``engine.param_names``).
        mode: ``"error"`` raises, ``"warn"`` logs a warning on rank 0 and returns the findings
            (the caller records them in the manifest), ``"off"`` skips the check.

    Raises:
        NonFiniteStateError: ``mode="error"`` and some rank holds NaN/Inf.
    """
    if mode == "off":
        return {}
    gathered: list[Any] = [None] * optimizer.dp_size
    dist.all_gather_object(gathered, _local_non_finite(optimizer, names), group=optimizer.dp_process_group)
    merged: dict[str, set[str]] = {}
    for part in gathered:
        for name, keys in part.items():
            merged.setdefault(name, set()).update(keys)
    found = {name: sorted(keys) for name, keys in sorted(merged.items())}
    if not found:
        return found
    listing = "; ".join(f"{name}: {', '.join(keys)}" for name, keys in found.items())
    if mode == "error":
        raise NonFiniteStateError(
            f"NaN/Inf found in {len(found)} parameter(s) ({listing}). Nothing was saved and 'latest' still names "
            f"the previous checkpoint. Resume from it (lower the learning rate or enable loss scaling), or set "
            f"zero_nonfinite_check to \"warn\" to save such a checkpoint anyway."
        )
    if optimizer.dp_rank == 0:
        logger.warning("zero_bnb: saving a checkpoint with NaN/Inf in %d parameter(s): %s", len(found), listing)
    return found
