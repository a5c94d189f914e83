"""Where an offline tool may write, and how: never over its input, never over an existing output unasked,
atomically, and with one truthful line when the disk is full.

The checkpoint tools (:mod:`zero_bnb.tools.convert`, :mod:`zero_bnb.tools.views`) call the checks before
they read more than the input's location, so a mistyped output path costs nothing; weights files
are written through :func:`replacing_file`. Local, single-process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from zero_bnb.errors import CheckpointSaveError, CheckpointUsageError
from zero_bnb.format.publish import PublishedNotDurableError, replacing
from zero_bnb.format.lock import LOCK_NAME
from zero_bnb.format.ownership import CHECKPOINT_MARKERS
from zero_bnb.format.paths import RESERVED_TAGS, inside, overlaps, resolved

__all__ = ["check_output_file", "check_output_folder", "check_output_parents", "replacing_file"]


def _blocking_component(path: str) -> str | None:
    """The nearest existing path component of ``path`` (``path`` itself, or a folder above it) when it is not a folder
    (a file, a link to none, a FIFO): where creating ``path`` or a folder above it fails; ``None`` otherwise."""
    current = os.path.normpath(path)
    while current and not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:  # the root
            return None
        current = parent
    return current if current and not os.path.isdir(current) else None


def _kind(path: str) -> str:
    if os.path.islink(path):
        return "a link to something that is no folder"
    return "a file" if os.path.isfile(path) else "not a folder"


def check_output_parents(path: str, *, folder: bool = False) -> None:
    """Refuse an output ``path`` that cannot be created because a path component above it (or, with ``folder``,
    ``path`` itself: an output folder) is an existing file, before anything is read or written.

    Raises:
        CheckpointUsageError: names the component, what it is, and the fix.
    """
    blocking = _blocking_component(path if folder else os.path.dirname(os.path.normpath(path)))
    if blocking is not None:
        what = "the output folder" if folder and os.path.normpath(blocking) == os.path.normpath(path) else \
            "a folder on the output's path"
        raise CheckpointUsageError(
            f"the output {path} cannot be created: {blocking} is {_kind(blocking)}, but it would have to be "
            f"{what}. Choose another output path (or move {blocking} away); nothing was written"
        )


def check_output_folder(target: str, *, source_tag_folder: str, force: bool) -> None:
    """Refuse to write the checkpoint folder ``target`` over, inside or around the input checkpoint,
    or over an existing folder unless ``force``.

    Args:
        target: the tag folder the tool will publish. It may sit beside the input in the same
            save folder (a migration written as a new tag there, which the pointer file then
            names; the input's own folder is never touched).
        source_tag_folder: the input checkpoint's tag folder.
        force: replace an existing ``target``.

    Raises:
        CheckpointUsageError: names both paths and the fix.
    """
    check_output_parents(target)
    if overlaps(target, source_tag_folder):
        raise CheckpointUsageError(
            f"the output {target} overlaps the checkpoint being read ({source_tag_folder}): writing it would "
            f"replace or mix with the input. Write into another folder"
        )
    if os.path.lexists(target) and not force:
        raise CheckpointUsageError(
            f"the output {target} already exists; pass --force (force=True) to replace it (the old one is kept "
            f"until the new one is complete), or choose another output"
        )
    if os.path.lexists(target) and (os.path.islink(target) or not any(
            os.path.isfile(os.path.join(target, marker)) for marker in CHECKPOINT_MARKERS)):
        raise CheckpointUsageError(
            f"the output {target} exists and is not a checkpoint folder (it holds none of "
            f"{list(CHECKPOINT_MARKERS)}); --force replaces only checkpoints. Choose another output"
        )


def check_output_file(path: str, *, source_tag_folder: str, source_save_dir: str, force: bool) -> None:
    """Refuse to write the file ``path`` inside the input checkpoint, over a pointer file or a folder,
    or over an existing file unless ``force``.

    Raises:
        CheckpointUsageError: names the path and the fix.
    """
    name = os.path.basename(path)
    if not name or path.endswith(("/", os.sep)) or name in (".", ".."):
        raise CheckpointUsageError(f"the output {path!r} names no file; give the file to write, e.g. model.safetensors")
    if inside(path, source_tag_folder) or (
            resolved(os.path.dirname(os.path.abspath(path))) == resolved(source_save_dir)
            and (name in RESERVED_TAGS or name == LOCK_NAME or name.startswith("."))):
        raise CheckpointUsageError(
            f"the output {path} is part of the checkpoint being read ({source_tag_folder}) or a name zero_bnb "
            f"reserves in its save folder; write it elsewhere"
        )
    check_output_parents(path)
    if os.path.isdir(path):
        raise CheckpointUsageError(f"the output {path} is a folder; name the file to write, e.g. "
                                   f"{os.path.join(path, 'model.safetensors')}")
    if os.path.lexists(path) and not force:
        raise CheckpointUsageError(f"the output {path} already exists; pass --force (force=True) to replace it, or "
                                   f"choose another file")


@contextmanager
def replacing_file(path: str) -> Iterator[str]:
    """Yield a path to write; once the block succeeds, that file atomically replaces ``path``.

    The file is written in a fresh private folder beside ``path`` and renamed over it
    (:func:`zero_bnb.format.publish.replacing`): a link planted at ``path`` is replaced, never
    followed; missing folders above ``path`` are created.

    Raises:
        CheckpointSaveError: the write failed (a full disk, say: ``OSError``, safetensors'
            ``SafetensorError``, ``torch.save``'s ``RuntimeError``); ``path`` is unchanged and
            nothing temporary is left. Or the new file was renamed into place but syncing its folder
            failed: then the message says that ``path`` is the new file, whose durability is unconfirmed.
            One line, naming the cause.
    """
    from safetensors import SafetensorError

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # A hidden file is a step of a larger output, not one: not noted as published.
        with replacing(path, note=not os.path.basename(path).startswith(".")) as temporary:
            yield temporary
    except PublishedNotDurableError as error:
        raise CheckpointSaveError(
            f"wrote {path}: the new file is in place and complete, but syncing the folder that names it failed "
            f"({type(error.__cause__).__name__}: {' '.join(str(error.__cause__).split()):.300}), so a power failure "
            f"or crash of the machine may still bring back the previous one. Run `sync` (or the command again) once "
            f"the disk is healthy"
        ) from error
    except (OSError, SafetensorError, RuntimeError) as error:
        cause = " ".join(str(error).split())
        raise CheckpointSaveError(
            f"could not write {path} ({type(error).__name__}: {cause:.300}); nothing was written: "
            f"{'the previous file is unchanged' if os.path.lexists(path) else 'no file was created'}. "
            f"Free space (or fix permissions) and run it again"
        ) from error
