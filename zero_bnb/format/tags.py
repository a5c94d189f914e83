"""Tags and pointer files of a save folder: which tag folder ``latest`` (or an explicit tag) names.

Local, read-only: names and the pointer file, no checkpoint content. The save protocol
(:mod:`zero_bnb.checkpoint.commit`) writes what these functions read, under tags that
:func:`check_new_tag` accepts.
"""

from __future__ import annotations

import logging
import os

from zero_bnb.errors import CheckpointFormatError, CheckpointUsageError
from zero_bnb.format.manifest import MANIFEST_NAME, SUBDIR
from zero_bnb.format.paths import check_tag
from zero_bnb.format.stock_files import MODEL_STATES, UNIVERSAL_STATE

__all__ = ["INTERNAL_NAMES", "LATEST_NAME", "UNIVERSAL_LATEST", "aside_tag", "check_new_tag", "resolve_tag"]

logger = logging.getLogger(__name__)

LATEST_NAME = "latest"
#: DeepSpeed's pointer file for universal checkpoints.
UNIVERSAL_LATEST = "latest_universal"
_ASIDE_SUFFIX = ".zero_bnb-replaced"
#: Names zero_bnb and DeepSpeed give files and folders inside a save or tag folder. A tag folder of
#: one of these names would make the tools take the save folder for a tag folder (or collide with
#: the file), so no new checkpoint gets one.
INTERNAL_NAMES = frozenset({SUBDIR, MODEL_STATES, UNIVERSAL_STATE.split(os.sep)[0], "zero_to_fp32.py"})
#: DeepSpeed's per-rank file endings (``*_model_states.pt``, ``*_optim_states.pt``), matched the same way.
_INTERNAL_ENDINGS = ("model_states.pt", "optim_states.pt")


def check_new_tag(tag: object) -> str:
    """:func:`~zero_bnb.format.paths.check_tag`, and not a name zero_bnb or DeepSpeed uses inside a checkpoint.

    For tags of checkpoints about to be written (loads accept any safe tag, so older folders stay readable).

    Raises:
        CheckpointUsageError: names the tag and the names refused.
    """
    tag = check_tag(tag)
    if tag in INTERNAL_NAMES or tag.endswith(_INTERNAL_ENDINGS):
        raise CheckpointUsageError(
            f"checkpoint tag {tag!r} is a name used inside checkpoint folders ({sorted(INTERNAL_NAMES)}, "
            f"'*{_INTERNAL_ENDINGS[0]}', '*{_INTERNAL_ENDINGS[1]}'): the tools would take the save folder for a tag "
            f"folder. Nothing was written. Use a plain name such as 'global_step100'"
        )
    return tag


def aside_tag(tag: str) -> str:
    """Name the previous folder of ``tag`` takes while a re-save of ``tag`` is published."""
    return f".{tag}{_ASIDE_SUFFIX}"


def _tags_in(load_dir: str) -> list[str]:
    try:
        return sorted(name for name in os.listdir(load_dir)
                      if not name.startswith(".") and os.path.isdir(os.path.join(load_dir, name)))
    except OSError:
        return []


def resolve_tag(load_dir: str, tag: str | None, *, latest_name: str = LATEST_NAME, warn: bool = True) -> str | None:
    """The folder name under ``load_dir`` to load for ``tag`` (``None``: the one ``latest_name`` names).

    Local; reads only names, no file content beyond the pointer file (``latest``, or
    ``latest_universal`` for DeepSpeed universal checkpoints). Returns ``None`` when ``tag`` is
    ``None`` and there is no pointer file (DeepSpeed then loads nothing and warns). ``warn``: say (WARNING) when
    the previous version of a tag whose re-save was interrupted is what is found (a load); else at DEBUG.

    Raises:
        CheckpointUsageError: ``tag`` is unsafe or reserved (``latest``, ``../x``, an absolute path).
        CheckpointFormatError: ``latest`` is damaged or names a missing folder, or ``tag`` does
            not exist; the message lists the tags present.
    """
    source = "the tag argument"
    if tag is None:
        latest = os.path.join(load_dir, latest_name)
        if os.path.islink(latest):
            raise CheckpointFormatError(
                f"{latest} is a symbolic link; zero_bnb follows only a regular pointer file, as DeepSpeed writes it. "
                f"Replace it with a file holding the tag, or pass tag= (tags in {load_dir}: {_tags_in(load_dir)})"
            )
        if not os.path.isfile(latest):
            return None
        try:  # no link followed, no FIFO waited on, even if one replaced the file since the checks above
            descriptor = os.open(latest, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as error:
            raise CheckpointFormatError(f"{latest} cannot be read as a pointer file ({error}); pass tag= "
                                        f"(tags in {load_dir}: {_tags_in(load_dir)})") from error
        with os.fdopen(descriptor, "rb") as handle:
            raw = handle.read(4097)
        try:
            tag = check_tag(raw.decode("utf-8").strip())
        except (UnicodeDecodeError, CheckpointUsageError) as error:
            shown = "".join(c if c.isprintable() and c.isascii() else "?" for c in raw[:40].decode("latin-1"))
            raise CheckpointFormatError(
                f"{latest} is damaged: it holds {len(raw)} bytes starting {shown!r}, not a checkpoint tag; pass tag= "
                f"explicitly (tags in {load_dir}: {_tags_in(load_dir)})"
            ) from error
        source = f"{latest}"
    else:
        tag = check_tag(str(tag))
    if os.path.isdir(os.path.join(load_dir, tag)):
        return tag
    aside = aside_tag(tag)
    if os.path.isfile(os.path.join(load_dir, aside, SUBDIR, MANIFEST_NAME)):
        (logger.warning if warn else logger.debug)(
            "zero_bnb: %s is missing but its previous version %s is complete (a save of the same tag was "
            "interrupted); loading that", os.path.join(load_dir, tag), os.path.join(load_dir, aside)
        )
        return aside
    raise CheckpointFormatError(
        f"checkpoint folder {os.path.join(load_dir, tag)} (tag {tag!r} from {source}) does not exist; "
        f"tags in {load_dir}: {_tags_in(load_dir)}"
    )
