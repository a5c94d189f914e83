"""Finding checkpoints on disk: save folders, tag folders, pointer files and their kind.

Local, single-process helpers of the checkpoint tools (:mod:`zero_bnb.convert`, the CLI).
"""

from __future__ import annotations

import glob
import os

from zero_bnb.checkpoint_format import SUBDIR, ParamEntry
from zero_bnb.commit import resolve_tag
from zero_bnb.errors import CheckpointFormatError, CheckpointUsageError, malformed
from zero_bnb.load import CheckpointReader, verify_checkpoint
from zero_bnb.paths import check_name, check_tag
from zero_bnb.stock_import import zero_file_names
from zero_bnb.unpickle import check_checkpoint_file, safe_load

__all__ = ["MODEL_STATES", "UNIVERSAL_LATEST", "detect", "locate", "model_states_files", "open_verified",
           "param_entries", "require_zero_bnb"]

UNIVERSAL_LATEST = "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"


def locate(path: str, tag: str | None = None, *, latest: str = "latest") -> tuple[str, str]:
    """``(save_dir, folder_tag)`` of the checkpoint at ``path`` (a save folder or a tag folder).

    Raises:
        CheckpointUsageError: ``path`` is not a folder, or neither a tag folder nor a save folder
            with a pointer file.
        CheckpointFormatError: the pointer file is damaged or names a missing tag.
    """
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise CheckpointUsageError(f"{path} is not a folder; pass a checkpoint save folder or one of its tag folders")
    is_tag_folder = os.path.isdir(os.path.join(path, SUBDIR)) or glob.glob(
        os.path.join(glob.escape(path), "mp_rank_*_model_states.pt"))
    if tag is None and is_tag_folder:
        absolute = os.path.abspath(path)
        return os.path.dirname(absolute), check_tag(os.path.basename(absolute))
    if tag is None and not os.path.isfile(os.path.join(path, latest)):
        raise CheckpointUsageError(
            f"{path} holds no '{latest}' file and is not a tag folder; pass the tag folder (for example "
            f"{os.path.join(path, 'global_step100')}) or --tag"
        )
    return path, resolve_tag(path, tag, latest_name=latest)


def detect(path: str, tag: str | None = None) -> str:
    """What the checkpoint at ``path`` is: ``"zero_bnb"``, ``"universal"`` or ``"stock"`` (DeepSpeed ZeRO).

    A save folder holding only ``latest_universal`` is universal; a tag folder is judged by its content.

    Raises:
        CheckpointUsageError: none of them.
    """
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, UNIVERSAL_LATEST)) and not os.path.isfile(os.path.join(path, "latest")):
        save_dir, folder_tag = locate(path, tag, latest=UNIVERSAL_LATEST)
    else:
        save_dir, folder_tag = locate(path, tag)
    tag_folder = os.path.join(save_dir, folder_tag)
    if os.path.isfile(os.path.join(tag_folder, "zero", "optimizer_state.pt")):
        return "universal"
    if os.path.isdir(os.path.join(tag_folder, SUBDIR)):
        return "zero_bnb"
    if zero_file_names(tag_folder):
        return "stock"
    raise CheckpointUsageError(
        f"{tag_folder} is neither a zero_bnb, a DeepSpeed universal nor a stock DeepSpeed ZeRO checkpoint"
    )


def require_zero_bnb(path: str, tag: str | None, command: str) -> None:
    """Refuse a stock or universal checkpoint given to a command that reads zero_bnb checkpoints.

    Raises:
        CheckpointUsageError: names what ``path`` is and the command that reads it.
    """
    kind = detect(path, tag)
    if kind == "stock":
        raise CheckpointUsageError(
            f"{path} is a stock DeepSpeed checkpoint, not a zero_bnb one; {command} reads zero_bnb checkpoints. "
            f"Convert it first: zero-bnb convert {path} --to zero_bnb OUT"
        )
    if kind == "universal":
        raise CheckpointUsageError(
            f"{path} is a DeepSpeed universal checkpoint, not a zero_bnb one; {command} reads zero_bnb checkpoints. "
            f"Convert it first: zero-bnb convert {path} --to zero_bnb OUT (or load it in DeepSpeed with "
            f"checkpoint.load_universal: true)"
        )


def open_verified(path: str, tag: str | None, *, command: str = "this tool") -> tuple[str, CheckpointReader]:
    """``(folder_tag, reader)`` of the zero_bnb checkpoint at ``path``, every check passed, files opened.

    Raises:
        CheckpointUsageError: ``path`` is a stock or universal checkpoint (the message names
            the conversion).
        zero_bnb.errors.CheckpointError: any check failed.
    """
    require_zero_bnb(path, tag, command)
    reader = verify_checkpoint(*locate(path, tag))
    reader.preload()
    return os.path.basename(reader.tag_folder), reader


def model_states_files(tag_folder: str) -> dict[str, str]:
    """``{file name: path}`` of DeepSpeed's model-states file in ``tag_folder`` (exactly one is supported)."""
    files = sorted(glob.glob(os.path.join(glob.escape(tag_folder), "*model_states.pt")))
    if [os.path.basename(f) for f in files] != [MODEL_STATES]:
        raise CheckpointFormatError(
            f"{tag_folder} holds model-states files {[os.path.basename(f) for f in files]}; the tools handle one "
            f"{MODEL_STATES} (no tensor or pipeline parallelism)"
        )
    check_checkpoint_file(files[0], "DeepSpeed model file", tag_folder)  # it may be copied byte for byte
    return {MODEL_STATES: files[0]}


def param_entries(model_file: str) -> list[tuple[ParamEntry, ...]]:
    """Per flat group, its parameters with offsets, from DeepSpeed's ``param_shapes`` record."""
    model_states = safe_load(model_file, "DeepSpeed model file", deepspeed_classes=True)
    params = []
    with malformed(f"DeepSpeed model file {model_file}"):
        for g, group_shapes in enumerate(model_states["param_shapes"]):
            offset, entries = 0, []
            for name, shape in group_shapes.items():
                entry = ParamEntry(check_name(name, f"{model_file}: param_shapes[{g}] name"),
                                   tuple(int(size) for size in shape), offset)
                if any(size < 0 for size in entry.shape):
                    raise CheckpointFormatError(f"{model_file}: parameter {name!r} has shape {entry.shape}")
                entries.append(entry)
                offset += entry.numel
            params.append(tuple(entries))
    return params
