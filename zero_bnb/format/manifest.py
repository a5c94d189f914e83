"""The DP-independent checkpoint layout: a manifest plus one shard file per saving rank.

Pure I/O, no DeepSpeed and no collectives. Inside DeepSpeed's tag folder
(``{save_dir}/{tag}/``) zero_bnb writes a folder ``zero_bnb/`` holding:

* ``shard_{r}-of-{dp}.pt`` (one per saving rank ``r``): for every flat group, the fp32 master
  weights (or, as the group's ``masters`` says, what rebuilds them from the module weights in
  DeepSpeed's model file ``module_file``: :mod:`zero_bnb.format.masters`) and the element-wise and block-wise optimizer states of the real elements that
  rank owned, padding stripped. Ranges are global, so any DP size can read them back.
* ``replicated.pt`` (rank 0): per group the optimizer hyper-parameters, the counters
  (``step``) and the replicated tensors (``qmap1``/``qmap2``), each saved once, whole; plus
  the ZeRO wrapper's own scalars (loss scaler).
* ``manifest.json`` (rank 0, written last): what the files hold, where every parameter and
  every saved range lies, the versions that wrote it, and the size and digest of every
  file of the tag folder (DeepSpeed's model file included). Its first field is the SHA-256
  of the manifest itself, so a damaged manifest is detected too. A checkpoint without a
  manifest is incomplete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zero_bnb import versions
from zero_bnb.core.layout import ceil_div
from zero_bnb.core.state_spec import StateKind
from zero_bnb.errors import CheckpointCorruptError, CheckpointFormatError
from zero_bnb.format.digests import ALGORITHMS, SHA256, is_hex
from zero_bnb.format.durable import FileRecord, write_text
from zero_bnb.format.manifest_json import MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH, check_bounds, check_types, json_is
from zero_bnb.format.masters import FULL, STORAGES
from zero_bnb.format.paths import check_name, check_relative_path

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_DEPTH",
    "MASTER_KEY",
    "READABLE_VERSIONS",
    "TENSOR_DTYPES",
    "REPLICATED_NAME",
    "SUBDIR",
    "GroupEntry",
    "Manifest",
    "ParamEntry",
    "StateEntry",
    "decode_manifest",
    "jsonable",
    "owner_only",
    "read_manifest",
    "shard_name",
    "write_manifest",
]

FORMAT_NAME = "zero_bnb"
#: Version 2 stores the loss scaler as plain data (every file loads with ``weights_only=True``); version 3
#: may derive master weights from the module weights (``GroupEntry.masters``, ``Manifest.module_file``; the
#: optional ``Manifest.module_sha256`` and ``Manifest.migrated_from``, which older version-3 readers ignore, came
#: later); version 4 names each digest's algorithm (:mod:`zero_bnb.format.digests`: a file record ``{path, size, blake3}`` or
#: ``{path, size, sha256}``, ``module_digest`` in the module file's algorithm, a shard group's ``module_blake3``);
#: earlier versions hold SHA-256 only.
FORMAT_VERSION = 4
#: Versions this release reads (version 1 files hold DeepSpeed's pickled loss scaler, an allowed class;
#: versions 1 and 2 store every master weight in the shards).
READABLE_VERSIONS = (1, 2, 3, 4)
SUBDIR = "zero_bnb"
MANIFEST_NAME = "manifest.json"
REPLICATED_NAME = "replicated.pt"
#: Key of the fp32 master weights in each shard group (beside ``"state"``).
MASTER_KEY = "fp32"


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

    @classmethod
    def describe(cls, key: str, kind: StateKind, value: Any, reason: str) -> StateEntry:
        """The entry of a state value: its dtype name, and leading axes if it is split by partition."""
        is_tensor = isinstance(value, torch.Tensor)
        dtype = str(value.dtype).removeprefix("torch.") if is_tensor else type(value).__name__
        split = is_tensor and kind in (StateKind.ELEMENTWISE, StateKind.BLOCKWISE)
        return cls(key, kind, dtype, reason, tuple(value.shape[:-1]) if split else ())


@dataclass(frozen=True, slots=True)
class GroupEntry:
    """One flat parameter group as saved.

    ``element_ranges[r]`` / ``block_ranges[r]`` are the global ``[start, end)`` ranges held by
    shard ``r``; they tile ``[0, numel)`` and ``[0, ceil(numel / block_size))``.
    ``hyperparameters`` is a readable copy of the optimizer's param group (the exact values
    are restored from ``replicated.pt``). ``masters`` says how the shards store the group's fp32
    master weights (one of :data:`zero_bnb.format.masters.STORAGES`).
    """

    numel: int
    params: tuple[ParamEntry, ...]
    states: tuple[StateEntry, ...]
    element_ranges: tuple[tuple[int, int], ...]
    block_ranges: tuple[tuple[int, int], ...]
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    masters: str = FULL

    @classmethod
    def describe(cls, numel: int, params: tuple[ParamEntry, ...], states: tuple[StateEntry, ...],
                 element_ranges, block_ranges, param_group: dict[str, Any], *, masters: str = FULL,
                 **extra: Any) -> GroupEntry:
        """An entry whose ``hyperparameters`` are a JSON rendering of ``param_group`` (plus ``extra``)."""
        hyper = {k: jsonable(v) for k, v in param_group.items() if k != "params"}
        return cls(numel, tuple(params), tuple(states), tuple(map(tuple, element_ranges)),
                   tuple(map(tuple, block_ranges)), {**hyper, **extra}, masters)

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

    ``files`` lists every file of the tag folder with its size and digest (BLAKE3 or SHA-256, named in each
    record), paths relative to the tag folder. ``non_finite`` maps parameter names to the saved tensors (``fp32`` or a
    state key) that held NaN/Inf when the checkpoint was written. ``module_file`` names DeepSpeed's model
    file (relative to the tag folder) when some group's masters derive from its module weights, and
    ``module_digest`` its digest as saved, in its record's algorithm (what those masters were split against; empty in
    older checkpoints; ``module_sha256`` in the JSON before format version 4). Informational: nothing reads it, as a
    manifest re-signed over an edited model file can carry any value; the shards' per-piece digests are what bind
    the masters to the weights (:func:`zero_bnb.format.masters.check_module`).
    ``migrated_from`` describes the checkpoint an offline tool rewrote into this one (``zero-bnb convert`` of a stock
    DeepSpeed checkpoint): ``{"format": "stock DeepSpeed", "dp_world_size": 2}``, the DP size that run saved at,
    while ``dp_world_size`` is the layout written here (one partition); empty for a checkpoint a training run saved.
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
    batch: dict[str, int] = field(default_factory=dict)  # global, micro, accumulation, dp (zero_bnb.checkpoint.batch)
    module_file: str = ""
    module_digest: str = ""
    migrated_from: dict[str, Any] = field(default_factory=dict)  # format, dp_world_size (omitted when empty)
    format_version: int = FORMAT_VERSION
    format_name: str = FORMAT_NAME

    @classmethod
    def create(cls, *, dp_world_size: int, block_size: int, optimizer_class: str, optimizer_spec: str,
               groups: tuple[GroupEntry, ...], files: list[FileRecord], non_finite: dict[str, list[str]] | None = None,
               module_file: str = "", migrated_from: dict[str, Any] | None = None,
               source: str = "the manifest being written") -> Manifest:
        """The manifest of a checkpoint being written (shards named for ``dp_world_size``, files sorted,
        installed versions), validated like one being read. The one constructor of both write paths."""
        manifest = cls(
            dp_world_size=dp_world_size, block_size=block_size, optimizer_class=optimizer_class,
            optimizer_spec=optimizer_spec, groups=tuple(groups),
            shards=tuple(shard_name(rank, dp_world_size) for rank in range(dp_world_size)),
            files=tuple(sorted(files, key=lambda record: record.path)), non_finite=dict(non_finite or {}),
            versions=versions.installed(), module_file=module_file,
            module_digest=next((record.digest for record in files if module_file and record.path == module_file), ""),
            migrated_from=dict(migrated_from or {}),
        )
        manifest.validate(source)
        return manifest

    @property
    def saved_dp_size(self) -> int:
        """The DP size of the training run that saved this state: ``dp_world_size``, or for a checkpoint an offline
        tool migrated, the DP size its source was saved at (``migrated_from``)."""
        return self.migrated_from.get("dp_world_size", self.dp_world_size)

    def to_json(self) -> str:
        """The manifest as JSON whose first field is the SHA-256 of the text itself."""
        data = asdict(self)
        data["files"] = [{"path": f.path, "size": f.size, f.algorithm: f.digest} for f in self.files]
        if not data["migrated_from"]:  # a training run's checkpoint: its manifest as before the field existed
            del data["migrated_from"]
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
        check_bounds(text, source)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise CheckpointFormatError(f"{source} is not valid JSON ({error}); the checkpoint is damaged") from error
        if data.get("format_name") != FORMAT_NAME:
            raise CheckpointFormatError(f"{source} is not a zero_bnb manifest (format_name={data.get('format_name')!r})")
        if data.get("format_version") not in READABLE_VERSIONS:
            raise CheckpointFormatError(
                f"{source} has format_version={data.get('format_version')!r}, but this zero_bnb reads versions "
                f"{list(READABLE_VERSIONS)}; load it with the zero_bnb release that wrote it "
                f"(versions recorded: {data.get('versions')!r:.200})"
            )
        check_types(data, source)
        try:
            groups = tuple(
                GroupEntry(
                    numel=g["numel"],
                    params=tuple(ParamEntry(p["name"], tuple(p["shape"]), p["offset"]) for p in g["params"]),
                    states=tuple(StateEntry(s["key"], StateKind(s["kind"]), s["dtype"], s["reason"], tuple(s.get("lead", ()))) for s in g["states"]),
                    element_ranges=tuple(tuple(r) for r in g["element_ranges"]),
                    block_ranges=tuple(tuple(r) for r in g["block_ranges"]),
                    hyperparameters=dict(g["hyperparameters"]),
                    masters=g.get("masters", FULL),
                )
                for g in data["groups"]
            )
            manifest = cls(
                dp_world_size=data["dp_world_size"],
                block_size=data["block_size"],
                optimizer_class=data["optimizer_class"],
                optimizer_spec=data["optimizer_spec"],
                groups=groups,
                shards=tuple(data["shards"]),
                files=tuple(_file_record(f, data["format_version"]) for f in data["files"]),
                non_finite={name: list(keys) for name, keys in data["non_finite"].items()},
                versions=dict(data["versions"]),
                batch=dict(data.get("batch", {})),
                module_file=data.get("module_file", ""),
                module_digest=data.get("module_digest" if data["format_version"] >= 4 else "module_sha256", ""),
                migrated_from=dict(data.get("migrated_from", {})),
                format_version=data["format_version"],
                format_name=data["format_name"],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise CheckpointFormatError(f"{source} is missing or has a malformed field ({error!r:.300})") from error
        manifest.validate(source)
        return manifest

    def validate(self, source: str = "manifest") -> None:
        """Check that every name is a safe path component and every range tiles its group.

        Runs before any file the manifest names is opened or any tensor is allocated, so a
        crafted manifest can neither reach outside its folder nor ask for absurd memory.

        Raises:
            CheckpointFormatError: names the field, its value and what it must be.
        """
        def fail(field_name: str, value: Any, rule: str) -> None:
            raise CheckpointFormatError(f"{source}: {field_name}={value!r:.200} is invalid: {rule}; the manifest was "
                                        f"not written by zero_bnb or was edited")

        if not 1 <= self.dp_world_size <= _MAX_DP:
            fail("dp_world_size", self.dp_world_size, f"it must lie in [1, {_MAX_DP}]")
        if not 1 <= self.block_size <= _MAX_BLOCK:
            fail("block_size", self.block_size, f"it must lie in [1, {_MAX_BLOCK}]")
        expected_shards = tuple(shard_name(r, self.dp_world_size) for r in range(self.dp_world_size))
        if self.shards != expected_shards:
            fail("shards", self.shards, f"a save at DP={self.dp_world_size} writes {list(expected_shards)[:4]}...")
        for index, record in enumerate(self.files):
            check_relative_path(record.path, f"{source}: files[{index}].path")
            if record.size < 0 or record.algorithm not in ALGORITHMS or not is_hex(record.digest):
                fail(f"files[{index}]", record, f"size must be >= 0, the algorithm one of {list(ALGORITHMS)} and the "
                                                f"digest 64 lowercase hex digits")
        counts = Counter(param.name for group in self.groups for param in group.params)
        if len(counts) != sum(counts.values()):
            fail("groups[*].params[*].name", sorted(n for n, count in counts.items() if count > 1)[:5],
                 "every parameter name must appear once")
        for g, group in enumerate(self.groups):
            if group.masters not in STORAGES:
                fail(f"groups[{g}].masters", group.masters, f"it must be one of {list(STORAGES)}")
        derived = [g for g, group in enumerate(self.groups) if group.masters != FULL]
        if derived and self.module_file not in {record.path for record in self.files}:
            fail("module_file", self.module_file, f"groups {derived[:5]} derive their masters from its module weights, "
                                                  f"but {self.module_file or 'it'} is not listed in the manifest's files")
        if self.module_digest and not (self.module_file and is_hex(self.module_digest)):
            fail("module_digest", self.module_digest, "it must be 64 lowercase hex digits, beside a module_file")
        if self.migrated_from and not (
                set(self.migrated_from) == {"format", "dp_world_size"}
                and isinstance(self.migrated_from["format"], str) and 0 < len(self.migrated_from["format"]) <= _MAX_ORIGIN
                and json_is(self.migrated_from["dp_world_size"], int) and 1 <= self.migrated_from["dp_world_size"] <= _MAX_DP):
            fail("migrated_from", self.migrated_from, f"it must be {{}} or {{format: a string of 1 to {_MAX_ORIGIN} "
                                                      f"characters, dp_world_size: an integer in [1, {_MAX_DP}]}}")
        for g, group in enumerate(self.groups):
            where = f"groups[{g}]"
            keys = [state.key for state in group.states]
            if len(set(keys)) != len(keys) or MASTER_KEY in keys:
                fail(f"{where}.states[*].key", keys, f"state keys must be unique and not {MASTER_KEY!r}")
            if not 0 <= group.numel <= _MAX_NUMEL:
                fail(f"{where}.numel", group.numel, f"it must lie in [0, {_MAX_NUMEL}]")
            offset = 0
            for p, param in enumerate(group.params):
                check_name(param.name, f"{source}: {where}.params[{p}].name")
                if param.offset != offset or any(size < 0 for size in param.shape):
                    fail(f"{where}.params[{p}]", param, f"parameters are stored back to back: offset must be {offset}")
                offset += param.numel
            if offset != group.numel:
                fail(f"{where}.numel", group.numel, f"its parameters hold {offset} elements")
            blocks = ceil_div(group.numel, self.block_size)
            for name, ranges, end in (("element_ranges", group.element_ranges, group.numel),
                                      ("block_ranges", group.block_ranges, blocks)):
                bounds = [0] + [bound for pair in ranges for bound in pair] + [end]
                if len(ranges) != self.dp_world_size or any(len(pair) != 2 for pair in ranges) or any(
                        bounds[i] != bounds[i + 1] for i in range(0, len(bounds), 2)) or any(
                        bounds[i] > bounds[i + 1] for i in range(1, len(bounds) - 1, 2)):
                    fail(f"{where}.{name}", ranges, f"{self.dp_world_size} ranges [start, end) in order must tile "
                                                    f"[0, {end}) without gaps or overlaps")
            for s, state in enumerate(group.states):
                check_name(state.key, f"{source}: {where}.states[{s}].key")
                if state.kind is StateKind.PARTITION_SCALAR:
                    fail(f"{where}.states[{s}].kind", state.kind.value, "zero_bnb never saves per-partition scalars")
                if state.kind in (StateKind.ELEMENTWISE, StateKind.BLOCKWISE, StateKind.REPLICATED) and \
                        state.dtype not in TENSOR_DTYPES:
                    fail(f"{where}.states[{s}].dtype", state.dtype, f"tensor states have one of {sorted(TENSOR_DTYPES)}")
                lead = 1
                for size in state.lead:
                    lead *= size
                if not all(1 <= size for size in state.lead) or lead > _MAX_LEAD:
                    fail(f"{where}.states[{s}].lead", state.lead, f"leading axes hold 1 to {_MAX_LEAD} rows")


#: dtype names a saved tensor state may have (what bitsandbytes and torch optimizers keep).
TENSOR_DTYPES = frozenset({"uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"})
_MAX_DP = 1 << 20
#: Longest ``migrated_from["format"]`` (a short name such as "stock DeepSpeed").
_MAX_ORIGIN = 64
_MAX_BLOCK = 1 << 24
_MAX_NUMEL = 1 << 50
_MAX_LEAD = 64


def _file_record(entry: dict[str, Any], version: int) -> FileRecord:
    """A manifest's ``files`` entry (checked by ``check_types``: one digest key) as a record; before version 4 every
    digest is SHA-256."""
    algorithm = next(name for name in ALGORITHMS if name in entry) if version >= 4 else SHA256
    return FileRecord(entry["path"], entry["size"], entry[algorithm], algorithm)


def owner_only(path_or_fd: str | int) -> None:
    """Remove group and other write permission from a proof file zero_bnb just wrote (a manifest, an output record),
    whatever the umask: :func:`zero_bnb.format.ownership.distrust` trusts only files no one else can write. Local."""
    mode = stat.S_IMODE(os.stat(path_or_fd).st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.chmod(path_or_fd, mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def write_manifest(manifest: Manifest, folder: str, *, root: str) -> FileRecord:
    """Write ``manifest.json`` into ``folder``, durably, writable by its owner only; this marks the checkpoint
    complete."""
    record = write_text(manifest.to_json(), os.path.join(folder, MANIFEST_NAME), root=root)
    owner_only(os.path.join(folder, MANIFEST_NAME))
    return record


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
        raw = handle.read(MAX_MANIFEST_BYTES + 1)
    return decode_manifest(raw, path)


def decode_manifest(raw: bytes, source: str) -> Manifest:
    """Parse and check the bytes of a ``manifest.json`` read from ``source`` (see :func:`read_manifest`); reading
    ``MAX_MANIFEST_BYTES + 1`` bytes at most is enough to refuse a larger one."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointFormatError(
            f"{source} is larger than the {MAX_MANIFEST_BYTES} bytes a manifest may have (about 500 000 parameters); "
            f"it was not written by zero_bnb or was edited"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointCorruptError(f"{source} is not UTF-8 text ({error}); the manifest is damaged") from error
    return Manifest.from_json(text, source=source)
