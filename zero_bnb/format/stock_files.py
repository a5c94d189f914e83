"""DeepSpeed's own checkpoint files, read safely: ZeRO optimizer files of every rank and the model file.

Stock DeepSpeed writes ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per DP rank (or
``bf16_zero_pp_rank_...`` for its BF16 optimizer) and ``mp_rank_00_model_states.pt``; zero_bnb
checkpoints keep DeepSpeed's model file too. Every read goes through
:func:`~zero_bnb.format.unpickle.safe_load`. Local, single process.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from zero_bnb.errors import CheckpointFormatError, malformed
from zero_bnb.format.manifest import ParamEntry
from zero_bnb.format.paths import check_name
from zero_bnb.format.unpickle import check_checkpoint_file, safe_load

__all__ = ["MODEL_STATES", "NOT_THE_DP_SIZE", "UNIVERSAL_STATE", "WRITTEN_BY_ZERO_BNB", "check_same_save", "fp32_partitions",
           "group_hyperparameters", "group_states", "is_stage3", "is_stage3_model_file", "model_file_of",
           "model_states_files", "param_entries", "read_rank_files", "stage3_model_states", "stock_dp_world_size",
           "zero_file_names"]

MODEL_STATES = "mp_rank_00_model_states.pt"
#: The file that marks a DeepSpeed universal checkpoint's tag folder (relative to it).
UNIVERSAL_STATE = os.path.join("zero", "optimizer_state.pt")

_BNB_WRAPPED = "__bnb_optimizer_quant_state__"
_STAGE3_FLATS = "fp32_flat_groups"
_STAGE3_MODEL_PREFIX = "zero_pp_rank_"

#: The sentence a plain DeepSpeed engine shows when it is given a zero_bnb checkpoint (the user forgot
#: ``zero_bnb.enable()``). zero_bnb stores it, as plain text, in the model file's ``dp_world_size``.
WRITTEN_BY_ZERO_BNB = "this checkpoint was written by zero_bnb; call zero_bnb.enable() (or import zero_bnb.lightning)"


#: Said first: DeepSpeed's message around the sentence goes on "... but the current world size is N ... not currently
#: supported", misleading at the same DP size (issue 42).
NOT_THE_DP_SIZE = "zero_bnb: the DP size is not the problem, whatever this message says next"


def stock_dp_world_size(dp_size: int, stage3: bool = False) -> str:
    """What a zero_bnb checkpoint's model file holds under ``dp_world_size`` (stock DeepSpeed writes the int).

    A plain ``DeepSpeedEngine.load_checkpoint`` compares it with its own DP size before it reads any
    optimizer file (``_load_zero_checkpoint``); a string never equals the int, so at every DP size
    it raises ``ZeRORuntimeException("The checkpoint being loaded used a DP world size of <this>
    ...")``, which then names zero_bnb and the fix instead of a missing ``zero_pp_rank_*`` file.
    It says first that the DP size is not the problem: DeepSpeed's text around it says so even at the same DP size.
    ``load_module_only=True`` and ``load_optimizer_states=False`` never compare it, so stock readers
    of the module weights are unaffected. At ZeRO stage 3 (``stage3``) the model file holds no weights,
    so the sentence points to ``zero-bnb convert --to universal`` and ``zero_to_fp32`` instead.
    Plain data: nothing executes when it is read.
    """
    if stage3:
        reader = ("stock DeepSpeed cannot read its ZeRO-3 weights (they are in zero_bnb's files): convert it with "
                  "'zero-bnb convert TAG_FOLDER --to universal OUT' or export them with the folder's zero_to_fp32.py")
    else:
        reader = "stock DeepSpeed reads only its module weights, with load_module_only=True"
    return (f"{dp_size} [{NOT_THE_DP_SIZE}: {WRITTEN_BY_ZERO_BNB} before the engine is built, and it loads at this and "
            f"any other DP size; {reader}. DeepSpeed's generic text goes on:]")


def _unwrap(state: dict[str, Any]) -> dict[str, Any]:
    state = dict(state)
    state.update(state.pop(_BNB_WRAPPED, {}))
    return state


def is_stage3(optimizer_sd: dict[str, Any]) -> bool:
    """Whether a stock rank file's ``optimizer_state_dict`` was written at ZeRO stage 3 (``_rigid_state_dict`` of
    ``runtime/zero/stage3.py``: the base optimizer's state under ``optimizer_state_dict``, one fp32 flat partition
    per sub-group under ``fp32_flat_groups``) rather than at stage 1/2 (``base_optimizer_state``,
    ``single_partition_of_fp32_groups``, one per param group)."""
    return _STAGE3_FLATS in optimizer_sd


def fp32_partitions(optimizer_sd: dict[str, Any]) -> list[Any]:
    """This rank's fp32 flat partition of every flat group (stages 1/2) or sub-group (stage 3)."""
    return optimizer_sd[_STAGE3_FLATS if is_stage3(optimizer_sd) else "single_partition_of_fp32_groups"]


def _base_state(optimizer_sd: dict[str, Any]) -> Any:
    return optimizer_sd["optimizer_state_dict" if is_stage3(optimizer_sd) else "base_optimizer_state"]


def group_states(optimizer_sd: dict[str, Any]) -> list[dict[str, Any]]:
    """Per flat group (stage 3: per sub-group, in order) the base-optimizer state of one stock rank file (rigid or
    elastic layout)."""
    base = _base_state(optimizer_sd)
    if isinstance(base, dict):  # rigid: the base optimizer's own state_dict(), one index per flat tensor in order
        return [_unwrap(base["state"].get(index, {})) for group in base["param_groups"] for index in group["params"]]
    return [_unwrap(group_state) for group_state in base]  # elastic: one dict per group


def group_hyperparameters(optimizer_sd: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Per flat group (stage 3: per sub-group) the hyper-parameters of the param group holding it; ``None`` for
    DeepSpeed's elastic layout, which stores none."""
    base = _base_state(optimizer_sd)
    if not isinstance(base, dict):
        return None
    return [{k: v for k, v in group.items() if k != "params"} for group in base["param_groups"]
            for _ in group["params"]]


def zero_file_names(tag_folder: str) -> list[str]:
    """Stock DeepSpeed ZeRO optimizer files of ``tag_folder`` (tensor-parallel rank 0), in DP-rank order."""
    for prefix in ("zero_pp_rank", "bf16_zero_pp_rank"):
        names = []
        while os.path.lexists(name := os.path.join(tag_folder, f"{prefix}_{len(names)}_mp_rank_00_optim_states.pt")):
            names.append(name)
        if names:
            return names
    return []


def read_rank_files(names: list[str]) -> list[dict[str, Any]]:
    """The ``optimizer_state_dict`` of each stock rank file.

    Raises:
        CheckpointCorruptError: a file cannot be read (named).
    """
    rank_sds = []
    for name in names:
        loaded = safe_load(name, "stock DeepSpeed optimizer file", deepspeed_classes=True)
        if not isinstance(loaded, dict) or not isinstance(loaded.get("optimizer_state_dict"), dict):
            raise CheckpointFormatError(f"stock DeepSpeed optimizer file {name} holds no optimizer_state_dict; it is "
                                        f"not a DeepSpeed ZeRO checkpoint file")
        rank_sds.append(loaded["optimizer_state_dict"])
    check_same_save(names, rank_sds)
    return rank_sds


def _plain(value: Any) -> Any:
    """A comparable form of a counter or scalar (a tensor's items, an enum's value, an object's fields)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):
        return _plain(value.value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {key: _plain(item) for key, item in sorted(vars(value).items()) if not key.startswith("_")}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _shared_record(optimizer_sd: dict[str, Any]) -> dict[str, Any]:
    """What every rank file of one save holds alike: each flat group's step counter(s) (a rank whose partition of
    a group is empty has none), its hyper-parameters, and the ZeRO wrapper's scalars and version."""
    steps = [_plain(state.get("step")) for state in group_states(optimizer_sd)]
    hyper = group_hyperparameters(optimizer_sd)
    scalars = {key: _plain(optimizer_sd.get(key)) for key in ("loss_scaler", "dynamic_loss_scale", "overflow",
                                                              "zero_stage", "partition_count", "ds_version")}
    return {"steps": steps, "hyper": _plain(hyper), "scalars": scalars}


def check_same_save(names: list[str], rank_sds: list[dict[str, Any]]) -> None:
    """Refuse rank files of one tag that are not from one save: every step counter and everything else the files
    share (hyper-parameters, loss scaler, ZeRO stage and version) must agree. Stock DeepSpeed files carry no rank
    id and no save id, so two ranks' files of the same step swapped, or a file copied from another run at the same
    step with the same settings, cannot be told apart here.

    Raises:
        CheckpointFormatError: names the files that disagree, what differs, and the fix.
    """
    first, *others = [_shared_record(sd) for sd in rank_sds]
    for name, record in zip(names[1:], others):
        for group, (a, b) in enumerate(zip(first["steps"], record["steps"])):
            if a is not None and b is not None and a != b:
                raise CheckpointFormatError(
                    f"stock DeepSpeed rank files {names[0]} and {name} are not from the same save: group "
                    f"{group}'s step counter is {a} in the first and {b} in the second (a rank's file was left from "
                    f"another save, or copied from one). Stock files carry no rank or save id; copy the complete tag "
                    f"folder as DeepSpeed wrote it, or load an earlier tag"
                )
        differs = (["hyper-parameters"] if first["hyper"] != record["hyper"] else []) + sorted(
            key for key, value in first["scalars"].items() if record["scalars"][key] != value)
        if differs:
            raise CheckpointFormatError(
                f"stock DeepSpeed rank files {names[0]} and {name} are not from the same save: their "
                f"{', '.join(differs)} differ. Copy the complete tag folder as DeepSpeed wrote it, or load an "
                f"earlier tag"
            )


def stage3_model_states(rank: int) -> str:
    """DeepSpeed's model-states file of DP rank ``rank`` at ZeRO stage 3 (every rank writes one)."""
    return f"{_STAGE3_MODEL_PREFIX}{rank}_{MODEL_STATES}"


def is_stage3_model_file(name: str) -> bool:
    """Whether DeepSpeed's model-states file ``name`` (a base name, as :func:`model_file_of` returns) is one DP rank's
    file of a ZeRO stage-3 save (:func:`stage3_model_states`) rather than the one :data:`MODEL_STATES` of stages 1/2:
    the one place that asks "is this a stage-3 checkpoint?" of a checkpoint's file names."""
    rank = name.removeprefix(_STAGE3_MODEL_PREFIX).removesuffix(f"_{MODEL_STATES}")
    return rank.isdigit() and name == stage3_model_states(int(rank))


def model_states_files(tag_folder: str) -> dict[str, str]:
    """``{file name: path}`` of DeepSpeed's model-states files in ``tag_folder``: one ``mp_rank_00_model_states.pt``
    (ZeRO stages 1/2), or one per DP rank (stage 3, :func:`stage3_model_states`)."""
    files = sorted(glob.glob(os.path.join(glob.escape(tag_folder), "*model_states.pt")))
    names = sorted(os.path.basename(f) for f in files)
    if names != [MODEL_STATES] and not (names and names == sorted(map(stage3_model_states, range(len(names))))):
        raise CheckpointFormatError(
            f"{tag_folder} holds model-states files {names}; the tools handle one {MODEL_STATES} (ZeRO stages 1 "
            f"and 2) or one {stage3_model_states(0).replace('_0_', '_<rank>_')} per DP rank (stage 3), i.e. no "
            f"tensor or pipeline parallelism"
        )
    for file in files:
        check_checkpoint_file(file, "DeepSpeed model file", tag_folder)  # it may be copied byte for byte
    return {os.path.basename(file): file for file in files}


def model_file_of(tag_folder: str, files: dict[str, str] | None = None) -> tuple[str, str]:
    """Name and path of the model-states file the tools read: ``mp_rank_00_model_states.pt``, or at ZeRO stage 3
    rank 0's (the ranks' files differ only in their empty parameter placeholders). ``files``: the folder's
    :func:`model_states_files`, when the caller has them already."""
    files = model_states_files(tag_folder) if files is None else files
    name = MODEL_STATES if MODEL_STATES in files else stage3_model_states(0)
    return name, files[name]


def param_entries(model_file: str) -> list[tuple[ParamEntry, ...]]:
    """Per flat group, its parameters with offsets, from DeepSpeed's ``param_shapes`` record."""
    model_states = safe_load(model_file, "DeepSpeed model file", deepspeed_classes=True)
    params = []
    with malformed(f"DeepSpeed model file {model_file}"):
        for g, group_shapes in enumerate(model_states["param_shapes"]):
            offset, entries = 0, []
            for name, shape in group_shapes.items():
                entry = ParamEntry(check_name(name, f"{model_file}: param_shapes[{g}] name"),
                                   tuple(int(size) for size in shape), offset)
                if any(size < 0 for size in entry.shape):
                    raise CheckpointFormatError(f"{model_file}: parameter {name!r} has shape {entry.shape}")
                entries.append(entry)
                offset += entry.numel
            params.append(tuple(entries))
    return params
