"""``zero_to_fp32.py`` for zero_bnb checkpoints: the consolidated fp32 state dict, DeepSpeed's habit kept.

Stock DeepSpeed copies ``zero_to_fp32.py`` into every save folder; people run
``python zero_to_fp32.py . out_dir`` there, or import
``get_fp32_state_dict_from_zero_checkpoint`` from it. zero_bnb's optimizer files are not
DeepSpeed's, so DeepSpeed's script cannot read them (``can't find *_optim_states.pt``).
:func:`zero_bnb.checkpoint.recovery_script.write_recovery_script` puts a script with the same
name, arguments and output files into the save folder; it calls the functions here (the
export of ``zero-bnb export``).

Local, single process; no DeepSpeed engine and no ``torch.distributed``.
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from zero_bnb.checkpoint.frozen import saved_frozen_values
from zero_bnb.checkpoint.whole import gather_full, moments, per_parameter
from zero_bnb.core.state_spec import spec_named
from zero_bnb.errors import CheckpointFormatError, malformed
from zero_bnb.format.reader import CheckpointReader
from zero_bnb.format.stock_files import is_stage3_model_file, model_file_of
from zero_bnb.tools.checkpoint_paths import open_verified

__all__ = ["fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint"]

logger = logging.getLogger(__name__)

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
                                             exclude_frozen_parameters: bool = False, *, moments_too: bool = False,
                                             progress: bool = False,
                                             command: str = "zero_to_fp32") -> dict[str, torch.Tensor]:
    """DeepSpeed's function of the same name, for zero_bnb checkpoints: a module ``state_dict`` in fp32.

    Trained parameters come from the master weights; tied parameters appear under every name
    (DeepSpeed's ``shared_params``; the names share one tensor, as in DeepSpeed's result);
    buffers and, unless ``exclude_frozen_parameters``, frozen parameters (at every ZeRO stage) come
    from DeepSpeed's model file (read with ``weights_only=True``). With ``moments_too`` (``zero-bnb export
    --moments``), also ``<name>.exp_avg`` / ``<name>.exp_avg_sq`` of every trained parameter.
    """
    _, reader = open_verified(checkpoint_dir, tag, command=command)
    state = _fp32_tensors(reader, moments_too=moments_too, progress=progress)
    trained = {param.name for group in reader.manifest.groups for param in group.params}
    model_name, model_file = model_file_of(reader.tag_folder)
    model_states = reader.load(model_name, "DeepSpeed model file", deepspeed_classes=True)  # the verified bytes
    with malformed(f"DeepSpeed model file {model_file}"):
        module = model_states.get("module") or {}
        buffer_names = set(model_states.get("buffer_names") or [])
        shared = dict(model_states.get("shared_params") or {})
        if is_stage3_model_file(model_name):  # module entries are empty placeholders; each rank saved its slice
            module = {**module, **saved_frozen_values(model_states, reader, model_name, model_file)}
        # Frozen parameters: every module entry that is no trained parameter, buffer or tied alias. DeepSpeed
        # records frozen_param_shapes at stage 2 only (its own script misses them at stage 1), but the module
        # state dict always holds them (unless saved with exclude_frozen_parameters).
        for name, value in module.items():
            if name in state or name in shared or (name not in buffer_names and exclude_frozen_parameters):
                continue
            state[name] = value.float() if value.is_floating_point() else value
        for alias, source in shared.items():
            # A tied alias is never a trained parameter of its own (whose masters the checks bound to the shard),
            # and has its source's shape: a model file that says otherwise was edited after the save.
            placeholder = module.get(alias)  # stage 3 saves an empty tensor under every parameter name
            if alias in trained or (isinstance(placeholder, torch.Tensor) and placeholder.numel() > 0
                                    and source in state and tuple(placeholder.shape) != tuple(state[source].shape)):
                raise CheckpointFormatError(
                    f"{model_file}: shared_params ties {alias!r} to {source!r}, but {alias!r} is "
                    f"{'a trained parameter with master weights of its own' if alias in trained else 'of another shape'}"
                    f"; the model file was edited after the save. Restore it, or load an earlier tag"
                )
            if source in state:
                state[alias] = state[source]
    return state
