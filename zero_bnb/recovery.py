"""``zero_to_fp32.py`` for zero_bnb checkpoints: the consolidated fp32 state dict, DeepSpeed's habit kept.

Stock DeepSpeed copies ``zero_to_fp32.py`` into every save folder; people run
``python zero_to_fp32.py . out_dir`` there, or import
``get_fp32_state_dict_from_zero_checkpoint`` from it. zero_bnb's optimizer files are not
DeepSpeed's, so DeepSpeed's script cannot read them (``can't find *_optim_states.pt``).
:func:`write_recovery_script` puts a script with the same name, arguments and output files
into the save folder; it calls :func:`fp32_state_dict` (the export of ``zero-bnb export``).

Local, single process; no DeepSpeed engine and no ``torch.distributed``.
"""

from __future__ import annotations

import argparse
import os
import stat

import torch
from tqdm import tqdm

from zero_bnb.checkpoint_paths import MODEL_STATES, model_states_files, open_verified
from zero_bnb.offline import gather_full, moments, per_parameter
from zero_bnb.state_spec import spec_named

__all__ = ["SCRIPT_NAME", "fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint", "main",
           "write_recovery_script"]

SCRIPT_NAME = "zero_to_fp32.py"

_SCRIPT = '''#!/usr/bin/env python
"""Consolidated fp32 weights of the zero_bnb checkpoints in this folder (written by zero_bnb).

Same use as DeepSpeed's zero_to_fp32.py:
    python zero_to_fp32.py . OUTPUT_DIR [-t TAG] [--safe_serialization]
or, in Python:
    from zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint(".")
Needs zero_bnb installed (pip install zero_bnb).
"""
import sys

from zero_bnb.recovery import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401
from zero_bnb.recovery import main

if __name__ == "__main__":
    sys.exit(main())
'''


def write_recovery_script(save_dir: str) -> str:
    """Write ``zero_to_fp32.py`` into ``save_dir`` (write-then-rename, executable); returns its path.

    Local: call on one rank (rank 0), as DeepSpeed does.
    """
    path = os.path.join(save_dir, SCRIPT_NAME)
    temporary = f"{path}.zero_bnb-tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(_SCRIPT)
    os.chmod(temporary, os.stat(temporary).st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(temporary, path)
    return path


def fp32_state_dict(path: str, tag: str | None = None, *, moments_too: bool = False,
                    progress: bool = False) -> dict[str, torch.Tensor]:
    """Every trained parameter's fp32 master weight by name, from any saved DP size.

    With ``moments_too``, also ``<name>.exp_avg`` / ``<name>.exp_avg_sq`` (8-bit moments dequantized
    exactly). ``path`` is a save folder (``tag=None`` follows ``latest``) or a tag folder; the
    checkpoint is verified first.
    """
    _, reader = open_verified(path, tag)
    spec = spec_named(reader.manifest.optimizer_spec)
    tensors: dict[str, torch.Tensor] = {}
    for group in tqdm(gather_full(reader), desc="groups", unit="group", disable=not progress):
        tensors.update({name: value.contiguous() for name, value in per_parameter(group, group.fp32).items()})
        if moments_too:
            for moment, flat in moments(group, spec, reader.manifest.block_size).items():
                tensors.update({f"{name}.{moment}": value.contiguous()
                                for name, value in per_parameter(group, flat).items()})
    return tensors


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """DeepSpeed's function of the same name, for zero_bnb checkpoints: a module ``state_dict`` in fp32.

    Trained parameters come from the master weights; tied parameters appear under every name
    (DeepSpeed's ``shared_params``); buffers and, unless ``exclude_frozen_parameters``, frozen
    parameters come from DeepSpeed's model file.
    """
    _, reader = open_verified(checkpoint_dir, tag)
    state = fp32_state_dict(reader.tag_folder)
    model_states = torch.load(model_states_files(reader.tag_folder)[MODEL_STATES], map_location="cpu",
                              weights_only=False)
    module = model_states.get("module") or {}
    extra = list(model_states.get("buffer_names") or [])
    if not exclude_frozen_parameters:
        extra += list(model_states.get("frozen_param_shapes") or {})
    for name in extra:
        if name in module and name not in state:
            state[name] = module[name].float() if module[name].is_floating_point() else module[name]
    for alias, source in (model_states.get("shared_params") or {}).items():
        if source in state:
            state[alias] = state[source]
    return state


def main(argv: list[str] | None = None) -> int:
    """``python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]``."""
    parser = argparse.ArgumentParser(description="consolidated fp32 weights of a zero_bnb checkpoint")
    parser.add_argument("checkpoint_dir", help="the save folder (holding 'latest') or a tag folder")
    parser.add_argument("output_dir", help="folder for pytorch_model.bin (or model.safetensors)")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("--max_shard_size", default=None, help="accepted for compatibility; one file is written")
    args = parser.parse_args(argv)
    state = get_fp32_state_dict_from_zero_checkpoint(args.checkpoint_dir, args.tag, args.exclude_frozen_parameters)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.safe_serialization:
        from safetensors.torch import save_file

        out = os.path.join(args.output_dir, "model.safetensors")
        seen: dict[int, str] = {}
        unique = {}
        for name, value in state.items():  # safetensors refuses shared storage: keep the first name of each tensor
            if value.data_ptr() not in seen:
                seen[value.data_ptr()] = name
                unique[name] = value.contiguous()
        save_file(unique, out, metadata={"format": "pt"})
    else:
        out = os.path.join(args.output_dir, "pytorch_model.bin")
        torch.save(state, out)
    print(f"zero_bnb: wrote {len(state)} tensors to {out}")
    return 0
