"""DeepSpeed's model-states file, as a load will apply it: every entry DeepSpeed's loader touches, checked first.

DeepSpeed's ``_load_checkpoint`` replaces the module weights, then reads the LR scheduler state,
the step counters and the world sizes from this file; an entry it cannot use fails half-way,
with the module already replaced. :func:`check_model_states` refuses such a file before anything
is applied, and :func:`plan_trained_weights` leaves the trained module weights to the load's
apply phase, which sets them to the master weights cast to the module's dtype (whatever dtype
the checkpoint's module was in).

Local functions, no collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy
import torch

from zero_bnb.errors import CheckpointFormatError, CheckpointMismatchError

__all__ = ["check_model_states", "plan_trained_weights", "saved_zero_stage", "trained_shapes"]

#: Counters DeepSpeed sets from the model file on a full load: name -> smallest valid value.
_COUNTERS = {"global_steps": 0, "skipped_steps": 0, "mp_world_size": 1}


def saved_zero_stage(model_states: Any) -> int | None:
    """The ZeRO stage the model file's run had (DeepSpeed saves its config under ``ds_config``); ``None`` when the
    file does not say (an edited file, or a writer that drops the config). For messages only: nothing depends on it."""
    config = model_states.get("ds_config") if isinstance(model_states, dict) else None
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return stage if type(stage) is int and 0 <= stage <= 3 else None


def _check_module(module: torch.nn.Module, saved: Any, model_file: str, strict: bool,
                  trained: dict[str, tuple[int, ...]]) -> None:
    if not isinstance(saved, dict):
        raise CheckpointFormatError(f"{model_file} holds no 'module' state dict; it is not a DeepSpeed model file")
    current = module.state_dict()
    wrong = sorted(f"{key}: saved {type(saved[key]).__name__ if not isinstance(saved[key], torch.Tensor) else saved[key].dtype}, "
                   f"model {value.dtype}" for key, value in current.items() if key in saved and (
                       not isinstance(saved[key], torch.Tensor)
                       or saved[key].dtype.is_floating_point != value.dtype.is_floating_point
                       or saved[key].dtype.is_complex))
    if wrong:
        raise CheckpointFormatError(f"{model_file}: module entries that cannot be loaded into the model's tensors "
                                    f"({wrong[:5]}); the file was edited or not written by DeepSpeed")
    # A trained parameter's entry is planned from its master weight; ZeRO-3 saves it as an empty placeholder, so a
    # checkpoint of either kind (stage 1/2 or 3) may hold either form.
    expected = {key: {trained[key], (0,)} if key in trained else {tuple(value.shape)} for key, value in current.items()}
    shapes = sorted(f"{key}: saved {tuple(saved[key].shape)}, model {trained.get(key, tuple(current[key].shape))}"
                    for key in current if key in saved and tuple(saved[key].shape) not in expected[key])
    missing = sorted(set(current) - set(saved)) if strict else []
    unexpected = sorted(set(saved) - set(current)) if strict else []
    if shapes or missing or unexpected:
        detail = "; ".join(part for part in (
            f"shape differs: {shapes}" if shapes else "",
            f"missing in checkpoint: {missing[:10]}" if missing else "",
            f"not in model: {unexpected[:10]}" if unexpected else "",
        ) if part)
        raise CheckpointMismatchError(
            f"the module weights in {model_file} do not fit the running model ({detail}). Build the model that "
            f"wrote the checkpoint{', or load with load_module_strict=False' if not shapes else ''}"
        )


def _check_counters(model_states: dict, model_file: str, module_only: bool) -> None:
    # DeepSpeed reads dp_world_size on every load, but only its own ZeRO loader (which zero_bnb replaces) uses it;
    # zero_bnb stores a sentence there for plain DeepSpeed engines (format.stock_files.stock_dp_world_size).
    problems = [] if "dp_world_size" in model_states else ["dp_world_size=<missing>"]
    counters = {} if module_only else _COUNTERS
    problems += [f"{name}={model_states.get(name, '<missing>')!r:.40} (must be an integer >= {least})"
                 for name, least in counters.items()
                 if not (isinstance(model_states.get(name), int) and not isinstance(model_states.get(name), bool)
                         and model_states[name] >= least)]
    samples = model_states.get("global_samples", 0)
    if not module_only and not (isinstance(samples, int) and not isinstance(samples, bool) and samples >= 0):
        problems.append(f"global_samples={samples!r:.40} (must be an integer >= 0)")
    if problems:
        raise CheckpointFormatError(f"{model_file} holds values DeepSpeed cannot resume from: {'; '.join(problems)}; "
                                    f"the file was edited or not written by DeepSpeed")


def _check_scheduler(scheduler: Any, saved: Any, model_file: str) -> None:
    if scheduler is None and saved is None:
        return
    if scheduler is None:
        keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointMismatchError(
            f"{model_file} holds LR scheduler state ({keys!s:.120}) but the engine has no LR scheduler; pass the "
            f"scheduler to initialize (lr_scheduler= or the config's 'scheduler') to resume it, or load with "
            f"load_lr_scheduler_states=False to leave it out"
        )
    name = type(scheduler).__name__
    if saved is None:
        raise CheckpointMismatchError(
            f"the engine has an LR scheduler ({name}) but {model_file} holds none (it was saved without one); load "
            f"with load_lr_scheduler_states=False to keep the engine's scheduler as it is, or build the engine "
            f"without one"
        )
    expected = set(scheduler.state_dict())
    if not isinstance(saved, dict) or not expected <= set(saved):
        have = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointMismatchError(
            f"the LR scheduler state in {model_file} ({have!s:.160}) lacks what the engine's {name} needs "
            f"({sorted(expected - set(saved)) if isinstance(saved, dict) else sorted(expected)!s:.160}); it was "
            f"saved with another scheduler. Build the engine with that scheduler, or load with "
            f"load_lr_scheduler_states=False"
        )


def _data_efficiency_loaders(engine: Any, model_states: dict) -> list[tuple[str, str, Any, str]]:
    """The data-efficiency entries DeepSpeed's loader would apply: (key, what, object it loads them into, config)."""
    found = []
    scheduler = getattr(engine, "random_ltd_scheduler", None)
    if "random_ltd" in model_states and scheduler is not None and engine.random_ltd_enabled():
        found.append(("random_ltd", "random-LTD scheduler", scheduler, "data_efficiency.data_routing.random_ltd"))
    loader = getattr(engine, "training_dataloader", None)
    if "data_sampler" in model_states and loader is not None and engine.curriculum_learning_enabled():
        found.append(("data_sampler", "curriculum data sampler", loader.data_sampler,
                      "data_efficiency.data_sampling.curriculum_learning"))
    return found


def _check_data_efficiency(engine: Any, model_states: dict, model_file: str) -> None:
    for key, what, target, config in _data_efficiency_loaders(engine, model_states):
        saved, current = model_states[key], target.state_dict()
        if not isinstance(saved, dict) or not set(current) <= set(saved):
            have = sorted(saved) if isinstance(saved, dict) else saved
            raise CheckpointMismatchError(
                f"the engine's {what} would load {model_file}'s {key!r} entry, which holds {have!s:.120} instead of "
                f"its state ({sorted(current)!s:.160}); the checkpoint was saved without {config}. Disable {config} "
                f"in the config to resume from it, or load with load_module_only=True"
            )
        wrong = [name for name, value in current.items() if not _same_kind(value, saved[name])]
        if wrong:
            raise CheckpointFormatError(
                f"{model_file}: the {what} state {key!r} holds values of the wrong kind for {wrong[:5]} "
                f"({ {name: saved[name] for name in wrong[:5]}!s:.200}); the file was edited or not written by DeepSpeed"
            )


def _same_kind(current: Any, saved: Any) -> bool:
    """Whether ``saved`` can replace ``current`` in a data-efficiency state: numbers for numbers, lists for lists,
    a valid NumPy random state for one."""
    if isinstance(current, (int, float)) and not isinstance(current, bool):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(current, tuple) and current and current[0] == "MT19937":  # np.random.get_state()
        try:
            numpy.random.RandomState().set_state(saved)  # a throwaway generator: the global one is untouched
        except (TypeError, ValueError):
            return False
        return True
    return isinstance(saved, type(current)) if isinstance(current, (list, dict)) else True


def check_model_states(engine: Any, model_states: Any, model_file: str, *, strict: bool, module_only: bool,
                       scheduler_states: bool, trained: dict[str, tuple[int, ...]]) -> None:
    """Refuse a model file DeepSpeed's loader would fail on half-way, before anything is applied.

    Checks the module entries (tensors of the model's kind and shape; ``trained`` maps the state-dict
    keys of trained parameters, whose entries the load sets from their master weights, to their whole
    shapes, and these may also be ZeRO-3's empty placeholders; every key with ``strict``), the counters
    DeepSpeed sets (``global_steps``, ``skipped_steps``, world sizes: non-negative integers), with
    ``scheduler_states`` that the checkpoint has LR scheduler state exactly when the engine has a scheduler,
    holding what that scheduler's ``load_state_dict`` reads, and the ``random_ltd`` and ``data_sampler``
    entries DeepSpeed hands to the engine's random-LTD scheduler and curriculum data sampler when it has them
    (a save without them stores ``None``).

    Raises:
        CheckpointFormatError: a malformed entry, naming it and its value.
        CheckpointMismatchError: the module or scheduler does not fit the engine, naming the fix.
    """
    if not isinstance(model_states, dict):
        raise CheckpointFormatError(f"{model_file} is not a DeepSpeed model file (it holds a "
                                    f"{type(model_states).__name__})")
    _check_module(engine.module, model_states.get("module"), model_file, strict, trained)
    _check_counters(model_states, model_file, module_only)
    if scheduler_states and not module_only:
        _check_scheduler(getattr(engine, "lr_scheduler", None), model_states.get("lr_scheduler"), model_file)
    if not module_only:
        _check_data_efficiency(engine, model_states, model_file)


def plan_trained_weights(module: torch.nn.Module, trained: dict[torch.nn.Parameter, str], model_states: dict,
                         master: Callable[[str], torch.Tensor] | None = None) -> None:
    """Set every trained parameter's entry of ``model_states["module"]``, in place, for DeepSpeed's module loader.

    Without ``master`` (a load), the entry becomes the live parameter itself, so DeepSpeed's copy
    of it is a no-op and no rank reads another rank's master weights: the load's apply phase then
    sets the module weights to the masters cast to the module's dtype
    (``PartitionedOptimizer.cast_masters_into_module``). With ``master`` (a name's whole fp32
    master weight; for a ``custom_load_fn``, which is handed these entries), the entry becomes the
    master weight cast to the module's dtype: the same values, bit for bit.

    ``trained`` maps the parameters ZeRO trains to their checkpoint names. Buffers and frozen
    parameters keep the file's values.
    """
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter) and value in trained:
            model_states["module"][key] = value if master is None else master(trained[value]).to(value.dtype)


def trained_shapes(module: torch.nn.Module, trained: dict[torch.nn.Parameter, str]) -> dict[str, tuple[int, ...]]:
    """State-dict key -> whole shape of every trained parameter (``ds_shape`` for a ZeRO-3 partitioned one)."""
    return {key: tuple(getattr(value, "ds_shape", value.shape))
            for key, value in module.state_dict(keep_vars=True).items()
            if isinstance(value, torch.nn.Parameter) and value in trained}
