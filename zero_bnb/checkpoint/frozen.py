"""Frozen parameters' values in DeepSpeed's model files, re-cut for the loading engine's DP size and ZeRO stage.

From ZeRO stage 2 on, DeepSpeed saves each frozen (``requires_grad=False``) parameter under
``frozen_param_fragments`` of its model file, and its loader copies the entry into the parameter:
at stage 2 the whole parameter, at stage 3 the rank's partition (``ds_tensor``), each DP rank
writing its own file. Handed rank 0's file at another DP size (or rank 0's partition on every rank
at the same size) that copy fails half-way or silently loads the wrong slice. A zero_bnb load plans
instead the entries this rank's engine needs: each frozen parameter's whole value (the saved
ranks' partitions laid end to end, or the saved whole parameter), then this rank's partition of it
at stage 3 (padding zero) or the whole parameter otherwise.

Local functions, no collectives.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from zero_bnb.errors import CheckpointFormatError, CheckpointMismatchError, malformed
from zero_bnb.format.reader import CheckpointReader
from zero_bnb.format.stock_files import is_stage3_model_file, stage3_model_states

__all__ = ["FROZEN_FRAGMENTS", "plan_frozen_fragments", "saved_frozen_values"]

#: DeepSpeed's model-file keys for frozen parameters' values and shapes (``deepspeed.checkpoint.constants``).
FROZEN_FRAGMENTS = "frozen_param_fragments"
FROZEN_SHAPES = "frozen_param_shapes"


def _whole(name: str, numel: int, saved: list[Any], model_file: str) -> torch.Tensor:
    """``name``'s whole flat value from the saved ranks' entries (one entry: the whole parameter)."""
    if not all(isinstance(piece, torch.Tensor) for piece in saved):
        raise CheckpointFormatError(
            f"{model_file}: frozen parameter {name!r} is missing from {FROZEN_FRAGMENTS!r} of "
            f"{sum(not isinstance(p, torch.Tensor) for p in saved)} of the {len(saved)} saved ranks' model files; the "
            f"files are not from one save. Load an earlier tag"
        )
    lengths = {piece.numel() for piece in saved}
    if len(saved) > 1 and (len(lengths) != 1 or lengths.pop() * len(saved) < numel):
        raise CheckpointFormatError(
            f"{model_file}: the saved partitions of frozen parameter {name!r} have {[p.numel() for p in saved]} "
            f"elements, which do not hold its {numel} elements in equal slices; the files are not from one save"
        )
    whole = torch.cat([piece.reshape(-1) for piece in saved]) if len(saved) > 1 else saved[0].reshape(-1)
    if whole.numel() < numel or (len(saved) == 1 and whole.numel() != numel):
        raise CheckpointMismatchError(
            f"{model_file}: frozen parameter {name!r} was saved with {whole.numel()} elements, but the model's has "
            f"{numel}; the checkpoint is of another model. Build the model it was saved from"
        )
    return whole[:numel]


def _saved_fragments(model_states: dict, reader: CheckpointReader | None, model_name: str) -> list[dict]:
    """Every saving rank's frozen-parameter entries: from each rank's model file of a stage-3 save (``model_name``
    is rank 0's, ``model_states`` its contents; one file per saving rank, as one shard), else the file's own."""
    fragments = model_states.get(FROZEN_FRAGMENTS) or {}
    if reader is None or not is_stage3_model_file(model_name):
        return [fragments]
    return [fragments] + [reader.load(stage3_model_states(rank), "DeepSpeed model file", deepspeed_classes=True,
                                      mmap=True).get(FROZEN_FRAGMENTS) or {}
                          for rank in range(1, len(reader.manifest.shards))]


def saved_frozen_values(model_states: dict, reader: CheckpointReader, model_name: str,
                        model_file: str) -> dict[str, torch.Tensor]:
    """Every frozen parameter's whole value (its saved shape) from the model file ``model_name`` of ``reader``'s
    checkpoint (``model_states``: its contents; at stage 3, every saving rank's slices); empty when it saved none.

    Raises:
        CheckpointFormatError: the saved ranks' entries do not fit together or the shapes are malformed.
    """
    fragments, shapes = model_states.get(FROZEN_FRAGMENTS), model_states.get(FROZEN_SHAPES)
    if not isinstance(fragments, dict) or not fragments:
        return {}
    if not isinstance(shapes, dict) or set(shapes) != set(fragments):
        raise CheckpointFormatError(f"{model_file}: {FROZEN_SHAPES!r} does not name the frozen parameters of "
                                    f"{FROZEN_FRAGMENTS!r} ({sorted(fragments)[:5]}); the file was not written by DeepSpeed")
    ranks = _saved_fragments(model_states, reader, model_name)
    found = {}
    for name, shape in shapes.items():
        with malformed(f"{model_file}: the shape of frozen parameter {name!r}"):
            shape = tuple(int(size) for size in shape)
        whole = _whole(name, math.prod(shape), [rank.get(name) for rank in ranks], model_file)
        found[name] = whole.view(shape)
    return found


def plan_frozen_fragments(module: torch.nn.Module, names: dict[torch.nn.Parameter, str], model_states: dict,
                          reader: CheckpointReader | None, dp_rank: int, model_file: str) -> None:
    """Replace ``model_states``' frozen-parameter entries, in place, by what this rank's engine must copy.

    Args:
        module: the engine's module; a parameter with ``ds_tensor`` is a ZeRO-3 partition.
        names: parameter -> its checkpoint name (DeepSpeed's ``engine.param_names``).
        model_states: the model file ``model_file`` DeepSpeed's loader will apply (rank 0's, for a stage-3 save).
        reader: the checkpoint's reader, whose other ranks' model files a stage-3 save's slices are read from
            (only when the file holds frozen values); ``None`` for a stock checkpoint.
        dp_rank: this rank's DP rank.

    Raises:
        CheckpointMismatchError: a frozen parameter of the model is not in the checkpoint, or has another size.
        CheckpointFormatError: the saved ranks' entries do not fit together.
    """
    fragments = model_states.get(FROZEN_FRAGMENTS) if isinstance(model_states, dict) else None
    if not isinstance(fragments, dict):
        return  # saved without frozen values (stage 1, exclude_frozen_parameters): DeepSpeed copies none
    frozen = [(param, names[param]) for param in module.parameters() if not param.requires_grad and param in names]
    if not frozen:
        return  # nothing to copy: the other ranks' model files need not be read
    missing = [name for _, name in frozen if name not in fragments]
    if missing:
        raise CheckpointMismatchError(
            f"{model_file}: parameter(s) {missing[:5]} are frozen (requires_grad=False) in this model but the "
            f"checkpoint holds no frozen value for them (it has {sorted(fragments)[:5]}); they were trained when it "
            f"was saved, or it is of another model. Freeze the same parameters as the saved run"
        )
    ranks = _saved_fragments(model_states, reader, os.path.basename(model_file))
    planned = {}
    for param, name in frozen:
        numel = int(getattr(param, "ds_numel", param.numel()))
        whole = _whole(name, numel, [rank.get(name) for rank in ranks], model_file)
        partition = getattr(param, "ds_tensor", None)
        if partition is None:
            planned[name] = whole.view(tuple(param.shape)).clone()
            if isinstance(model_states.get("module"), dict):
                model_states["module"][name] = planned[name]  # a stage-3 save holds an empty placeholder there
            continue
        size = partition.numel()
        start = min(dp_rank * size, numel)
        piece = torch.zeros(size, dtype=whole.dtype)
        piece[: min(size, numel - start)] = whole[start : start + size]
        planned[name] = piece
    model_states[FROZEN_FRAGMENTS] = {**fragments, **planned}
