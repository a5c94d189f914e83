"""The DP-independent checkpoint layout: a manifest plus one shard file per saving rank.

Pure I/O, no DeepSpeed and no collectives. Inside DeepSpeed's tag folder
(``{save_dir}/{tag}/``) zero_bnb writes a folder ``zero_bnb/`` holding:

* ``shard_{r}-of-{dp}.pt`` (one per saving rank ``r``): for every flat group, the fp32 master
  weights and the element-wise and block-wise optimizer states of the real elements that
  rank owned, padding stripped. Ranges are global, so any DP size can read them back.
* ``replicated.pt`` (rank 0): per group the optimizer hyper-parameters, the counters
  (``step``) and the replicated tensors (``qmap1``/``qmap2``), each saved once, whole; plus
  the ZeRO wrapper's own scalars (loss scaler).
* ``manifest.json`` (rank 0, written last): what the files hold, where every parameter and
  every saved range lies, and the versions that wrote it. A checkpoint without a manifest
  is incomplete.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zero_bnb.state_spec import StateKind

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "REPLICATED_NAME",
    "SUBDIR",
    "CheckpointFormatError",
    "GroupEntry",
    "Manifest",
    "ParamEntry",
    "StateEntry",
    "read_manifest",
    "read_replicated",
    "read_shard",
    "shard_name",
    "write_manifest",
    "write_torch",
]

FORMAT_NAME = "zero_bnb"
FORMAT_VERSION = 1
SUBDIR = "zero_bnb"
MANIFEST_NAME = "manifest.json"
REPLICATED_NAME = "replicated.pt"


class CheckpointFormatError(ValueError):
    """A checkpoint folder is missing, incomplete, or written in an unknown format."""


def shard_name(rank: int, dp: int) -> str:
    """File name of the shard written by ``rank`` of a save at DP size ``dp``."""
    return f"shard_{rank:05d}-of-{dp:05d}.pt"


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """One parameter of a flat group: its name, shape and element offset in the group."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One optimizer-state key of a flat group: its kind, dtype and why it got that kind."""

    key: str
    kind: StateKind
    dtype: str
    reason: str


@dataclass(frozen=True, slots=True)
class GroupEntry:
    """One flat parameter group as saved.

    ``element_ranges[r]`` / ``block_ranges[r]`` are the global ``[start, end)`` ranges held by
    shard ``r``; they tile ``[0, numel)`` and ``[0, ceil(numel / block_size))``.
    """

    numel: int
    params: tuple[ParamEntry, ...]
    states: tuple[StateEntry, ...]
    element_ranges: tuple[tuple[int, int], ...]
    block_ranges: tuple[tuple[int, int], ...]

    def state(self, key: str) -> StateEntry | None:
        for entry in self.states:
            if entry.key == key:
                return entry
        return None


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything a loader needs to know before it opens a shard."""

    dp_world_size: int
    block_size: int
    optimizer_class: str
    optimizer_spec: str
    groups: tuple[GroupEntry, ...]
    shards: tuple[str, ...]
    versions: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    format_name: str = FORMAT_NAME

    def to_json(self) -> str:
        data = asdict(self)
        for group in data["groups"]:
            for state in group["states"]:
                state["kind"] = state["kind"].value
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest") -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise CheckpointFormatError(f"{source} is not valid JSON ({error}); the checkpoint is damaged") from error
        if data.get("format_name") != FORMAT_NAME:
            raise CheckpointFormatError(f"{source} is not a zero_bnb manifest (format_name={data.get('format_name')!r})")
        if data.get("format_version") != FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{source} has format_version={data.get('format_version')!r}, but this zero_bnb reads version "
                f"{FORMAT_VERSION}; load it with the zero_bnb release that wrote it "
                f"(versions recorded: {data.get('versions')})"
            )
        try:
            groups = tuple(
                GroupEntry(
                    numel=g["numel"],
                    params=tuple(ParamEntry(p["name"], tuple(p["shape"]), p["offset"]) for p in g["params"]),
                    states=tuple(StateEntry(s["key"], StateKind(s["kind"]), s["dtype"], s["reason"]) for s in g["states"]),
                    element_ranges=tuple(tuple(r) for r in g["element_ranges"]),
                    block_ranges=tuple(tuple(r) for r in g["block_ranges"]),
                )
                for g in data["groups"]
            )
            return cls(
                dp_world_size=data["dp_world_size"],
                block_size=data["block_size"],
                optimizer_class=data["optimizer_class"],
                optimizer_spec=data["optimizer_spec"],
                groups=groups,
                shards=tuple(data["shards"]),
                versions=dict(data["versions"]),
                format_version=data["format_version"],
                format_name=data["format_name"],
            )
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointFormatError(f"{source} is missing or has a malformed field ({error!r})") from error


def write_torch(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` and make it durable (flush and fsync) before returning."""
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def write_manifest(manifest: Manifest, folder: str) -> None:
    """Write ``manifest.json`` into ``folder``, durably; this marks the checkpoint complete."""
    path = os.path.join(folder, MANIFEST_NAME)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(manifest.to_json())
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(folder: str) -> Manifest:
    """Read the manifest of the zero_bnb folder ``folder``.

    Raises:
        CheckpointFormatError: there is no manifest (an incomplete or non-zero_bnb checkpoint)
            or it cannot be parsed.
    """
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{path} does not exist: {folder} is not a complete zero_bnb checkpoint")
    with open(path, encoding="utf-8") as handle:
        return Manifest.from_json(handle.read(), source=path)


def read_shard(folder: str, name: str) -> dict[str, Any]:
    """Open one shard lazily (memory-mapped): only the slices a loader touches are read."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"shard file {path} is missing; the checkpoint in {folder} is incomplete")
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def read_replicated(folder: str) -> dict[str, Any]:
    """Read ``replicated.pt`` (hyper-parameters, counters, replicated tensors, loss scaler)."""
    path = os.path.join(folder, REPLICATED_NAME)
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{path} is missing; the checkpoint in {folder} is incomplete")
    # The ZeRO wrapper's loss scaler is a pickled DeepSpeed object, as in DeepSpeed's own files.
    return torch.load(path, map_location="cpu", weights_only=False)
