"""Model weights that zero_bnb does not store twice.

DeepSpeed's model-states file holds every module parameter, although each one ZeRO trains
is, bit for bit, its fp32 master weight cast to the module's dtype - and the master weights
are already in the shards. zero_bnb drops those entries from the model-states file and
records, under :data:`DERIVED_PARAMS_KEY`, which state-dict key is which master weight in
which dtype; loading puts them back before DeepSpeed loads the module. Buffers and
parameters ZeRO does not train stay in the file.

Local functions, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zero_bnb.errors import CheckpointFormatError

__all__ = ["DERIVED_PARAMS_KEY", "derived_entries", "restore_derived"]

#: Key, in DeepSpeed's model-states file, of ``{state-dict key: [master-weight name, dtype]}``.
DERIVED_PARAMS_KEY = "zero_bnb_derived_params"
_DTYPES = frozenset({"float32", "bfloat16", "float16", "float64"})


def derived_entries(module: torch.nn.Module, trained: dict[torch.nn.Parameter, str]) -> dict[str, list[str]]:
    """State-dict keys of ``module`` whose value is a trained parameter: key -> [its master name, dtype].

    ``trained`` maps each parameter ZeRO trains to its name in the checkpoint's manifest; tied
    parameters appear under every key that holds them.
    """
    by_id = {id(param): name for param, name in trained.items()}
    return {
        key: [by_id[id(value)], str(value.dtype).removeprefix("torch.")]
        for key, value in module.state_dict(keep_vars=True).items()
        if isinstance(value, torch.nn.Parameter) and id(value) in by_id
    }


def restore_derived(model_states: dict, master: Callable[[str], torch.Tensor]) -> None:
    """Put the dropped parameters back into a loaded model-states dict, in place.

    Args:
        model_states: what ``torch.load`` returned for DeepSpeed's model-states file.
        master: the fp32 master weight (in its parameter's shape) of a manifest name.
    """
    derived = model_states.pop(DERIVED_PARAMS_KEY, None) or {}
    module = model_states.get("module")
    if not isinstance(derived, dict) or not isinstance(module, dict) or not all(
            isinstance(key, str) and isinstance(entry, (list, tuple)) and len(entry) == 2
            and isinstance(entry[0], str) and entry[1] in _DTYPES for key, entry in derived.items()):
        raise CheckpointFormatError(
            f"the model file's {DERIVED_PARAMS_KEY!r} must map state-dict keys to [parameter name, dtype] and the file "
            f"must hold a 'module' state dict; it was edited or not written by zero_bnb"
        )
    cache: dict[str, torch.Tensor] = {}
    for key, (name, dtype) in derived.items():
        if name not in cache:
            cache[name] = master(name)
        model_states["module"][key] = cache[name].to(getattr(torch, dtype))
