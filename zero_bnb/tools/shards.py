"""A state dict split into files of at most ``max_shard_size`` bytes, named and indexed as Hugging Face does.

DeepSpeed's ``zero_to_fp32`` (0.19) shards its output with huggingface_hub's ``split_torch_state_dict_into_shards``
(default ``max_shard_size="5GB"``): ``pytorch_model-00001-of-00003.bin`` ... (``model-...safetensors``) and an index,
``pytorch_model.bin.index.json`` (``model.safetensors.index.json``), mapping each name to its file, which
``from_pretrained`` reads; a state that fits in one file keeps the single name and gets no index. :func:`plan_shards`
is that split without the dependency: tensors in the state's order, a new file when the next one would pass the
limit, a tensor larger than the limit alone in its file, names sharing one tensor (tied weights) counted once and
kept in the first one's file.

Local, no collectives.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import uuid
from dataclasses import dataclass

import torch

from zero_bnb.errors import CheckpointSaveError, CheckpointUsageError
from zero_bnb.format.durable import fsync_dir, makedirs
from zero_bnb.format.publish import note_published
from zero_bnb.format.lock import SaveFolderLock
from zero_bnb.format.ownership import OutputRecord
from zero_bnb.tools.outputs import replacing_file
from zero_bnb.tools.views import write_state_dict

__all__ = ["ShardPlan", "parse_shard_size", "plan_shards", "write_shards"]

logger = logging.getLogger(__name__)

#: Files ``from_pretrained`` reads before a weights name's own file and index (safetensors first).
_READ_FIRST = {"pytorch_model.bin": ("model.safetensors", "model.safetensors.index.json")}

#: The prefix of a new output's files before they are put in place (hidden).
_HIDDEN = ".zero_bnb-new-"

#: The units huggingface_hub's ``parse_size_to_int`` reads (powers of 1000).
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_shard_size(size: int | str) -> int:
    """``max_shard_size`` in bytes: a positive int, or a number and a unit (``"5GB"``, ``"500MB"``).

    Raises:
        CheckpointUsageError: anything else (named, with the forms that work).
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)\s*", size, re.IGNORECASE) if isinstance(size, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise CheckpointUsageError(f"max_shard_size={size!r} is not a size; give a number of bytes or a number and a "
                                   f"unit, such as '5GB' or '500MB' ({', '.join(SIZE_UNITS)})")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which names go to which file; ``files`` in writing order, each file's names in the state's order."""

    files: dict[str, list[str]]
    total_size: int

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    def index(self) -> dict:
        """The index file's contents: ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``."""
        return {"metadata": {"total_size": self.total_size},
                "weight_map": {name: file for file, names in self.files.items() for name in names}}


def _tensor_key(tensor: torch.Tensor) -> tuple:
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype


def plan_shards(state: dict[str, torch.Tensor], weights_name: str, max_shard_size: int | str | None) -> ShardPlan:
    """Split ``state`` (bytes: each tensor's elements in its dtype) into files named after ``weights_name``
    (``pytorch_model.bin`` or ``model.safetensors``): ``<stem>-00001-of-0000N<suffix>``, or ``weights_name`` alone
    when everything fits in one file (always, for ``max_shard_size=None``).

    Raises:
        CheckpointUsageError: ``max_shard_size`` is not a size.
    """
    limit = None if max_shard_size is None else parse_shard_size(max_shard_size)
    first_of: dict[tuple, str] = {}  # a tensor -> the first name it was seen under
    tied: dict[str, list[str]] = {}
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    for name, tensor in state.items():
        key = _tensor_key(tensor)
        if key in first_of:
            tied[first_of[key]].append(name)
            continue
        first_of[key], tied[name] = name, []
        size = tensor.numel() * tensor.element_size()
        total += size
        if limit is not None and size > limit:
            shards.append([name])
            continue
        if limit is not None and current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:  # an empty state: one empty file, as before
        shards.append(current)
    stem, suffix = os.path.splitext(weights_name)
    names = [weights_name] if len(shards) == 1 else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{suffix}"
                                                     for i in range(len(shards))]
    return ShardPlan({file: [n for name in shard for n in (name, *tied[name])] for file, shard in zip(names, shards)},
                     total)


def write_shards(state: dict[str, torch.Tensor], output_dir: str, weights_name: str,
                 max_shard_size: int | str | None, *, metadata: dict[str, str] | None = None) -> tuple[str, ShardPlan]:
    """Write ``state`` into ``output_dir`` as :func:`plan_shards` splits it, replacing only what zero_bnb wrote there.

    One writer at a time holds the folder's lock (a second job is refused, naming the holder). Every name this
    output writes or leaves behind (its single file, index and shards of any split) must be absent or an earlier
    zero_bnb output's, by the folder's record (:class:`~zero_bnb.format.ownership.OutputRecord`); another
    model's weights there are refused before anything is written. The new files are written under hidden names
    first; only when all are complete is the old index removed, each file renamed into place, the new index last
    (so no index ever names a mix of two outputs), then the earlier output's files this one does not use are
    removed. Returns the index's path (the file's when not sharded) and the plan.

    Raises:
        CheckpointUsageError: ``max_shard_size`` is not a size, or the folder holds files at these names that
            zero_bnb did not write (named, with the fix); nothing was written.
        CheckpointSaveError: another job holds the folder's lock; or a write failed or was interrupted: before the
            renames the previous output is unchanged and nothing new is left, during them the message says the
            output is incomplete; or an earlier file could not be removed (named).
    """
    plan = plan_shards(state, weights_name, max_shard_size)
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise CheckpointUsageError(
            f"the output folder {output_dir} is a file: zero_to_fp32 writes {weights_name} (or its shards) into a "
            f"folder since DeepSpeed 0.14 (python zero_to_fp32.py . OUTPUT_DIR); give a folder. Nothing was written"
        )
    makedirs(output_dir)
    with SaveFolderLock(output_dir, f"writing {weights_name}"):
        record = OutputRecord(output_dir)
        index_name = f"{weights_name}.index.json"
        targets = list(plan.files) + ([index_name] if plan.sharded else [])
        stale = _earlier_outputs(output_dir, weights_name, set(targets))
        strangers = [name for name in targets + stale
                     if os.path.lexists(os.path.join(output_dir, name)) and not record.owns(name)]
        if strangers:
            raise CheckpointUsageError(
                f"{output_dir} holds {', '.join(strangers)}, which zero_bnb did not write there (another model's "
                f"weights?): writing {weights_name} would replace or remove them. Nothing was written. Write into "
                f"another folder, or move those files away yourself"
            )
        fresh = _write_hidden(state, output_dir, plan, index_name, metadata)
        try:
            stamps = {name: record.note(name, temporary) for name, temporary in fresh.items()}
            record.save()  # before anything is in place: a crash after it still leaves only files it proves
        except BaseException as error:
            _discard(fresh)
            if not isinstance(error, Exception):
                raise  # an interrupt: nothing was put in place, and the command says so
            raise CheckpointSaveError(
                f"could not record the new {weights_name} output in {output_dir} ({type(error).__name__}: {error}); "
                f"nothing was written: the previous output there is unchanged. Free space (or fix permissions) and "
                f"run it again"
            ) from error
        try:
            _put_in_place(output_dir, fresh, index_name if plan.sharded else None)
        except BaseException as error:
            _discard(fresh)
            raise CheckpointSaveError(
                f"writing {weights_name} into {output_dir} was interrupted while its files were put in place "
                f"({type(error).__name__}: {error}); the output there is incomplete (no index names a mix of two "
                f"outputs): run the export again"
            ) from error
        _remove_earlier(output_dir, weights_name, stale, record, stamps)
    shadowing = [name for name in _READ_FIRST.get(weights_name, ()) if os.path.lexists(os.path.join(output_dir, name))]
    if shadowing:
        logger.warning("zero_bnb: %s also holds %s, which from_pretrained reads before %s: remove it if an earlier "
                       "run left it (rm %s)", output_dir, " and ".join(shadowing), weights_name,
                       " ".join(repr(os.path.join(output_dir, name)) for name in shadowing))
    index = os.path.join(output_dir, index_name)
    return (index if plan.sharded else os.path.join(output_dir, weights_name)), plan


def _earlier_outputs(output_dir: str, weights_name: str, targets: set[str]) -> list[str]:
    """Names an earlier output of ``weights_name`` may have left that this one does not write: its single file
    (``from_pretrained`` reads it before an index: it would load the old weights), its index, shards of any split.
    Files and links only: a folder is nobody's output."""
    stem, suffix = os.path.splitext(weights_name)
    shard = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}{re.escape(suffix)}")
    return sorted(name for name in os.listdir(output_dir) if name not in targets and (
        name in (weights_name, f"{weights_name}.index.json") or shard.fullmatch(name))
        and not os.path.isdir(os.path.join(output_dir, name)))


def _write_hidden(state: dict[str, torch.Tensor], output_dir: str, plan: ShardPlan, index_name: str,
                  metadata: dict[str, str] | None) -> dict[str, str]:
    """Every file of ``plan`` (and its index) written complete under a hidden name in ``output_dir``: ``{name: path}``.

    Raises:
        CheckpointSaveError: a write failed or was interrupted; what was written is removed, the previous output
            is unchanged.
    """
    token = uuid.uuid4().hex[:12]
    fresh: dict[str, str] = {}
    try:
        for file, names in plan.files.items():
            # A tensor that is a view of a larger one would take the whole storage into its torch.save file.
            part = {name: state[name] for name in names}
            if plan.sharded:
                copies: dict[tuple, torch.Tensor] = {}
                part = {name: copies.setdefault(_tensor_key(value), value.clone()) for name, value in part.items()}
            fresh[file] = os.path.join(output_dir, f"{_HIDDEN}{token}-{file}")
            write_state_dict(part, fresh[file], metadata=metadata)
        if plan.sharded:
            fresh[index_name] = os.path.join(output_dir, f"{_HIDDEN}{token}-{index_name}")
            with replacing_file(fresh[index_name]) as temporary, open(temporary, "w", encoding="utf-8") as handle:
                json.dump(plan.index(), handle, indent=2, sort_keys=True)
                handle.write("\n")
    except BaseException as error:
        _discard(fresh)
        if isinstance(error, CheckpointSaveError):
            failed = next(reversed(fresh))  # named before its write began
            cause = error.__cause__ if error.__cause__ is not None else error
            text = " ".join(str(cause).split())
            raise CheckpointSaveError(
                f"could not write {os.path.join(output_dir, failed)} ({type(cause).__name__}: {text:.300}); nothing "
                f"was written: the previous output in {output_dir} is unchanged. Free space (or fix permissions) and "
                f"run it again"
            ) from cause
        raise
    return fresh


def _discard(fresh: dict[str, str]) -> None:
    """Remove the hidden files of a new output that were not put in place."""
    for temporary in fresh.values():
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def _put_in_place(output_dir: str, fresh: dict[str, str], index_name: str | None) -> None:
    """Rename the hidden files to their names: the old index goes first and the new one comes last, so that no index
    names files of two outputs."""
    if index_name is not None and os.path.lexists(os.path.join(output_dir, index_name)):
        os.unlink(os.path.join(output_dir, index_name))
    for name, temporary in fresh.items():
        if name != index_name:
            os.replace(temporary, os.path.join(output_dir, name))
    if index_name is not None:
        os.replace(fresh[index_name], os.path.join(output_dir, index_name))
    fsync_dir(output_dir)
    note_published(os.path.join(output_dir, index_name or next(iter(fresh))))


def _remove_earlier(output_dir: str, weights_name: str, stale: list[str], record: OutputRecord,
                    in_place: dict) -> None:
    """Remove the earlier output's files this one does not use (each proven zero_bnb's just before), then record
    the output as it now is.

    Raises:
        CheckpointSaveError: one could not be removed (named, with the command); the new files are in place.
    """
    for name in stale:
        path = os.path.join(output_dir, name)
        if not record.owns(name):  # changed since the check: keep it
            continue
        try:
            os.unlink(path)
        except OSError as error:
            raise CheckpointSaveError(
                f"wrote the new {weights_name} output in {output_dir}, but could not remove {path}, which an earlier "
                f"output left ({type(error).__name__}: {error}); from_pretrained could read it instead of the new "
                f"files: remove it (rm -f {path!r})"
            ) from error
    record.settle(in_place)
    record.save()
