"""Reading a zero_bnb checkpoint folder: manifest, file list, checksums, shards and replicated file.

One reader for the engine's loads and the offline tools. Local, single process; the engine
splits :meth:`CheckpointReader.verify` across ranks itself.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import torch

from zero_bnb.errors import CheckpointCorruptError, CheckpointFormatError
from zero_bnb.format.integrity import check_file_list, verify_checksums
from zero_bnb.core.kinds import is_partitioned, saved_ranges
from zero_bnb.core.state_spec import StateKind
from zero_bnb.format.manifest import MANIFEST_NAME, MASTER_KEY, MAX_MANIFEST_BYTES, SUBDIR, decode_manifest
from zero_bnb.format.masters import FULL, casts_like_masters, check_module, rebuild, rebuild_into
from zero_bnb.format.payload import ReplicatedPayload, ShardPayload, read_replicated, read_shard
from zero_bnb.format.pinned import PinnedFolder
from zero_bnb.format.tags import resolve_tag
from zero_bnb.format.unpickle import load_pinned
from zero_bnb.format.values import same_quantized_state, undeclared_non_finite

__all__ = ["CheckpointReader", "verify_checkpoint"]


class CheckpointReader:
    """A zero_bnb checkpoint folder, pinned: every file is read through one descriptor (see
    :mod:`zero_bnb.format.pinned`), so checksums, shards and model file all come from the same save
    even if the tag is re-saved meanwhile. Shards are memory-mapped.

    Opening reads and checks the manifest and the presence and size of every file; call
    :meth:`verify` before :attr:`replicated` or any shard is read. Master weights stored as derived
    from the module weights (:mod:`zero_bnb.format.masters`) are rebuilt from DeepSpeed's model file
    on first use; the model file is then unpickled once for both that and :meth:`load`. Files are read with
    ``weights_only=True`` and checked against the manifest (dtypes, shapes) as they are opened.

    Raises:
        CheckpointReplacedError: a save replaced the folder while it was being opened (anything found missing
            in a folder that its path no longer names).
    """

    def __init__(self, tag_folder: str) -> None:
        self.tag_folder = tag_folder
        self.files = PinnedFolder(tag_folder)
        relative = f"{SUBDIR}/{MANIFEST_NAME}"
        try:
            self.files.open(relative)
        except CheckpointCorruptError:  # not CheckpointReplacedError: a save that replaced the folder says so
            raise CheckpointFormatError(f"{os.path.join(tag_folder, relative)} does not exist: {tag_folder} is not "
                                        f"a complete zero_bnb checkpoint") from None
        raw = self.files.read(relative, MAX_MANIFEST_BYTES + 1)  # enough to refuse a larger one
        self.manifest = decode_manifest(raw, os.path.join(tag_folder, relative))
        self._manifest_digest = hashlib.sha256(raw).hexdigest()
        check_file_list(self.files, self.manifest)
        self._replicated: ReplicatedPayload | None = None
        self._shards: dict[int, ShardPayload] = {}
        self._masters: dict[tuple[int, int], torch.Tensor] = {}
        self._checked: set[tuple[int, int]] = set()  # (shard, group) whose module weights were checked
        self._module: dict | None = None  # the model file's module weights, for derived masters
        self._unclaimed: dict[str, object] = {}  # a model file read for masters, not yet handed to load()
        #: Every file's digest was checked against the manifest: by :meth:`verify` of all files here, or by a load
        #: whose ranks each verified a share and agreed (it sets this).
        self.verified = False

    @property
    def identity(self) -> str:
        """Which save this is: the SHA-256 of its manifest, which records every file's digest (comparable
        across nodes, unlike inode numbers)."""
        return self._manifest_digest

    def verify(self, rank: int = 0, world_size: int = 1, *, progress: bool = False) -> int:
        """Check this rank's share of the files' digests (with ``world_size`` 1 every file: :attr:`verified`);
        returns the bytes read."""
        read = verify_checksums(self.files, self.manifest, rank, world_size, progress=progress)
        self.verified = self.verified or world_size == 1
        return read

    @property
    def replicated(self) -> ReplicatedPayload:
        """The replicated-state file (hyper-parameters, counters, qmaps, loss scaler), read once."""
        if self._replicated is None:
            self._replicated = read_replicated(self.files, self.manifest)
        return self._replicated

    def preload(self) -> None:
        """Read the replicated file and open every shard (memory-mapped: only each index is read).

        Call after :meth:`verify`: it unpickles ``replicated.pt``.
        """
        _ = self.replicated
        for rank in range(len(self.manifest.shards)):
            self._shard(rank)

    def check_values(self) -> None:
        """Refuse NaN/Inf in any shard's master weights or float state that the manifest's ``non_finite`` does not
        declare (a pass over every shard; the replicated file's values are checked when it is read). Call after
        :meth:`preload`.

        Raises:
            CheckpointFormatError: names the shard, group, key and parameters.
        """
        manifest = self.manifest
        same_as = same_quantized_state(manifest.optimizer_spec)
        for rank, shard_file in enumerate(manifest.shards):
            for index, group in enumerate(manifest.groups):
                kinds = {MASTER_KEY: StateKind.ELEMENTWISE, **{s.key: s.kind for s in group.states
                                                             if is_partitioned(s.kind)}}
                for key, kind in kinds.items():
                    tensor = self.piece(rank, index, key)
                    axis_range = saved_ranges(kind, group.element_ranges, group.block_ranges)[rank]
                    found = undeclared_non_finite(tensor, key, kind, axis_range, group.params, manifest.block_size,
                                                  manifest.non_finite, same_as)
                    if found:
                        raise CheckpointFormatError(
                            f"{os.path.join(self.tag_folder, SUBDIR, shard_file)}: group {index}: {key!r} of "
                            f"parameter(s) {found[:5]} holds NaN/Inf, but the manifest's non_finite declares none "
                            f"there; the checkpoint was edited or damaged after it was written. Load an earlier tag"
                        )

    def load(self, name: str, what: str, *, deepspeed_classes: bool = False, mmap: bool = False):
        """Unpickle file ``name`` of the tag folder (``weights_only``) from the pinned bytes; for DeepSpeed's
        model file. ``mmap``: memory-map it (a tensor's bytes are read only when it is used). Call after
        :meth:`verify`. The caller owns (and may change) what is returned."""
        if name in self._unclaimed and deepspeed_classes:  # read already (memory-mapped) to rebuild masters
            return self._unclaimed.pop(name)
        return load_pinned(self.files, name, what, deepspeed_classes=deepspeed_classes, mmap=mmap)

    def _module_weights(self) -> dict:
        if self._module is None:
            name = self.manifest.module_file
            try:  # the offline tools run without DeepSpeed: import its classes only for a file that holds them
                states = load_pinned(self.files, name, "DeepSpeed model file", mmap=True)
            except CheckpointFormatError:
                states = load_pinned(self.files, name, "DeepSpeed model file", deepspeed_classes=True, mmap=True)
            if not isinstance(states, dict) or not isinstance(states.get("module"), dict):
                raise CheckpointFormatError(f"{os.path.join(self.tag_folder, name)} holds no 'module' state dict, but "
                                            f"this checkpoint's master weights derive from it; it was replaced")
            self._module = dict(states["module"])  # a copy: load()'s caller may change the file's dict
            self._unclaimed[name] = states
        return self._module

    def _derived_master(self, rank: int, group_index: int) -> torch.Tensor:
        key = (rank, group_index)
        if key not in self._masters:
            self._masters[key] = self._derived(rank, group_index, rebuild)
            self._checked.add(key)
        return self._masters[key]

    def _derived(self, rank: int, group_index: int, how):
        entry = self.manifest.groups[group_index]
        start, end = entry.element_ranges[rank]
        return how(entry.masters, self._shard(rank).groups[group_index].derived, entry.params, self._module_weights(),
                   start, end, model_file=os.path.join(self.tag_folder, self.manifest.module_file),
                   shard_file=os.path.join(self.tag_folder, SUBDIR, self.manifest.shards[rank]))

    def check_module_weights(self, rank: int = 0, world_size: int = 1) -> None:
        """Check this process's share (shards ``rank``, ``rank + world_size``, ...) of the module weights that
        derived masters are rebuilt from (dtype, shape and digest of every piece, as a rebuild checks them, verified
        or not: a re-signed manifest cannot vouch for an edited model file), without rebuilding; shards whose masters
        were rebuilt here already were checked then. Call after
        :meth:`preload`. Once every process of a load has called it with its rank, every piece was checked by one
        of them, and :meth:`module_weights_as_cast` may hand out the model file's weights.

        Raises:
            CheckpointFormatError: as :func:`~zero_bnb.format.masters.check_module`.
        """
        for shard in range(rank, len(self.manifest.shards), world_size):
            for index, entry in enumerate(self.manifest.groups):
                if entry.masters != FULL:
                    self._check_module(shard, index)

    def _check_module(self, rank: int, group_index: int) -> None:
        if (rank, group_index) not in self._checked:
            self._derived(rank, group_index, check_module)
            self._checked.add((rank, group_index))

    def module_weights_as_cast(self, dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """The model file's module weights (memory-mapped) of the parameters in ``dtypes`` (name -> the dtype the
        caller casts its master weight to) that are, bit for bit, the master weight cast to that dtype: those of
        groups whose masters derive from the module weights, where
        :func:`~zero_bnb.format.masters.casts_like_masters`. Copying them costs no rebuild. Valid once their
        pieces were checked (:meth:`check_module_weights`)."""
        found = {}
        for entry in self.manifest.groups:
            if entry.masters != FULL:
                found.update((p.name, self._module_weights()[p.name]) for p in entry.params
                             if p.name in dtypes and casts_like_masters(entry.masters, dtypes[p.name]))
        return found

    def close(self) -> None:
        """Release the pinned folder's descriptors (memory-mapped shards stay readable)."""
        self.files.close()

    def _shard(self, rank: int) -> ShardPayload:
        if rank not in self._shards:
            self._shards[rank] = read_shard(self.files, self.manifest, rank)
        return self._shards[rank]

    @staticmethod
    def exists(tag_folder: str) -> bool:
        """Whether ``tag_folder`` holds a zero_bnb checkpoint (complete or not)."""
        return os.path.isdir(os.path.join(tag_folder, SUBDIR))

    def stored_master_bytes(self, rank: int, group_index: int) -> int:
        """Bytes of tensor data shard ``rank`` stores for a group's masters (fp32, or residual and exceptions)."""
        group = self._shard(rank).groups[group_index]
        return group.fp32.nbytes if group.fp32 is not None else group.derived.nbytes

    def copy_range(self, rank: int, group_index: int, key: str, offset: int, out: torch.Tensor) -> None:
        """Elements ``[offset, offset + out.shape[-1])`` (last axis) of :meth:`piece` into ``out``. Derived masters
        not rebuilt here yet go straight into a float32 ``out``, checked first as a rebuild checks them: a load
        makes no tensor of a shard's whole range and copies nothing twice."""
        entry = self.manifest.groups[group_index]
        if (key != MASTER_KEY or entry.masters == FULL or (rank, group_index) in self._masters
                or out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous()):
            out.copy_(self.piece(rank, group_index, key)[..., offset : offset + out.shape[-1]])
            return
        self._check_module(rank, group_index)
        rebuild_into(entry.masters, self._shard(rank).groups[group_index].derived, entry.params, self._module_weights(),
                     entry.element_ranges[rank][0], offset, out)

    def piece(self, rank: int, group_index: int, key: str) -> torch.Tensor:
        """Saved tensor ``key`` (:data:`MASTER_KEY` for the fp32 masters, rebuilt if derived) of a group from
        shard ``rank``."""
        if key == MASTER_KEY and self.manifest.groups[group_index].masters != FULL:
            return self._derived_master(rank, group_index)
        return self._shard(rank).groups[group_index].piece(key)


def verify_checkpoint(load_dir: str, tag: str | None = None, *, progress: bool = False) -> CheckpointReader:
    """Run every consistency and checksum check on one zero_bnb checkpoint, in this process.

    Local: no collectives. After the checksums, the shards (memory-mapped) and the replicated
    file are read with ``weights_only=True`` and checked against the manifest (dtypes, shapes)
    and for values (:mod:`zero_bnb.format.values`: counters, hyper-parameters, quantization maps,
    NaN/Inf the manifest does not declare).

    Args:
        load_dir: the folder passed to ``save_checkpoint``.
        tag: the checkpoint tag; ``None`` reads it from ``latest``.

    Returns:
        The verified checkpoint (its ``tag_folder`` and ``manifest``).

    Raises:
        CheckpointFormatError: no such checkpoint, no ``latest``, or not a zero_bnb checkpoint.
        CheckpointCorruptError: a file is missing, truncated or damaged.
    """
    folder_tag = resolve_tag(load_dir, tag)
    if folder_tag is None:
        raise CheckpointFormatError(f"{load_dir} has no 'latest' file; pass the checkpoint tag explicitly")
    reader = CheckpointReader(os.path.join(load_dir, folder_tag))
    reader.verify(progress=progress)
    reader.preload()
    reader.check_values()
    return reader
