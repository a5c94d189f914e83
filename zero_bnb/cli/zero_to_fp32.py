"""``zero_to_fp32.py`` in a save folder: DeepSpeed's script of that name, for zero_bnb checkpoints.

``python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization] [--max_shard_size 5GB]`` writes
``pytorch_model.bin`` (or ``model.safetensors``) with the consolidated fp32 module state dict
(:func:`zero_bnb.tools.recovery.get_fp32_state_dict_from_zero_checkpoint`); one larger than ``max_shard_size``
is split into shards and an index, as DeepSpeed's script does (:mod:`zero_bnb.tools.shards`). The functions users
import from DeepSpeed's script (``deepspeed/utils/zero_to_fp32.py``, 0.19.8) are here with its signatures, so
``from zero_to_fp32 import load_state_dict_from_zero_checkpoint`` (or ``convert_zero_checkpoint_to_fp32_state_dict``)
in a save folder works on zero_bnb checkpoints of every ZeRO stage.

Local, single process; no DeepSpeed engine and no ``torch.distributed``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from zero_bnb.cli.pipes import quiet_on_broken_pipe
from zero_bnb.errors import CheckpointError, CheckpointUsageError
from zero_bnb.tools.outputs import check_output_parents
from zero_bnb.tools.recovery import get_fp32_state_dict_from_zero_checkpoint
from zero_bnb.tools.shards import parse_shard_size, write_shards

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint", "main"]

logger = logging.getLogger(__name__)

#: Output dtypes by the names DeepSpeed's ``convert_zero_checkpoint_to_state_dict`` accepts.
OUTPUT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
                 "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _output_dtype(dtype: torch.dtype | str) -> torch.dtype:
    name = dtype.removeprefix("torch.").lower() if isinstance(dtype, str) else None
    resolved = OUTPUT_DTYPES.get(name) if name is not None else dtype
    if resolved not in OUTPUT_DTYPES.values():
        raise CheckpointUsageError(f"output dtype {dtype!r} is not supported; choose one of {sorted(OUTPUT_DTYPES)} "
                                   f"(or the torch dtypes float32, float16, bfloat16)")
    return resolved


def _write(checkpoint_dir: str, output_dir: str, *, dtype: torch.dtype | str, safe_serialization: bool,
           tag: str | None, exclude_frozen_parameters: bool, max_shard_size: str | int | None) -> tuple[str, str]:
    dtype = _output_dtype(dtype)
    if max_shard_size is not None:
        parse_shard_size(max_shard_size)  # a wrong size is named before the checkpoint is read
    check_output_parents(os.fspath(output_dir), folder=True)  # so is an output folder that is (or is under) a file
    state = get_fp32_state_dict_from_zero_checkpoint(os.fspath(checkpoint_dir), tag, exclude_frozen_parameters)
    if dtype != torch.float32:  # buffers that are not floating point keep their dtype, as in DeepSpeed's
        cast: dict[int, torch.Tensor] = {}  # tied names keep sharing one tensor
        state = {name: cast.setdefault(id(value), value.to(dtype)) if value.is_floating_point() else value
                 for name, value in state.items()}
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"  # tied names too: every name
    out, plan = write_shards(state, os.fspath(output_dir), weights_name, max_shard_size, metadata={"format": "pt"})
    files = f"{len(plan.files)} files and the index {os.path.basename(out)}" if plan.sharded else "1 file"
    return out, f"{len(state)} tensors ({files})"


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype: torch.dtype | str = torch.float32,
                                          max_shard_size: str | int | None = "5GB", safe_serialization: bool = False,
                                          tag: str | None = None, exclude_frozen_parameters: bool = False) -> str:
    """DeepSpeed's function of that name, for zero_bnb checkpoints (any ZeRO stage, any saved DP size).

    Writes ``output_dir/pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``) with the
    module's state dict: the fp32 master weights, tied names, buffers and frozen parameters, floating-point
    tensors cast to ``dtype`` (``torch.float32``/``float16``/``bfloat16`` or their names). A state larger than
    ``max_shard_size`` (bytes, or a size such as ``"5GB"``; ``None``: never) is split as DeepSpeed splits it, into
    ``pytorch_model-00001-of-0000N.bin`` ... and ``pytorch_model.bin.index.json`` (``model-...safetensors``,
    ``model.safetensors.index.json``) that ``from_pretrained`` reads. Each file replaces an existing one only once
    complete, the index last. Returns the file's path (the index's when sharded).

    Raises:
        CheckpointUsageError: an unsupported ``dtype`` or ``max_shard_size``, or an ``output_dir`` that is, or lies
            under, an existing file; nothing is read or written.
        CheckpointError: the checkpoint cannot be read (named, with the fix); nothing is written.
    """
    return _write(checkpoint_dir, output_dir, dtype=dtype, safe_serialization=safe_serialization, tag=tag,
                  exclude_frozen_parameters=exclude_frozen_parameters, max_shard_size=max_shard_size)[0]


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size: str | int | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """DeepSpeed's function of that name: :func:`convert_zero_checkpoint_to_state_dict` in fp32."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag: str | None = None):
    """DeepSpeed's function of that name: move ``model`` to the CPU and load the checkpoint's fp32 weights into it.

    As DeepSpeed's, the load is not strict (a model with more entries keeps them); names the checkpoint has but
    the model lacks, or the other way round, are logged. Returns ``model``.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(os.fspath(checkpoint_dir), tag)
    model = model.cpu()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        logger.warning("zero_bnb: loading %s into %s: the model has no %s; the checkpoint has no %s",
                       checkpoint_dir, type(model).__name__, unexpected or "other names", missing or "other names")
    return model


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, write the consolidated weights; returns the exit code (1 on a checkpoint error or another
    failure to write, said in one line; 141, quietly, when standard output's reader went away)."""
    return quiet_on_broken_pipe(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description="consolidated fp32 weights of a zero_bnb checkpoint")
    parser.add_argument("checkpoint_dir", help="the save folder (holding 'latest') or a tag folder")
    parser.add_argument("output_dir", help="folder for pytorch_model.bin (or model.safetensors)")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="split a larger state into shards and an index, e.g. 5GB or 500MB (default: 5GB)")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for compatibility")
    args = parser.parse_args(argv)
    try:
        out, written = _write(args.checkpoint_dir, args.output_dir, dtype=torch.float32,
                              safe_serialization=args.safe_serialization, tag=args.tag,
                              exclude_frozen_parameters=args.exclude_frozen_parameters,
                              max_shard_size=args.max_shard_size)
    except (CheckpointError, OSError) as error:  # a full disk included: nothing written, one line
        if isinstance(error, BrokenPipeError):
            raise  # stdout's reader is gone: main ends quietly
        print(f"zero_to_fp32: {type(error).__name__}: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    print(f"zero_bnb: wrote {written} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
