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
  every saved range lies, the versions that wrote it, and the size and SHA-256 of every
  file of the tag folder (DeepSpeed's model file included). Its first field is the SHA-256
  of the manifest itself, so a damaged manifest is detected too. A checkpoint without a
  manifest is incomplete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zero_bnb.durable import FileRecord, write_text
from zero_bnb.errors import CheckpointCorruptError, CheckpointFormatError
from zero_bnb.state_spec import StateKind

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "REPLICATED_NAME",
    "SUBDIR",
    "GroupEntry",
    "Manifest",
    "ParamEntry",
    "StateEntry",
    "jsonable",
    "read_manifest",
    "read_replicated",
    "read_shard",
    "shard_name",
    "write_manifest",
]

FORMAT_NAME = "zero_bnb"
FORMAT_VERSION = 1
SUBDIR = "zero_bnb"
MANIFEST_NAME = "manifest.json"
REPLICATED_NAME = "replicated.pt"


_CHECKSUM_FIELD = "manifest_sha256"
_PLACEHOLDER = "0" * 64
_CHECKSUM_PATTERN = re.compile(r'\A\{\n "manifest_sha256": "([0-9a-f]{64})",\n')


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
    """One optimizer-state key of a flat group: its kind, dtype and why it got that kind.

    ``lead`` is the shape before the partition axis, which is always the last one (``(2,)``
    for AdEMAMix's two moments in one ``state1`` buffer; ``()`` for most states).
    """

    key: str
    kind: StateKind
    dtype: str
    reason: str
    lead: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class GroupEntry:
    """One flat parameter group as saved.

    ``element_ranges[r]`` / ``block_ranges[r]`` are the global ``[start, end)`` ranges held by
    shard ``r``; they tile ``[0, numel)`` and ``[0, ceil(numel / block_size))``.
    ``hyperparameters`` is a readable copy of the optimizer's param group (the exact values
    are restored from ``replicated.pt``).
    """

    numel: int
    params: tuple[ParamEntry, ...]
    states: tuple[StateEntry, ...]
    element_ranges: tuple[tuple[int, int], ...]
    block_ranges: tuple[tuple[int, int], ...]
    hyperparameters: dict[str, Any] = field(default_factory=dict)

    def state(self, key: str) -> StateEntry | None:
        for entry in self.states:
            if entry.key == key:
                return entry
        return None


def jsonable(value: Any) -> Any:
    """A JSON-friendly rendering of a hyper-parameter value (tuples as lists, tensors as numbers)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything a loader needs to know before it opens a shard.

    ``files`` lists every file of the tag folder with its size and SHA-256, paths relative to
    the tag folder. ``non_finite`` maps parameter names to the saved tensors (``fp32`` or a
    state key) that held NaN/Inf when the checkpoint was written.
    """

    dp_world_size: int
    block_size: int
    optimizer_class: str
    optimizer_spec: str
    groups: tuple[GroupEntry, ...]
    shards: tuple[str, ...]
    files: tuple[FileRecord, ...] = ()
    non_finite: dict[str, list[str]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    batch: dict[str, int] = field(default_factory=dict)  # global, micro, accumulation, dp (zero_bnb.batch)
    format_version: int = FORMAT_VERSION
    format_name: str = FORMAT_NAME

    def to_json(self) -> str:
        """The manifest as JSON whose first field is the SHA-256 of the text itself."""
        data = asdict(self)
        for group in data["groups"]:
            for state in group["states"]:
                state["kind"] = state["kind"].value
        text = json.dumps({_CHECKSUM_FIELD: _PLACEHOLDER, **data}, indent=1)
        return text.replace(_PLACEHOLDER, hashlib.sha256(text.encode("utf-8")).hexdigest(), 1)

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest") -> Manifest:
        """Parse and check a manifest written by :meth:`to_json`.

        Raises:
            CheckpointCorruptError: the text does not match its own checksum.
            CheckpointFormatError: not a zero_bnb manifest, or an unknown format version.
        """
        match = _CHECKSUM_PATTERN.match(text)
        if match is None:
            raise CheckpointCorruptError(
                f"{source} does not start with its {_CHECKSUM_FIELD!r} field: it is damaged or not a zero_bnb "
                f"manifest; load an earlier checkpoint tag"
            )
        unsigned = text[: match.start(1)] + _PLACEHOLDER + text[match.end(1) :]
        actual = hashlib.sha256(unsigned.encode("utf-8")).hexdigest()
        if actual != match.group(1):
            raise CheckpointCorruptError(
                f"{source} was modified or damaged: its content hashes to sha256 {actual[:16]}..., but it records "
                f"{match.group(1)[:16]}...; load an earlier checkpoint tag"
            )
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
                    states=tuple(StateEntry(s["key"], StateKind(s["kind"]), s["dtype"], s["reason"], tuple(s.get("lead", ()))) for s in g["states"]),
                    element_ranges=tuple(tuple(r) for r in g["element_ranges"]),
                    block_ranges=tuple(tuple(r) for r in g["block_ranges"]),
                    hyperparameters=dict(g["hyperparameters"]),
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
                files=tuple(FileRecord(f["path"], f["size"], f["sha256"]) for f in data["files"]),
                non_finite={name: list(keys) for name, keys in data["non_finite"].items()},
                versions=dict(data["versions"]),
                batch=dict(data.get("batch", {})),
                format_version=data["format_version"],
                format_name=data["format_name"],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise CheckpointFormatError(f"{source} is missing or has a malformed field ({error!r})") from error


def write_manifest(manifest: Manifest, folder: str, *, root: str) -> FileRecord:
    """Write ``manifest.json`` into ``folder``, durably; this marks the checkpoint complete."""
    return write_text(manifest.to_json(), os.path.join(folder, MANIFEST_NAME), root=root)


def read_manifest(folder: str) -> Manifest:
    """Read and check the manifest of the zero_bnb folder ``folder``.

    Raises:
        CheckpointFormatError: there is no manifest (an incomplete or non-zero_bnb checkpoint),
            it cannot be parsed, or its format version is unknown.
        CheckpointCorruptError: the manifest does not match its own checksum.
    """
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{path} does not exist: {folder} is not a complete zero_bnb checkpoint")
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointCorruptError(f"{path} is not UTF-8 text ({error}); the manifest is damaged") from error
    return Manifest.from_json(text, source=path)


def _load(path: str, what: str, **kwargs: Any) -> Any:
    if not os.path.isfile(path):
        raise CheckpointCorruptError(f"{what} {path} is missing; the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", **kwargs)
    except Exception as error:  # torch raises many types for damaged archives
        raise CheckpointCorruptError(
            f"{what} {path} cannot be read ({type(error).__name__}: {error}); the file is damaged"
        ) from error


def read_shard(folder: str, name: str) -> dict[str, Any]:
    """Open one shard lazily (memory-mapped): only the slices a loader touches are read."""
    return _load(os.path.join(folder, name), "shard file", mmap=True, weights_only=True)


def read_replicated(folder: str) -> dict[str, Any]:
    """Read ``replicated.pt`` (hyper-parameters, counters, replicated tensors, loss scaler).

    Check the file's checksum first: it holds a pickled DeepSpeed loss scaler, as DeepSpeed's
    own files do, so it is loaded with ``weights_only=False``.
    """
    return _load(os.path.join(folder, REPLICATED_NAME), "replicated-state file", weights_only=False)
