"""Read checkpoint files without executing code from them.

Every checkpoint file zero_bnb reads (its own shards and replicated file, DeepSpeed's model
file, stock DeepSpeed optimizer files, universal checkpoints) goes through :func:`safe_load`:
``torch.load(weights_only=True)``, which rebuilds tensors and plain Python data only. A
checksum proves that a file is the one the manifest names, not that its author is friendly,
so no file is ever unpickled with ``weights_only=False``.

DeepSpeed pickles a few of its own classes into its files (the fp16 loss scaler, ZeRO's
stage enum, tensor-fragment addresses). Those, and only those, are allowed by name
(:data:`DEEPSPEED_GLOBALS`); they are plain records whose unpickling runs no code of the
file's choosing. Anything else is refused with :class:`~zero_bnb.errors.CheckpointFormatError`
naming the class. A user who trusts a file that holds other classes (in a ``client_state``,
say) allows them explicitly with ``torch.serialization.add_safe_globals``.

Local, no collectives; any process may call it.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
from typing import Any

import torch

from zero_bnb.errors import CheckpointCorruptError, CheckpointFormatError

__all__ = ["DEEPSPEED_GLOBALS", "safe_load"]

#: ``module.Class`` names DeepSpeed stores in its checkpoint files, allowed when unpickling.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

_GLOBAL_PATTERN = re.compile(r"GLOBAL ([\w.]+)")


def _deepspeed_globals() -> list[Any]:
    """The allowed DeepSpeed classes, imported on first need (reading zero_bnb's own files needs none)."""
    found = []
    for qualified in DEEPSPEED_GLOBALS:
        module, _, name = qualified.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: the class cannot be in its files
            continue
    return found


def safe_load(path: str, what: str, *, mmap: bool = False, deepspeed_classes: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with clear errors.

    Args:
        path: the file.
        what: how to name the file in errors ("shard file", "DeepSpeed model file", ...).
        mmap: memory-map the file (only the tensors that are touched are read).
        deepspeed_classes: also allow :data:`DEEPSPEED_GLOBALS` (files DeepSpeed wrote).

    Raises:
        CheckpointCorruptError: the file is missing or cannot be read as a torch file.
        CheckpointFormatError: the file holds an object of a class that is not allowed.
    """
    if not os.path.isfile(path):
        raise CheckpointCorruptError(f"{what} {path} is missing; the checkpoint is incomplete")
    allowed = _deepspeed_globals() if deepspeed_classes else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        match = _GLOBAL_PATTERN.search(str(error))
        if match is None:
            raise CheckpointCorruptError(
                f"{what} {path} cannot be read (UnpicklingError: {str(error).splitlines()[0]}); the file is damaged"
            ) from error
        raise CheckpointFormatError(
            f"{what} {path} holds a pickled object of class {match.group(1)}, which zero_bnb does not unpickle "
            f"because unpickling it could run code from the file. If you wrote this file yourself and trust it, "
            f"allow the class before loading: torch.serialization.add_safe_globals([{match.group(1)}])"
        ) from error
    except Exception as error:  # torch raises many types for damaged archives
        raise CheckpointCorruptError(
            f"{what} {path} cannot be read ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            f"the file is damaged"
        ) from error
