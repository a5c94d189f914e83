"""Finding checkpoints on disk: save folders, tag folders, pointer files and their kind.

Local, single-process helpers of the checkpoint tools (:mod:`zero_bnb.tools.convert`, the CLI).
"""

from __future__ import annotations

import glob
import os
import re

from zero_bnb.errors import CheckpointFormatError, CheckpointUsageError
from zero_bnb.format.manifest import MANIFEST_NAME, SUBDIR
from zero_bnb.format.paths import check_tag
from zero_bnb.format.progress import FolderStatus, folder_status
from zero_bnb.format.reader import CheckpointReader, verify_checkpoint
from zero_bnb.format.stock_files import UNIVERSAL_STATE, zero_file_names
from zero_bnb.format.tags import LATEST_NAME, UNIVERSAL_LATEST, resolve_tag

__all__ = ["UNIVERSAL_LATEST", "detect", "locate", "newest_in", "open_verified", "require_zero_bnb", "verify_target"]



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
    """What to pass instead of ``path``: the newest complete checkpoint folder in it (a front door's output folder),
    or a tag."""
    newest, _ = newest_in(path)
    if newest is not None:
        return (f"it holds checkpoint folders: pass one of them, for example its newest complete one, {newest} (or "
                f"its tag folder {os.path.join(newest, folder_status(newest).tag or '')})")
    tags = [name for name in sorted(os.listdir(path)) if os.path.isdir(os.path.join(path, name))
            and os.path.isfile(os.path.join(path, name, SUBDIR, MANIFEST_NAME))]
    return f"pass one of its tag folders ({', '.join(tags[:5])}) or --tag" if tags else \
        "pass a save folder (with 'latest') or a tag folder"


def _save_folders(path: str) -> list[FolderStatus]:
    """The save folders directly in ``path`` (a front door's output folder: Trainer's ``out``, Accelerate's
    ``checkpoints``, Lightning's checkpoint directory): folders with a ``latest``, or with zero_bnb's records of a
    save."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    statuses = []
    for name in names:
        child = os.path.join(path, name)
        if not name.startswith(".") and os.path.isdir(child) and not os.path.islink(child):
            status = folder_status(child)
            if status.tag is not None or status.unfinished() or os.path.isfile(os.path.join(child, LATEST_NAME)):
                statuses.append(status)
    return statuses


def newest_in(path: str) -> tuple[str | None, list[FolderStatus]]:
    """The newest complete save folder directly in ``path`` (not interrupted; newest by the number in its name, as the
    front doors order them, or committed last) and the interrupted ones beside it. Local, read-only."""
    statuses = _save_folders(path)
    complete = [status for status in statuses if not status.interrupted and status.tag is not None]
    numbers = [re.findall(r"[0-9]+", os.path.basename(status.path)) for status in complete]
    if complete and all(numbers):  # Trainer's checkpoint-N, Accelerate's checkpoint_N: newest as they order them
        newest = max(zip(complete, numbers), key=lambda pair: int(pair[1][-1]))[0]
    else:  # as committed (Lightning's checkpoint folders)
        newest = max(complete, key=lambda status: status.committed_at or 0.0, default=None)
    return (newest.path if newest else None), [status for status in statuses if status.interrupted]


def verify_target(path: str, tag: str | None) -> tuple[str, list[str]]:
    """The checkpoint ``zero-bnb verify path`` checks, and notes to print first: a front door's output folder gives
    its newest complete checkpoint (and lists the interrupted saves in it), a save folder its ``latest`` (and lists
    saves into it that did not finish).

    Raises:
        CheckpointFormatError: ``path`` holds an interrupted save, or an output folder holds only interrupted saves;
            the message names the newest complete checkpoint beside it, if any.
    """
    if tag is not None or not os.path.isdir(path):
        return path, []
    status = folder_status(path)
    if status.interrupted:
        newest, _ = newest_in(os.path.dirname(os.path.abspath(path)))
        raise CheckpointFormatError(
            f"{path} holds an interrupted save, not a checkpoint: {status.describe()}. "
            + (f"The newest complete checkpoint beside it is {newest}" if newest else
               "No complete checkpoint is beside it")
        )
    notes = [f"note: unfinished save: {save.describe()}" for save in status.unfinished()]
    if status.tag is not None or os.path.isfile(os.path.join(path, LATEST_NAME)):
        return path, notes
    newest, interrupted = newest_in(path)
    notes = [f"note: interrupted save: {item.describe()}" for item in interrupted]
    if newest is not None:
        return newest, [f"{path} holds checkpoint folders; the newest complete one is {newest}", *notes]
    if interrupted:
        raise CheckpointFormatError(f"{path} holds no complete checkpoint, only interrupted saves: "
                                    + "; ".join(item.describe() for item in interrupted))
    return path, notes


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
