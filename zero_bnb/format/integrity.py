"""Check a zero_bnb checkpoint's files against its manifest: presence, sizes and digests (BLAKE3 or SHA-256).

Local functions, no collectives; the engine splits :func:`verify_checksums` across ranks,
and :func:`zero_bnb.format.reader.verify_checkpoint` runs them all in one process (for tools and tests).
"""

from __future__ import annotations

import os

from tqdm import tqdm

from zero_bnb.errors import CheckpointCorruptError, CheckpointFormatError
from zero_bnb.format import digests
from zero_bnb.format.durable import FileRecord
from zero_bnb.format.manifest import REPLICATED_NAME, SUBDIR, Manifest
from zero_bnb.format.masters import MODULE_BYTES, SHARD_BYTES
from zero_bnb.format.paths import check_relative_path
from zero_bnb.format.pinned import PinnedFolder

__all__ = ["check_file_list", "checksum_shares", "verify_checksums"]


def checksum_shares(files: tuple[FileRecord, ...], world_size: int) -> list[list[int]]:
    """Split the files among ``world_size`` ranks, largest first to the least-loaded rank.

    Deterministic, so every rank computes the same split from the manifest.
    """
    shares: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for index in sorted(range(len(files)), key=lambda i: (-files[i].size, files[i].path)):
        rank = loads.index(min(loads))
        shares[rank].append(index)
        loads[rank] += files[index].size
    return shares


def check_file_list(folder: PinnedFolder, manifest: Manifest) -> None:
    """Every file the manifest lists is a regular file inside the pinned ``folder`` with its recorded size.

    Every shard and the replicated file must be listed, and the shards must be large enough
    for the elements the manifest records (so no reader allocates more than the files hold).
    The files are opened (and held, see :class:`~zero_bnb.format.pinned.PinnedFolder`) here.

    Raises:
        CheckpointCorruptError: lists every missing, truncated or grown file.
        CheckpointFormatError: a listed path is a symbolic link or lies under one, or is a FIFO or
            device, or the recorded sizes cannot hold the recorded elements.
        CheckpointReplacedError: a save replaced the folder while it was being opened.
    """
    tag_folder = folder.path
    listed = {record.path for record in manifest.files}
    if len(listed) != len(manifest.files):
        raise CheckpointFormatError(f"checkpoint {tag_folder}: its manifest lists a file twice; it was edited")
    model_files = [name for name in folder.names() if name.endswith("model_states.pt")]
    required = [os.path.join(SUBDIR, name) for name in (*manifest.shards, REPLICATED_NAME)] + model_files
    problems = [f"{path} is not listed in the manifest" for path in required if path not in listed]
    for record in manifest.files:
        check_relative_path(record.path, "manifest files[].path")
        try:
            size = folder.size(record.path)
        except CheckpointCorruptError:
            problems.append(f"{record.path} is missing")
            continue
        if size != record.size:
            problems.append(f"{record.path} has {size} bytes, the manifest records {record.size} (truncated or overwritten)")
    if problems:
        raise CheckpointCorruptError(
            f"checkpoint {tag_folder} is incomplete or damaged: {'; '.join(problems)}. Restore the files from a "
            f"copy or load an earlier tag."
        )
    shard_paths = {os.path.join(SUBDIR, name) for name in manifest.shards}
    shard_bytes = sum(record.size for record in manifest.files if record.path in shard_paths)
    module_bytes = sum(record.size for record in manifest.files if record.path == manifest.module_file)
    for where, held, per_element in (("its shards", shard_bytes, SHARD_BYTES),
                                     (manifest.module_file, module_bytes, MODULE_BYTES)):
        needed = sum(per_element[group.masters] * group.numel for group in manifest.groups)
        if needed > held:
            raise CheckpointFormatError(
                f"checkpoint {tag_folder}: its manifest records {sum(g.numel for g in manifest.groups)} elements "
                f"(groups[*].numel), whose fp32 master weights alone need {needed} bytes in {where}, but it holds "
                f"{held} bytes; the manifest was edited or not written by zero_bnb"
            )


def verify_checksums(
    folder: PinnedFolder, manifest: Manifest, rank: int = 0, world_size: int = 1, *, progress: bool = False
) -> int:
    """Compare the digest of this rank's share of the pinned files (see :func:`checksum_shares`) with the manifest, in
    each record's algorithm.

    Returns:
        The number of bytes read.

    Raises:
        CheckpointCorruptError: names every file whose content differs from what was saved.
        CheckpointFormatError: a file records BLAKE3, and the ``blake3`` package is not installed (before any read).
    """
    problems, read = [], 0
    mine = checksum_shares(manifest.files, world_size)[rank]
    total = sum(manifest.files[index].size for index in mine)
    for algorithm in {manifest.files[index].algorithm for index in mine}:
        digests.new(algorithm, what=f"checkpoint {folder.path}")  # a missing package is named before any read
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
        for index in mine:
            record = manifest.files[index]
            size, digest = folder.digest(record.path, record.algorithm)
            read += size
            bar.update(size)
            if (size, digest) != (record.size, record.digest):
                problems.append(
                    f"{record.path} ({record.algorithm} {digest[:16]}..., {size} bytes; saved as "
                    f"{record.digest[:16]}..., {record.size} bytes)"
                )
    if problems:
        raise CheckpointCorruptError(
            f"checkpoint {folder.path} holds damaged files whose content differs from what was saved: "
            f"{'; '.join(problems)}. Restore them from a copy or load an earlier tag."
        )
    return read
