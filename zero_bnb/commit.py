"""Atomic checkpoint commit: a tag folder becomes visible only when every rank's files are durable.

A save of tag ``T`` into ``save_dir`` goes through three states:

1. **staging** — every rank writes into ``save_dir/.T.zero_bnb-staging`` (hidden; a stale one
   from a crashed save is removed first). Files are fsynced as they are closed.
2. **agreement** — all ranks report their files (size, SHA-256) or their error to every
   rank. If any rank failed, the staging folder is removed and every rank raises
   :class:`~zero_bnb.errors.CheckpointSaveError`; the previous checkpoint is untouched.
3. **publish** (rank 0) — write the manifest (with every file's checksum) last, fsync the
   folders, rename the staging folder to ``save_dir/T`` (an existing ``T`` is first moved
   aside to ``.T.zero_bnb-replaced`` and removed after), then replace ``latest`` atomically.

Killing any process at any moment therefore leaves either the previous checkpoint with its
``latest``, or the new one complete. The one window in which ``save_dir/T`` is absent
(between the two renames when ``T`` is re-saved) is covered by :func:`resolve_tag`, which
then returns the complete previous folder.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from zero_bnb.checkpoint_format import MANIFEST_NAME, SUBDIR, Manifest, write_manifest
from zero_bnb.collective import raise_reported
from zero_bnb.durable import (
    FileRecord,
    fsync_dir,
    makedirs,
    publish_folder,
    remove_tree,
    replace_text,
)
from zero_bnb.errors import CheckpointFormatError

__all__ = [
    "LATEST_NAME",
    "SaveTransaction",
    "aside_tag",
    "check_tag",
    "prepare_staging",
    "publish",
    "resolve_tag",
    "staging_tag",
]

logger = logging.getLogger(__name__)

LATEST_NAME = "latest"
_STAGING_SUFFIX = ".zero_bnb-staging"
_ASIDE_SUFFIX = ".zero_bnb-replaced"


def staging_tag(tag: str) -> str:
    """Name of the hidden folder a save of ``tag`` writes into before it is published."""
    return f".{tag}{_STAGING_SUFFIX}"


def aside_tag(tag: str) -> str:
    """Name the previous folder of ``tag`` takes while a re-save of ``tag`` is published."""
    return f".{tag}{_ASIDE_SUFFIX}"


def check_tag(tag: str) -> str:
    """Return ``tag`` if it can name a checkpoint folder, else raise ``CheckpointFormatError``."""
    if not tag or tag != tag.strip() or "/" in tag or os.sep in tag or tag.startswith(".") or not tag.isprintable():
        raise CheckpointFormatError(
            f"checkpoint tag {tag!r} cannot name a folder: use a non-empty printable name without path "
            f"separators, surrounding spaces or a leading dot, for example 'global_step100'"
        )
    return tag


def prepare_staging(save_dir: str, tag: str) -> str:
    """Create ``save_dir`` if needed and remove a stale staging folder of ``tag``; returns the staging folder.

    Local: one process (rank 0, or an offline tool) calls it.
    """
    staging = os.path.join(save_dir, staging_tag(check_tag(tag)))
    makedirs(save_dir)
    remove_tree(staging)
    return staging


def publish(save_dir: str, tag: str, *, latest_name: str | None = LATEST_NAME) -> str:
    """Make the finished staging folder of ``tag`` visible as ``save_dir/tag``, then point ``latest_name`` at it.

    Local: one process calls it, after every file of the staging folder is durable.
    ``latest_name=None`` leaves the pointer file alone. Returns the published folder.
    """
    staging = os.path.join(save_dir, staging_tag(tag))
    for folder in [os.path.join(root, name) for root, names, _ in os.walk(staging) for name in names] + [staging]:
        fsync_dir(folder)
    final = os.path.join(save_dir, tag)
    publish_folder(staging, final, os.path.join(save_dir, aside_tag(tag)))
    if latest_name is not None:
        replace_text(tag, os.path.join(save_dir, latest_name))
    return final


class SaveTransaction:
    """One checkpoint save, from staging to publication (see the module docstring).

    Collective: every rank of the world group must create it and call :meth:`begin` and
    :meth:`commit` in the same order. Between the two, each rank writes into
    :attr:`staging_folder`, adding its files with :meth:`add` and wrapping each write phase
    in :meth:`guard`, which records an error instead of raising it (so that no rank leaves
    the collective protocol early).
    """

    def __init__(self, save_dir: str, tag: str) -> None:
        self.save_dir = save_dir
        self.tag = check_tag(tag)
        self.staging_tag = staging_tag(tag)
        self.staging_folder = os.path.join(save_dir, self.staging_tag)
        self.files: list[FileRecord] = []
        self.errors: list[str] = []

    def begin(self) -> None:
        """Clear any stale staging folder (rank 0). Collective."""
        if dist.get_rank() == 0:
            with self.guard():
                prepare_staging(self.save_dir, self.tag)
        dist.barrier()

    def add(self, records: list[FileRecord]) -> None:
        self.files.extend(records)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Record an exception raised inside the block (it is re-raised on every rank by :meth:`commit`)."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - reported collectively by commit()
            logger.error("zero_bnb: saving checkpoint %r failed on rank %d: %r", self.tag, dist.get_rank(), error)
            self.errors.append(f"{type(error).__name__}: {error}")

    def commit(self, build_manifest: Callable[[list[FileRecord]], Manifest], *, save_latest: bool) -> None:
        """Agree on success, then publish on rank 0. Collective.

        Raises:
            CheckpointSaveError: on every rank, if any rank failed to write or rank 0 failed to
                publish; the previous checkpoint and ``latest`` are then unchanged.
        """
        local = (self.files, "; ".join(self.errors) or None)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        failures = [None if error is None else ("CheckpointSaveError", error) for _, error in gathered]
        outcome: list[Any] = [None]
        if dist.get_rank() == 0:
            if any(failures):
                self._discard()
            else:
                files = [record for records, _ in gathered for record in records]
                try:
                    self._publish(build_manifest(files), save_latest)
                except Exception as error:  # noqa: BLE001 - reported to every rank below
                    logger.error("zero_bnb: publishing checkpoint %r failed: %r", self.tag, error)
                    self._discard()
                    outcome = [("CheckpointSaveError", f"rank 0 could not publish it: {type(error).__name__}: {error}")]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            failures = [outcome[0]] + [None] * (len(failures) - 1)
        raise_reported(
            failures,
            prefix=f"saving checkpoint {self.tag!r} to {self.save_dir} failed; the previous checkpoint and "
            f"'latest' are unchanged. Fix the cause (disk space, permissions) and save again. Cause: ",
        )

    def _discard(self) -> None:
        try:
            remove_tree(self.staging_folder)
        except OSError as error:
            logger.error("zero_bnb: could not remove the unfinished %s: %r", self.staging_folder, error)

    def _publish(self, manifest: Manifest, save_latest: bool) -> None:
        write_manifest(manifest, os.path.join(self.staging_folder, SUBDIR), root=self.staging_folder)
        publish(self.save_dir, self.tag, latest_name=LATEST_NAME if save_latest else None)
        logger.info(
            "zero_bnb: checkpoint %s committed (%d files, DP=%d)",
            os.path.join(self.save_dir, self.tag), len(manifest.files) + 1, manifest.dp_world_size,
        )


def _tags_in(load_dir: str) -> list[str]:
    try:
        return sorted(name for name in os.listdir(load_dir)
                      if not name.startswith(".") and os.path.isdir(os.path.join(load_dir, name)))
    except OSError:
        return []


def resolve_tag(load_dir: str, tag: str | None, *, latest_name: str = LATEST_NAME) -> str | None:
    """The folder name under ``load_dir`` to load for ``tag`` (``None``: the one ``latest_name`` names).

    Local; reads only names, no file content beyond the pointer file (``latest``, or
    ``latest_universal`` for DeepSpeed universal checkpoints). Returns ``None`` when ``tag`` is
    ``None`` and there is no pointer file (DeepSpeed then loads nothing and warns).

    Raises:
        CheckpointFormatError: ``latest`` is damaged or names a missing folder, or ``tag`` does
            not exist; the message lists the tags present.
    """
    source = "the tag argument"
    if tag is None:
        latest = os.path.join(load_dir, latest_name)
        if not os.path.isfile(latest):
            return None
        with open(latest, "rb") as handle:
            raw = handle.read()
        try:
            tag = check_tag(raw.decode("utf-8").strip())
        except (UnicodeDecodeError, CheckpointFormatError) as error:
            raise CheckpointFormatError(
                f"{latest} is damaged: it holds {raw[:80]!r}, not a checkpoint tag; pass tag= explicitly "
                f"(tags in {load_dir}: {_tags_in(load_dir)})"
            ) from error
        source = f"{latest}"
    tag = str(tag)
    if os.path.isdir(os.path.join(load_dir, tag)):
        return tag
    aside = aside_tag(tag)
    if os.path.isfile(os.path.join(load_dir, aside, SUBDIR, MANIFEST_NAME)):
        logger.warning(
            "zero_bnb: %s is missing but its previous version %s is complete (a save of the same tag was "
            "interrupted); loading that", os.path.join(load_dir, tag), os.path.join(load_dir, aside)
        )
        return aside
    raise CheckpointFormatError(
        f"checkpoint folder {os.path.join(load_dir, tag)} (tag {tag!r} from {source}) does not exist; "
        f"tags in {load_dir}: {_tags_in(load_dir)}"
    )
