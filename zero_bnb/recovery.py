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

import logging
import os
import stat
import tempfile

import torch
from tqdm import tqdm

from zero_bnb.checkpoint_paths import MODEL_STATES, model_states_files, open_verified
from zero_bnb.errors import CheckpointFormatError, malformed
from zero_bnb.load import CheckpointReader
from zero_bnb.offline import gather_full, moments, per_parameter
from zero_bnb.state_spec import spec_named
from zero_bnb.unpickle import safe_load

__all__ = ["SCRIPT_NAME", "fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint", "write_recovery_script"]

logger = logging.getLogger(__name__)

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

from zero_bnb.cli.zero_to_fp32 import main
from zero_bnb.recovery import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
'''


def write_recovery_script(save_dir: str) -> str | None:
    """Write ``zero_to_fp32.py`` into ``save_dir`` (write-then-rename, executable); returns its path.

    Local: call on one rank (rank 0), as DeepSpeed does, after the checkpoint is committed. A
    failure is logged, not raised: the checkpoint itself is complete without the script.
    """
    path = os.path.join(save_dir, SCRIPT_NAME)
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=f".{SCRIPT_NAME}.", suffix=".zero_bnb-tmp", dir=save_dir)
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(_SCRIPT)
            os.chmod(temporary, 0o644 | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
            os.replace(temporary, path)
        finally:
            if os.path.lexists(temporary):
                os.remove(temporary)
    except OSError as error:
        logger.warning("zero_bnb: could not write %s (%r); the checkpoint is complete without it", path, error)
        return None
    return path


def _fp32_tensors(reader: CheckpointReader, moments_too: bool, progress: bool) -> dict[str, torch.Tensor]:
    spec = spec_named(reader.manifest.optimizer_spec)
    tensors: dict[str, torch.Tensor] = {}

    def add(name: str, value: torch.Tensor) -> None:
        if name in tensors:
            raise CheckpointFormatError(f"two tensors of {reader.tag_folder} would be exported as {name!r} (a "
                                        f"parameter is named like another's moment); the manifest was edited")
        tensors[name] = value.contiguous()

    for group in tqdm(gather_full(reader), desc="groups", unit="group", disable=not progress):
        for name, value in per_parameter(group, group.fp32).items():
            add(name, value)
        if moments_too:
            for moment, flat in moments(group, spec, reader.manifest.block_size).items():
                for name, value in per_parameter(group, flat).items():
                    add(f"{name}.{moment}", value)
    return tensors


def fp32_state_dict(path: str, tag: str | None = None, *, moments_too: bool = False, progress: bool = False,
                    command: str = "zero_to_fp32") -> dict[str, torch.Tensor]:
    """Every trained parameter's fp32 master weight by name, from any saved DP size.

    With ``moments_too``, also ``<name>.exp_avg`` / ``<name>.exp_avg_sq`` (8-bit moments dequantized
    exactly). ``path`` is a save folder (``tag=None`` follows ``latest``) or a tag folder; the
    checkpoint is verified first.
    """
    _, reader = open_verified(path, tag, command=command)
    return _fp32_tensors(reader, moments_too, progress)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """DeepSpeed's function of the same name, for zero_bnb checkpoints: a module ``state_dict`` in fp32.

    Trained parameters come from the master weights; tied parameters appear under every name
    (DeepSpeed's ``shared_params``); buffers and, unless ``exclude_frozen_parameters``, frozen
    parameters come from DeepSpeed's model file (read with ``weights_only=True``).
    """
    _, reader = open_verified(checkpoint_dir, tag, command="zero_to_fp32")
    state = _fp32_tensors(reader, moments_too=False, progress=False)
    model_file = model_states_files(reader.tag_folder)[MODEL_STATES]
    model_states = safe_load(model_file, "DeepSpeed model file", deepspeed_classes=True)
    with malformed(f"DeepSpeed model file {model_file}"):
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
