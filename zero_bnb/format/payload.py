"""The payload files of a checkpoint as frozen records: the one owner of their structure.

``shard_{r}-of-{dp}.pt`` holds a :class:`ShardPayload` (per flat group, the fp32 master weights
or what derives them from DeepSpeed's module weights (:mod:`zero_bnb.format.masters`), and the
element-wise and block-wise states of the real elements rank ``r`` owned);
``replicated.pt`` holds a :class:`ReplicatedPayload` (per group the hyper-parameters, counters and
replicated tensors, and the ZeRO wrapper's scalars as plain data). Writers build records and call
:func:`write_shard` / :func:`write_replicated`; readers get records from :func:`read_shard` /
:func:`read_replicated`, checked against the manifest (dtypes, shapes, keys) before use. On disk
they are plain dicts of tensors, numbers and strings, read with ``weights_only=True``.

Local I/O, no collectives.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zero_bnb.core.kinds import is_partitioned, saved_ranges
from zero_bnb.core.state_spec import StateKind
from zero_bnb.errors import CheckpointFormatError
from zero_bnb.format.durable import FileRecord, save_torch
from zero_bnb.format.masters import FULL, DerivedMasters, derived_problems
from zero_bnb.format.manifest import MASTER_KEY, REPLICATED_NAME, SUBDIR, Manifest, shard_name
from zero_bnb.format.pinned import PinnedFolder
from zero_bnb.format.unpickle import load_pinned
from zero_bnb.format.values import counter_problem, hyperparameter_problem, qmap_keys, qmap_problem
from zero_bnb.format.wrapper_state import check_plain, plain_wrapper

#: Key of a shard group's derived master weights (beside ``"state"``), see :mod:`zero_bnb.format.masters`.
_MASTERS = "masters"

__all__ = [
    "ReplicatedGroup",
    "ReplicatedPayload",
    "ShardGroup",
    "ShardPayload",
    "read_replicated",
    "read_shard",
    "write_replicated",
    "write_shard",
]


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """One flat group's part of a shard: master weights (``fp32``, or ``derived`` from the module weights,
    see :mod:`zero_bnb.format.masters`) and partitioned states of the saved range."""

    fp32: torch.Tensor | None
    state: Mapping[str, torch.Tensor]
    derived: DerivedMasters | None = None

    def piece(self, key: str) -> torch.Tensor:
        """``fp32`` for :data:`~zero_bnb.format.manifest.MASTER_KEY`, else the state tensor ``key``.

        Derived masters are rebuilt by :class:`~zero_bnb.format.reader.CheckpointReader`, which has the model file.
        """
        if key != MASTER_KEY:
            return self.state[key]
        if self.fp32 is None:
            raise CheckpointFormatError("this shard group's master weights derive from the module weights; read them "
                                        "through CheckpointReader.piece")
        return self.fp32

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"state": dict(self.state)}
        if self.fp32 is not None:
            data[MASTER_KEY] = self.fp32
        if self.derived is not None:
            data[_MASTERS] = self.derived.to_dict()
        return data


@dataclass(frozen=True, slots=True)
class ShardPayload:
    """What one saving rank wrote: its groups' saved ranges (global ranges are in the manifest)."""

    rank: int
    dp: int
    groups: tuple[ShardGroup, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "dp": self.dp,
                "groups": [g.to_dict() for g in self.groups]}


@dataclass(frozen=True, slots=True)
class ReplicatedGroup:
    """One flat group's state that is the same on every rank: hyper-parameters, counters, replicated tensors."""

    param_group: Mapping[str, Any]
    counters: Mapping[str, Any]
    replicated: Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class ReplicatedPayload:
    """Everything saved once: every group's :class:`ReplicatedGroup` and the ZeRO wrapper's scalars (plain)."""

    groups: tuple[ReplicatedGroup, ...]
    wrapper: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [{"param_group": dict(g.param_group), "counters": dict(g.counters),
                            "replicated": dict(g.replicated)} for g in self.groups],
                "zero_wrapper": dict(self.wrapper)}


def write_shard(payload: ShardPayload, folder: str, *, root: str) -> FileRecord:
    """Write ``payload`` as ``folder/shard_{rank}-of-{dp}.pt``, durably; the record is relative to ``root``."""
    return save_torch(payload.to_dict(), os.path.join(folder, shard_name(payload.rank, payload.dp)), root=root)


def write_replicated(payload: ReplicatedPayload, folder: str, *, root: str) -> FileRecord:
    """Write ``payload`` as ``folder/replicated.pt``, durably; the record is relative to ``root``."""
    return save_torch(payload.to_dict(), os.path.join(folder, REPLICATED_NAME), root=root)


def read_shard(folder: PinnedFolder, manifest: Manifest, rank: int) -> ShardPayload:
    """Open shard ``rank`` of the pinned tag folder lazily (memory-mapped, ``weights_only``) and check it
    against ``manifest``."""
    relative = f"{SUBDIR}/{manifest.shards[rank]}"
    path = os.path.join(folder.path, relative)
    data = load_pinned(folder, relative, "shard file", mmap=True)
    _check_shard(data, manifest, rank, path)
    return ShardPayload(rank, manifest.dp_world_size, tuple(
        ShardGroup(group.get(MASTER_KEY), dict(group["state"]),
                   DerivedMasters.from_dict(group[_MASTERS]) if _MASTERS in group else None)
        for group in data["groups"]))


def read_replicated(folder: PinnedFolder, manifest: Manifest) -> ReplicatedPayload:
    """Read ``replicated.pt`` of the pinned tag folder (``weights_only``) and check it against ``manifest``.

    Version 1 files hold DeepSpeed's pickled loss scaler, which is then allowed by name and
    turned into the plain record.
    """
    relative = f"{SUBDIR}/{REPLICATED_NAME}"
    path = os.path.join(folder.path, relative)
    data = load_pinned(folder, relative, "replicated-state file",
                       deepspeed_classes=manifest.format_version < 2)
    _check_replicated(data, manifest, path)
    wrapper = plain_wrapper(data.get("zero_wrapper", {}))
    check_plain(wrapper, path)
    return ReplicatedPayload(tuple(ReplicatedGroup(dict(g["param_group"]), dict(g["counters"]), dict(g["replicated"]))
                                   for g in data["groups"]), wrapper)


def _tensor_problem(value: Any, dtype: str, shape: tuple[int, ...]) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if str(value.dtype).removeprefix("torch.") != dtype or tuple(value.shape) != shape:
        return f"is {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}, the manifest says {dtype} {shape}"
    return None


def _check_shard(shard: Any, manifest: Manifest, rank: int, source: str) -> None:
    """Every tensor of shard ``rank`` has the dtype and shape the manifest's ranges give it.

    Cheap on a memory-mapped shard (reads no tensor data). Raises ``CheckpointFormatError``
    naming the group, key and both shapes.
    """
    groups = shard.get("groups") if isinstance(shard, dict) else None
    if not isinstance(groups, list) or len(groups) != len(manifest.groups):
        raise CheckpointFormatError(f"{source} does not hold the {len(manifest.groups)} groups its manifest lists")
    problems = []
    for index, (entry, group) in enumerate(zip(manifest.groups, groups)):
        if not isinstance(group, dict) or not isinstance(group.get("state"), dict):
            problems.append(f"group {index} is not {{'{MASTER_KEY}' or '{_MASTERS}': ..., 'state': {{...}}}}")
            continue
        def length(kind: StateKind) -> int:
            start, end = saved_ranges(kind, entry.element_ranges, entry.block_ranges)[rank]
            return end - start

        if entry.masters == FULL and _MASTERS in group:
            problems.append(f"group {index} holds derived masters, but the manifest says {FULL!r}")
        elif entry.masters == FULL:
            problem = _tensor_problem(group.get(MASTER_KEY), "float32", (length(StateKind.ELEMENTWISE),))
            if problem:
                problems.append(f"group {index} {MASTER_KEY} {problem}")
        elif MASTER_KEY in group:
            problems.append(f"group {index} holds {MASTER_KEY!r} masters, but the manifest says {entry.masters!r}")
        else:
            problems += [f"group {index} {problem}" for problem in
                         derived_problems(group.get(_MASTERS), entry.masters, length(StateKind.ELEMENTWISE),
                                          manifest.format_version)]
        for state in entry.states:
            if not is_partitioned(state.kind):
                continue
            problem = _tensor_problem(group["state"].get(state.key), state.dtype, (*state.lead, length(state.kind)))
            if problem:
                problems.append(f"group {index} state {state.key!r} {problem}")
    if problems:
        raise CheckpointFormatError(f"{source} does not match its manifest: {'; '.join(problems[:6])}; the checkpoint "
                                    f"was edited or not written by zero_bnb")


def _check_replicated(replicated: Any, manifest: Manifest, source: str) -> None:
    """The replicated-state file holds, per group, the counters and replicated tensors the manifest lists."""
    groups = replicated.get("groups") if isinstance(replicated, dict) else None
    if not isinstance(groups, list) or len(groups) != len(manifest.groups) or not isinstance(
            replicated.get("zero_wrapper", {}), dict):
        raise CheckpointFormatError(f"{source} does not hold the {len(manifest.groups)} groups its manifest lists")
    problems, qmaps = [], qmap_keys(manifest.optimizer_spec)
    for index, (entry, group) in enumerate(zip(manifest.groups, groups)):
        if not isinstance(group, dict) or not all(isinstance(group.get(k), dict)
                                                  for k in ("param_group", "counters", "replicated")):
            problems.append(f"group {index} is not {{'param_group': {{}}, 'counters': {{}}, 'replicated': {{}}}}")
            continue
        for key, value in group["param_group"].items():
            problem = hyperparameter_problem(key, value)
            if problem:
                problems.append(f"group {index} hyper-parameter {key}={value!r:.80} {problem}")
        for state in entry.states:
            if state.kind is StateKind.COUNTER:
                if state.key not in group["counters"]:
                    problems.append(f"group {index} has no counter {state.key!r}")
                elif (problem := counter_problem(group["counters"][state.key])) is not None:
                    problems.append(f"group {index} counter {state.key}={group['counters'][state.key]!r:.60} {problem}")
            elif state.kind is StateKind.REPLICATED:
                value = group["replicated"].get(state.key)
                if not isinstance(value, torch.Tensor) or str(value.dtype).removeprefix("torch.") != state.dtype:
                    problems.append(f"group {index} replicated {state.key!r} is not a {state.dtype} tensor")
                elif state.key in qmaps and (problem := qmap_problem(value)) is not None:
                    problems.append(f"group {index} quantization map {state.key!r} {problem}")
    if problems:
        raise CheckpointFormatError(f"{source} does not match its manifest: {'; '.join(problems[:6])}; the checkpoint "
                                    f"was edited or not written by zero_bnb")
