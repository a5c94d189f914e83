"""Finding checkpoints on disk: save folders, tag folders, pointer files and their kind.

Local, single-process helpers of the checkpoint tools (:mod:`zero_bnb.tools.convert`, the CLI).
"""

from __future__ import annotations

import glob
import os

from zero_bnb.errors import CheckpointUsageError
from zero_bnb.format.manifest import MANIFEST_NAME, SUBDIR
from zero_bnb.format.paths import check_tag
from zero_bnb.format.reader import CheckpointReader, verify_checkpoint
from zero_bnb.format.stock_files import UNIVERSAL_STATE, zero_file_names
from zero_bnb.format.tags import LATEST_NAME, UNIVERSAL_LATEST, resolve_tag

__all__ = ["UNIVERSAL_LATEST", "detect", "locate", "open_verified", "require_zero_bnb"]



def locate(path: str, tag: str | None = None, *, latest: str = LATEST_NAME) -> tuple[str, str]:
    """``(save_dir, folder_tag)`` of the checkpoint at ``path`` (a save folder or a tag folder).

    Raises:
        CheckpointUsageError: ``path`` is not a folder, or neither a tag folder nor a save folder
            with a pointer file.
        CheckpointFormatError: the pointer file is damaged or names a missing tag.
    """
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise CheckpointUsageError(f"{path} is not a folder; pass a checkpoint save folder or one of its tag folders")
    # A tag folder holds no pointer file; a save folder may hold anything else (even a folder named zero_bnb).
    is_tag_folder = not os.path.isfile(os.path.join(path, latest)) and (
        os.path.isfile(os.path.join(path, SUBDIR, MANIFEST_NAME)) or glob.glob(
            os.path.join(glob.escape(path), "*model_states.pt")))
    if tag is None and is_tag_folder:
        absolute = os.path.abspath(path)
        return os.path.dirname(absolute), check_tag(os.path.basename(absolute))
    if tag is None and not os.path.isfile(os.path.join(path, latest)):
        raise CheckpointUsageError(f"{path} holds no '{latest}' file and is not a tag folder; {_suggest(path)}")
    return path, resolve_tag(path, tag, latest_name=latest)


def _suggest(path: str) -> str:
    """What to pass instead of ``path``: a Trainer output folder's newest ``checkpoint-N`` (a save folder), or a tag."""
    steps = sorted((int(name.removeprefix("checkpoint-")), name) for name in os.listdir(path)
                   if name.startswith("checkpoint-") and name.removeprefix("checkpoint-").isdigit())
    if steps:  # transformers' Trainer: OUTPUT_DIR/checkpoint-N/global_stepN
        step, name = steps[-1]
        return (f"it looks like a Trainer output folder: pass one of its checkpoints, for example "
                f"{os.path.join(path, name)} (or its tag folder {os.path.join(path, name, f'global_step{step}')})")
    return f"pass the tag folder (for example {os.path.join(path, 'global_step100')}) or --tag"


def detect(path: str, tag: str | None = None) -> str:
    """What the checkpoint at ``path`` is: ``"zero_bnb"``, ``"universal"`` or ``"stock"`` (DeepSpeed ZeRO).

    A save folder holding only ``latest_universal`` is universal; a tag folder is judged by its content.

    Raises:
        CheckpointUsageError: none of them.
    """
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, UNIVERSAL_LATEST)) and not os.path.isfile(os.path.join(path, LATEST_NAME)):
        save_dir, folder_tag = locate(path, tag, latest=UNIVERSAL_LATEST)
    else:
        save_dir, folder_tag = locate(path, tag)
    tag_folder = os.path.join(save_dir, folder_tag)
    if os.path.isfile(os.path.join(tag_folder, UNIVERSAL_STATE)):
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
    reader = verify_checkpoint(*locate(path, tag))  # verified, payloads opened
    return os.path.basename(reader.tag_folder), reader
