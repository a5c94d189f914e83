"""Path safety: names from users and from checkpoint files never leave their folder.

Tags, parameter names, state keys and file paths recorded in a manifest are all joined to a
folder before any I/O. Each is checked here first, so that a careless ``tag="latest"`` or a
crafted ``"../../etc/passwd"`` is refused with a clear error instead of reading, writing or
replacing something outside the checkpoint. Pure functions, no I/O except
:func:`resolved`/:func:`overlaps` (which resolve symlinks); any process may call them.
"""

from __future__ import annotations

import os

from zero_bnb.errors import CheckpointFormatError, CheckpointUsageError

__all__ = [
    "RESERVED_TAGS",
    "check_name",
    "check_relative_path",
    "check_tag",
    "inside",
    "overlaps",
    "resolved",
]

#: Names in a save folder that are pointer files, never tags (DeepSpeed's and the universal one).
RESERVED_TAGS = frozenset({"latest", "latest_universal"})  # format.tags' LATEST_NAME and UNIVERSAL_LATEST
_MAX_NAME = 4096


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return "it must be a non-empty string"
    if len(name) > _MAX_NAME:
        return f"it must be at most {_MAX_NAME} characters"
    if name in (".", ".."):
        return "it must not be '.' or '..'"
    if "/" in name or "\\" in name or (os.altsep and os.altsep in name):
        return "it must not contain a path separator"
    if not name.isprintable():
        return "it must hold printable characters only"
    return None


def check_name(name: object, what: str) -> str:
    """Return ``name`` if it can be one path component (a parameter name, a state key), else raise.

    Raises:
        CheckpointFormatError: names ``what``, the value and the rule broken.
    """
    problem = _name_problem(name)
    if problem is not None:
        raise CheckpointFormatError(f"{what}={name!r:.200} cannot name a file or folder: {problem}")
    return name  # type: ignore[return-value]


def check_relative_path(path: object, what: str) -> str:
    """Return ``path`` if it is a normalised relative path that stays inside its folder, else raise.

    Raises:
        CheckpointFormatError: absolute paths, ``..``, backslashes, empty or non-printable parts.
    """
    if not isinstance(path, str) or not path or os.path.isabs(path) or os.path.normpath(path) != path:
        raise CheckpointFormatError(
            f"{what}={path!r:.200} is not a normalised relative path inside the checkpoint folder"
        )
    for part in path.split("/"):
        problem = _name_problem(part)
        if problem is not None:
            raise CheckpointFormatError(f"{what}={path!r:.200} leaves the checkpoint folder or is malformed: "
                                        f"part {part!r:.100}: {problem}")
    return path


def check_tag(tag: object) -> str:
    """Return ``tag`` if it can name a checkpoint folder, else raise ``CheckpointUsageError``.

    Refused: empty or non-printable names, surrounding spaces, a leading dot (zero_bnb's hidden
    folders), path separators, ``..``, absolute paths, and the pointer-file names ``latest`` and
    ``latest_universal``.
    """
    problem = _name_problem(tag)
    if problem is None and tag != tag.strip():  # type: ignore[union-attr]
        problem = "it must not start or end with spaces"
    if problem is None and tag.startswith("."):  # type: ignore[union-attr]
        problem = "it must not start with a dot (zero_bnb's hidden folders do)"
    if problem is None and tag in RESERVED_TAGS:
        problem = f"{tag!r} is the name of the pointer file that names the newest tag"
    if problem is not None:
        raise CheckpointUsageError(
            f"checkpoint tag {tag!r:.200} cannot name a checkpoint folder: {problem}. Use a plain name such as "
            f"'global_step100'"
        )
    return tag  # type: ignore[return-value]


def resolved(path: str) -> str:
    """``path`` made absolute with every symlink resolved (the path need not exist)."""
    return os.path.realpath(os.path.abspath(path))


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies under it, after resolving symlinks."""
    path, root = resolved(path), resolved(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def overlaps(a: str, b: str) -> bool:
    """Whether one of the two paths is, or lies inside, the other (after resolving symlinks)."""
    return inside(a, b) or inside(b, a)
