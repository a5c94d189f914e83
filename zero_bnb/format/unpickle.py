"""Read checkpoint files without executing code from them.

Every checkpoint file zero_bnb reads (its own shards and replicated file, DeepSpeed's model
file, stock DeepSpeed optimizer files, universal checkpoints) goes through :func:`safe_load`:
``torch.load(weights_only=True)``, which rebuilds tensors and plain Python data only. A
checksum proves that a file is the one the manifest names, not that its author is friendly,
so no file is ever unpickled with ``weights_only=False``.

DeepSpeed pickles a few of its own classes into its files (the fp16 loss scaler, ZeRO's
stage enum, tensor-fragment addresses) and, with curriculum learning, NumPy's random state
(an array and scalars). Those, and only those, are allowed by name (:data:`DEEPSPEED_GLOBALS`,
:func:`_numpy_globals`); they are plain records whose unpickling runs no code of the file's
choosing (a NumPy array is rebuilt from its raw bytes, and the objects of an object array are
themselves unpickled under the same rules). Anything else is refused with :class:`~zero_bnb.errors.CheckpointFormatError`
naming the class. A user who trusts a file that holds other classes (in a ``client_state``,
say) allows them explicitly with ``torch.serialization.add_safe_globals``.

Before unpickling, the file must be a regular file inside the folder it belongs to (no
symlink out of a checkpoint, no FIFO), and a zip archive (``torch.save``'s format) must hold
uncompressed entries only, so a small file cannot inflate into a huge one. After loading,
every tensor must own the memory its shape claims (no stride-0 expansion of one element into
billions), so that no reader allocates more than the file holds.

Local, no collectives; any process may call it.
"""

from __future__ import annotations

import errno
import importlib
import os
import pickle
import re
import stat
import zipfile
from typing import Any, BinaryIO

import torch

from zero_bnb.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError, failure_kind
from zero_bnb.format.paths import inside, resolved
from zero_bnb.format.pinned import PinnedFolder

__all__ = ["DEEPSPEED_GLOBALS", "check_checkpoint_file", "load_pinned", "safe_load"]

#: ``module.Class`` names DeepSpeed stores in its checkpoint files, allowed when unpickling.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

#: errnos that come from the machine reading a file (permissions, descriptor limits, storage), not its content.
_MACHINE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE, errno.EIO, errno.ENOMEM})

#: How torch's weights-only unpickler names a refused class: a global it would import, or a type it would build.
_GLOBAL_PATTERN = re.compile(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>")


def _numpy_globals() -> list[Any]:
    """NumPy's array and scalar rebuilders (``numpy.random.get_state()`` in a curriculum data sampler's state).

    Found through NumPy's own pickling, since their module moved in NumPy 2 (``numpy._core``).
    """
    try:
        import numpy
    except ImportError:  # no NumPy: no file this process could have written holds NumPy objects
        return []
    numeric = numpy.typecodes["AllInteger"] + numpy.typecodes["AllFloat"] + "?"  # no object or structured dtypes
    dtype_classes = {type(numpy.dtype(code)) for code in numeric}
    return [numpy.ndarray, numpy.dtype, numpy.zeros(0).__reduce__()[0], numpy.float32(0).__reduce__()[0],
            *sorted(dtype_classes, key=lambda cls: cls.__name__)]


def _deepspeed_globals() -> list[Any]:
    """The allowed DeepSpeed classes, imported on first need (reading zero_bnb's own files needs none)."""
    found = _numpy_globals()
    for qualified in DEEPSPEED_GLOBALS:
        module, _, name = qualified.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: the class cannot be in its files
            continue
    return found


def check_checkpoint_file(path: str, what: str, root: str) -> None:
    """Refuse a file that resolves outside ``root``, is not a regular file, or is a crafted zip (see module doc)."""
    if not inside(path, root):
        raise CheckpointFormatError(f"{what} {path} resolves to {resolved(path)}, outside {root}; checkpoint files "
                                    f"must lie inside their checkpoint folder")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{what} {path} is missing; the checkpoint is incomplete") from None
    if not stat.S_ISREG(mode):
        raise CheckpointFormatError(f"{what} {path} is not a regular file; checkpoint files must be regular files")
    with open(path, "rb") as handle:
        _check_archive(handle, os.path.getsize(path), what, path)


def _check_archive(handle: BinaryIO, size: int, what: str, shown: str) -> None:
    """Refuse a zip archive with compressed entries or entries larger than the file (``size`` bytes)."""
    if zipfile.is_zipfile(handle):
        handle.seek(0)
        with zipfile.ZipFile(handle) as archive:
            entries = archive.infolist()
        compressed = [entry.filename for entry in entries if entry.compress_type != zipfile.ZIP_STORED]
        declared = sum(entry.file_size for entry in entries)
        if compressed or declared > size:
            raise CheckpointFormatError(
                f"{what} {shown} holds compressed entries ({compressed[:3]}) or entries larger than the file "
                f"({declared} bytes declared); torch.save writes neither, so the file was crafted or damaged"
            )


def _check_tensors(value: Any, path: str, what: str, depth: int = 0) -> None:
    """Every tensor in ``value`` owns the bytes its shape needs (refuses stride-0 expansions)."""
    if depth > 64:
        raise CheckpointFormatError(f"{what} {path} nests containers more than 64 levels deep")
    if isinstance(value, torch.Tensor):
        needed = value.numel() * value.element_size()
        if needed and value.untyped_storage().nbytes() < needed:
            raise CheckpointFormatError(
                f"{what} {path} holds a tensor of shape {tuple(value.shape)} ({needed} bytes) backed by "
                f"{value.untyped_storage().nbytes()} bytes (an expanded view); torch.save of a real tensor never "
                f"does this, so the file was crafted"
            )
    elif isinstance(value, dict):
        for item in value.values():
            _check_tensors(item, path, what, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_tensors(item, path, what, depth + 1)


def safe_load(path: str, what: str, *, mmap: bool = False, deepspeed_classes: bool = False,
              root: str | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with clear errors.

    Args:
        path: the file.
        what: how to name the file in errors ("shard file", "DeepSpeed model file", ...).
        mmap: memory-map the file (only the tensors that are touched are read).
        deepspeed_classes: also allow :data:`DEEPSPEED_GLOBALS` (files DeepSpeed wrote).
        root: the checkpoint folder ``path`` must lie in, symlinks resolved (default: the
            folder that names it, so the file cannot be a symlink to elsewhere).

    Raises:
        CheckpointCorruptError: the file is missing or cannot be read as a torch file.
        CheckpointError: the operating system refused to read it (permissions, too many open files, an I/O
            error) or memory ran out; the message names which, since the file itself may be fine.
        CheckpointFormatError: the file lies outside ``root`` or is not a regular file, is a
            zip with compressed entries, holds an object of a class that is not allowed, or a
            tensor that claims more memory than it owns.
    """
    check_checkpoint_file(path, what, os.path.dirname(path) or "." if root is None else root)
    return _unpickle(path, what, path, mmap=mmap, deepspeed_classes=deepspeed_classes)


def load_pinned(folder: PinnedFolder, relative: str, what: str, *, mmap: bool = False,
                deepspeed_classes: bool = False) -> Any:
    """:func:`safe_load` of file ``relative`` of a pinned folder, read through its held descriptor.

    The bytes read are those of the file the folder held when it was first opened (see
    :mod:`zero_bnb.format.pinned`), whatever was renamed since. Raises as :func:`safe_load` does.
    """
    shown = os.path.join(folder.path, relative)
    with folder.stream(relative) as handle:
        _check_archive(handle, folder.size(relative), what, shown)
        if not mmap:
            handle.seek(0)
            return _unpickle(handle, what, shown, mmap=False, deepspeed_classes=deepspeed_classes)
    with folder.path_of(relative) as path:
        return _unpickle(path, what, shown, mmap=True, deepspeed_classes=deepspeed_classes)


def _unpickle(source: str | BinaryIO, what: str, shown: str, *, mmap: bool, deepspeed_classes: bool) -> Any:
    allowed = _deepspeed_globals() if deepspeed_classes else []
    try:
        with torch.serialization.safe_globals(allowed):
            loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        match = _GLOBAL_PATTERN.search(str(error))
        refused = match and (match.group(1) or match.group(2))
        if not refused:
            raise CheckpointCorruptError(
                f"{what} {shown} cannot be read (UnpicklingError: {str(error).splitlines()[0]}); the file is damaged"
            ) from error
        raise CheckpointFormatError(
            f"{what} {shown} holds a pickled object of class {refused}, which zero_bnb does not unpickle "
            f"because unpickling it could run code from the file. If you wrote this file yourself and trust it, "
            f"allow the class before loading: torch.serialization.add_safe_globals([{refused}])"
        ) from error
    except (OSError, MemoryError) as error:
        if not isinstance(error, MemoryError) and error.errno not in _MACHINE_ERRNOS:
            raise CheckpointCorruptError(
                f"{what} {shown} cannot be read ({type(error).__name__}: {error}); the file is damaged"
            ) from error
        raise CheckpointError(  # the machine, not the file: say which (permissions, open files, memory)
            f"{what} {shown} cannot be read ({type(error).__name__}: {error}): {failure_kind(error)}. This says nothing "
            f"about the file's content; fix the cause and load again"
        ) from error
    except Exception as error:  # torch raises many types for damaged archives
        raise CheckpointCorruptError(
            f"{what} {shown} cannot be read ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            f"the file is damaged"
        ) from error
    _check_tensors(loaded, shown, what)
    return loaded
