"""Checkpoint conversion as Python functions: zero_bnb <-> DeepSpeed universal, and stock DeepSpeed rescue.

(``inspect`` and ``export`` live in :mod:`zero_bnb.tools.views`.) All functions run in one process, without a
DeepSpeed engine or ``torch.distributed``. The command line (``zero-bnb inspect|verify|convert|export``) is a thin
layer over them.

Paths: ``path`` may be a save folder (holding ``latest`` / ``latest_universal`` and tag
folders; ``tag=None`` then follows the pointer file) or one tag folder. Outputs of
:func:`from_universal` and :func:`rescue_stock` are save folders (the result goes to
``out_dir/<tag>`` and ``latest`` is updated); the output of :func:`to_universal` is the
universal tag folder itself, as for DeepSpeed's ``ds_to_universal --output_folder``, and
``latest_universal`` goes into its parent. Outputs are committed atomically under the
folder's lock, never overlap the input, and replace an existing output only with ``force``.
Every input file is read with ``weights_only=True``.
"""

from __future__ import annotations

import inspect
import os
from importlib import metadata
from typing import Any

import bitsandbytes as bnb
import torch
from tqdm import tqdm

from zero_bnb.checkpoint.commit import local_commit
from zero_bnb.checkpoint.derived import restore_derived
from zero_bnb.checkpoint.stock_import import StockCheckpoint
from zero_bnb.checkpoint.whole import FullGroup, gather_full, moments, per_parameter
from zero_bnb.core.layout import GroupGeometry
from zero_bnb.core.state_spec import (
    BNB_ADAGRAD,
    BNB_ADAM,
    BNB_ADEMAMIX,
    BNB_LION,
    BNB_RMSPROP,
    BNB_SGD,
    UNIVERSAL_TARGETS,
    OptimizerSpec,
    StateRule,
    UnsupportedOptimizerError,
    spec_for_class,
    spec_named,
)
from zero_bnb.errors import CheckpointFormatError, CheckpointUsageError, malformed
from zero_bnb.format.durable import makedirs, save_torch
from zero_bnb.format.manifest import ParamEntry, StateEntry
from zero_bnb.format.stock_files import (
    UNIVERSAL_STATE,
    group_states,
    is_stage3,
    is_stage3_model_file,
    model_file_of,
    model_states_files,
    param_entries,
    read_rank_files,
    zero_file_names,
)
from zero_bnb.format.tags import LATEST_NAME, UNIVERSAL_LATEST, check_new_tag
from zero_bnb.format.unpickle import safe_load
from zero_bnb.format.wrapper_state import LOSS_SCALER, WRAPPER_SCALARS, plain_wrapper
from zero_bnb.tools.checkpoint_paths import locate, open_verified
from zero_bnb.tools.offline import QuantizationReport, quantize_moment, write_checkpoint
from zero_bnb.tools.outputs import check_output_folder

__all__ = ["STOCK_FORMAT", "TARGET_OPTIMIZERS", "from_universal", "rescue_stock", "to_universal"]

#: ``Manifest.migrated_from["format"]`` of a checkpoint :func:`rescue_stock` wrote.
STOCK_FORMAT = "stock DeepSpeed"

# Keys of DeepSpeed's universal checkpoint files (deepspeed.checkpoint.constants), part of their format.
PARAM, CAT_DIM, PARAM_GROUPS = "param", "cat_dim", "param_groups"
#: Where stock DeepSpeed's ZeRO-3 universal loader reads the step and hyper-parameters in ``zero/optimizer_state.pt``
#: (``runtime/zero/stage3.py`` ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``: ``[...]["state"][0]["step"]``
#: and ``[...][PARAM_GROUPS][0]``).
OPTIMIZER_STATE_DICT = "optimizer_state_dict"

TARGET_OPTIMIZERS = UNIVERSAL_TARGETS
_ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
#: What the user of stock DeepSpeed's ZeRO-3 universal loader (0.19.8) must undo after ``load_checkpoint``.
_STOCK_ZERO3_NOTE = (
    "stock DeepSpeed's ZeRO-3 universal loader gives all sub-groups one shared step tensor, which torch's Adam then "
    "advances once per sub-group: after load_checkpoint give each state its own (for s in "
    "engine.optimizer.optimizer.state.values(): s['step'] = s['step'].clone())")
#: The moments a DeepSpeed universal checkpoint holds for torch's Adam/AdamW, which stock DeepSpeed loads it into.
_UNIVERSAL_MOMENTS = ("exp_avg", "exp_avg_sq")


def _output_tag_folder(out: str) -> tuple[str, str]:
    """``(save folder, tag)`` of the tag folder ``out`` (``ckpt/global_step3_universal``)."""
    out_dir, out_tag = os.path.split(os.path.normpath(out))
    return out_dir or ".", check_new_tag(out_tag)


def to_universal(path: str, out: str, *, tag: str | None = None, force: bool = False,
                 progress: bool = False) -> dict[str, Any]:
    """Write a zero_bnb checkpoint as a DeepSpeed universal checkpoint in the tag folder ``out``.

    ``latest_universal`` in ``out``'s parent then names it (DeepSpeed's convention, as for
    ``ds_to_universal --output_folder``). Every parameter gets ``fp32.pt``, ``exp_avg.pt``,
    ``exp_avg_sq.pt`` (8-bit moments dequantized exactly) and ``step.pt``;
    ``zero/optimizer_state.pt`` holds the Adam hyper-parameters and loss scaler. Stock DeepSpeed
    loads it with ``checkpoint.load_universal: true`` into ``torch.optim.AdamW`` (or ``Adam``)
    at any DP size, at the ZeRO stage the checkpoint was written at (the model files differ:
    one ``mp_rank_00_model_states.pt`` at stages 1/2, one per rank at stage 3, all copied).

    Raises:
        CheckpointUsageError: ``out`` overlaps the input, exists (without ``force``) or has a
            reserved name; nothing was read or written.
    """
    out_dir, out_tag = _output_tag_folder(out)
    save_dir, folder_tag = locate(path, tag)
    check_output_folder(os.path.join(out_dir, out_tag), source_tag_folder=os.path.join(save_dir, folder_tag),
                        force=force)
    folder_tag, reader = open_verified(save_dir, folder_tag, command="convert")
    manifest = reader.manifest
    spec = spec_named(manifest.optimizer_spec)
    if set(spec.moment_names.values()) != set(_UNIVERSAL_MOMENTS):
        raise CheckpointUsageError(
            f"{reader.tag_folder} was written by {spec.name}, whose moments {sorted(spec.moment_names.values())} "
            f"are not Adam's {list(_UNIVERSAL_MOMENTS)}: stock DeepSpeed could load its universal checkpoint into no "
            f"optimizer. Keep it as a zero_bnb checkpoint (it loads at any DP size), or export the weights and "
            f"moments with `zero-bnb export {path} --to fp32 OUT.safetensors --moments`"
        )
    model_files = model_states_files(reader.tag_folder)
    stage3 = is_stage3_model_file(model_file_of(reader.tag_folder, model_files)[0])
    groups = gather_full(reader)
    steps = sorted({float(group.state.get("step", 0)) for group in groups})
    if stage3 and len(steps) > 1:
        raise CheckpointUsageError(
            f"{reader.tag_folder} holds groups at different steps {steps}; stock DeepSpeed's ZeRO-3 universal loader "
            f"gives every parameter one step. Keep it as a zero_bnb checkpoint (it loads at any DP size)"
        )
    weights = {name: value for group in groups for name, value in per_parameter(group, group.fp32).items()}
    model_contents: dict[str, dict[str, Any]] = {}  # model-states file name -> the contents to write
    for name, source in model_files.items():
        model_states = reader.load(name, "DeepSpeed model file", deepspeed_classes=True)  # the verified bytes
        with malformed(f"DeepSpeed model file {source}"):
            restore_derived(model_states, weights.__getitem__)  # DeepSpeed reads the module weights from this file
        model_states["dp_world_size"] = manifest.dp_world_size  # stock DeepSpeed's int (zero_bnb's file names it)
        model_contents[name] = model_states
    param_groups, written = [], 0
    with local_commit(out_dir, out_tag, latest_name=UNIVERSAL_LATEST, replace=force) as staging:
        zero_folder = os.path.join(staging, "zero")
        for index, group in enumerate(tqdm(groups, desc="groups", unit="group", disable=not progress)):
            tensors = {"fp32": group.fp32, **moments(group, spec, manifest.block_size)}
            sliced = {key: per_parameter(group, flat) for key, flat in tensors.items()}
            step = group.state.get("step", 0)
            for param in group.params:
                folder = os.path.join(zero_folder, param.name)
                makedirs(folder)
                for key, by_name in sliced.items():
                    save_torch({PARAM: by_name[param.name].clone(), CAT_DIM: 0}, os.path.join(folder, f"{key}.pt"),
                               root=staging)
                save_torch(torch.tensor(float(step)), os.path.join(folder, "step.pt"), root=staging)
                written += 1
            hyper = {k: group.param_group[k] for k in _ADAM_HYPERPARAMETERS if k in group.param_group}
            param_groups.append({**hyper, "params": [index]})
        wrapper = dict(reader.replicated.wrapper)
        if wrapper.get(LOSS_SCALER) is not None:  # fp16: stock DeepSpeed unpickles its own loss-scaler object here
            from zero_bnb.ds.loss_scaler import live_wrapper  # the one conversion that imports DeepSpeed

            wrapper = live_wrapper(wrapper)
        optimizer_state = {name: wrapper.get(name) for name in WRAPPER_SCALARS}
        optimizer_state.update({"ds_version": metadata.version("deepspeed"), "zero_stage": 3 if stage3 else 1,
                                "partition_count": manifest.dp_world_size, PARAM_GROUPS: param_groups})
        if stage3:  # where stock stage 3 reads them (the one step is a tensor, as torch's Adam keeps it)
            optimizer_state[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": torch.tensor(steps[0] if steps else 0.0)}},
                                                     PARAM_GROUPS: param_groups}
        save_torch(optimizer_state, os.path.join(zero_folder, "optimizer_state.pt"), root=staging)
        for name, model_states in model_contents.items():
            save_torch(model_states, os.path.join(staging, name), root=staging)
    report = {"output": os.path.join(out_dir, out_tag), "parameters": written, "zero_stage": 3 if stage3 else "1 or 2",
              "moments": sorted(spec.moment_names.values()),
              "dropped_hyperparameters": sorted({k for g in groups for k in g.param_group} - {*_ADAM_HYPERPARAMETERS})}
    if stage3:
        report["stock_zero3_note"] = _STOCK_ZERO3_NOTE + (
            f"; and it gives every param group the first one's hyper-parameters "
            f"({ {k: v for k, v in param_groups[0].items() if k != 'params'} }): set the others' again"
            if len({repr(sorted((k, v) for k, v in g.items() if k != "params")) for g in param_groups}) > 1 else "")
    return report


def _load_universal(path: str, tag: str | None) -> tuple[str, str, dict, list[tuple[ParamEntry, ...]]]:
    save_dir, folder_tag = locate(path, tag, latest=UNIVERSAL_LATEST)
    tag_folder = os.path.join(save_dir, folder_tag)
    state_path = os.path.join(tag_folder, UNIVERSAL_STATE)
    if not os.path.isfile(state_path):
        raise CheckpointFormatError(f"{tag_folder} is not a DeepSpeed universal checkpoint: {state_path} is missing")
    optimizer_state = safe_load(state_path, "universal optimizer-state file", deepspeed_classes=True)
    params = param_entries(model_file_of(tag_folder)[1])
    with malformed(f"universal optimizer-state file {state_path}"):
        if len(optimizer_state[PARAM_GROUPS]) != len(params):
            raise CheckpointFormatError(f"{state_path} has {len(optimizer_state[PARAM_GROUPS])} parameter groups, "
                                        f"the model file {len(params)}; the checkpoint is inconsistent")
    return tag_folder, folder_tag, optimizer_state, params


def _read_param_file(tag_folder: str, param: ParamEntry, key: str) -> torch.Tensor:
    path = os.path.join(tag_folder, "zero", param.name, f"{key}.pt")
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"the universal checkpoint has no {key} for parameter {param.name!r} "
                                    f"({path} is missing)")
    value = safe_load(path, "universal parameter file", root=tag_folder)
    with malformed(f"universal parameter file {path}"):
        if key == "step":
            return float(value)
        tensor = value[PARAM]
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != param.numel:
            raise CheckpointFormatError(f"{path} holds {getattr(tensor, 'shape', type(tensor).__name__)}, but "
                                        f"parameter {param.name!r} has shape {param.shape}")
        return tensor.reshape(-1).float()


def _fresh_bnb_state(optimizer_name: str, numel: int, hyper: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state and param group ``bnb.optim.<optimizer_name>`` creates for the DP=1 partition of a group."""
    partition = GroupGeometry(numel, 1, BNB_ADAM.block_size).partition_numel
    param = torch.nn.Parameter(torch.empty(partition))
    optimizer = getattr(bnb.optim, optimizer_name)([param], **hyper)
    BNB_ADAM.init_state(optimizer, 0, param)
    return optimizer.state[param], {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}


def _entries(state: dict[str, Any], reason: str, spec: OptimizerSpec = BNB_ADAM) -> tuple[StateEntry, ...]:
    return tuple(StateEntry(key, spec.kinds[key], "", reason) for key in sorted(state))


def _stock_family(rank_sds: list[dict[str, Any]], optimizer: str | None, where: str) -> OptimizerSpec:
    """The bitsandbytes family of a stock checkpoint: named by ``optimizer``, or told by its state keys.

    Raises:
        CheckpointUsageError: a one-state family (Lion, SGD, RMSprop, Adagrad: the same keys) and no
            ``optimizer`` named, or a name no declared family has.
    """
    if optimizer is not None:
        try:
            return spec_for_class(optimizer)
        except UnsupportedOptimizerError as error:
            raise CheckpointUsageError(f"--optimizer {optimizer}: {error}") from error
    state = next((s for s in group_states(rank_sds[0]) if s), {})
    if "state2" in state:
        return BNB_ADEMAMIX if getattr(state.get("state1"), "dim", lambda: 1)() > 1 else BNB_ADAM
    one_state = sorted(name for spec in (BNB_LION, BNB_SGD, BNB_RMSPROP, BNB_ADAGRAD) for name in spec.classes
                       if name.endswith("8bit"))
    raise CheckpointUsageError(
        f"{where} holds one-state bitsandbytes optimizer state (state1, absmax1, qmap1), which Lion, SGD, RMSprop and "
        f"Adagrad share; name the optimizer that wrote it with --optimizer (one of {one_state})"
    )


def _target(path: str, tag: str | None, out_dir: str, out_tag: str | None, *, latest: str,
            force: bool) -> tuple[str, str]:
    """Locate the input, check the output ``out_dir/out_tag`` against it; returns ``(input tag folder, out tag)``."""
    save_dir, folder_tag = locate(path, tag, latest=latest)
    out_tag = check_new_tag(out_tag or folder_tag.lstrip("."))
    check_output_folder(os.path.join(out_dir, out_tag), source_tag_folder=os.path.join(save_dir, folder_tag),
                        force=force)
    return os.path.join(save_dir, folder_tag), out_tag


def from_universal(path: str, out_dir: str, *, tag: str | None = None, out_tag: str | None = None,
                   optimizer: str = "AdamW8bit", force: bool = False, progress: bool = False) -> dict[str, Any]:
    """Start 8-bit training from a DeepSpeed universal (fp32 Adam) checkpoint.

    Moments are quantized once, on the global 256-element block grid, for every group that
    ``bnb.optim.<optimizer>`` keeps in 8 bits at DP=1 (a load at a DP size where a partition
    falls under ``min_8bit_size`` dequantizes exactly). Returns the quantization error.
    """
    if optimizer not in TARGET_OPTIMIZERS:
        raise CheckpointUsageError(f"--optimizer must be one of {list(TARGET_OPTIMIZERS)}, got {optimizer!r}")
    _, out_tag = _target(path, tag, out_dir, out_tag, latest=UNIVERSAL_LATEST, force=force)
    tag_folder, folder_tag, optimizer_state, params = _load_universal(path, tag)
    report = QuantizationReport()
    groups = []
    with malformed(f"universal checkpoint {tag_folder}"):
        for index, group_params in enumerate(tqdm(params, desc="groups", unit="group", disable=not progress)):
            saved_group = optimizer_state[PARAM_GROUPS][index]
            hyper = {k: saved_group[k] for k in _ADAM_HYPERPARAMETERS if k in saved_group}
            numel = sum(p.numel for p in group_params)
            flat = {key: torch.cat([_read_param_file(tag_folder, p, key) for p in group_params])
                    for key in ("fp32", "exp_avg", "exp_avg_sq")}
            steps = {_read_param_file(tag_folder, p, "step") for p in group_params}
            if len(steps) != 1:
                raise CheckpointFormatError(f"parameters of group {index} have different steps {sorted(steps)}")
            state, param_group = _fresh_bnb_state(optimizer, numel, hyper)
            state["step"] = int(steps.pop())
            for key, name in BNB_ADAM.moment_names.items():
                triple = BNB_ADAM.triple_for(key)
                if state[key].dtype == torch.uint8:
                    state[key], state[triple.absmax] = quantize_moment(flat[name], state[triple.qmap], BNB_ADAM.block_size,
                                                                       name, report)
                else:
                    state[key] = flat[name].clone()
            groups.append(FullGroup(numel, group_params, _entries(state, "converted from a universal checkpoint"),
                                    flat["fp32"], state, param_group))
    wrapper = plain_wrapper({name: optimizer_state.get(name) for name in WRAPPER_SCALARS if name in optimizer_state})
    published = write_checkpoint(out_dir, out_tag, groups, spec=BNB_ADAM, block_size=BNB_ADAM.block_size,
                                 optimizer_class=f"bitsandbytes.optim.{optimizer}", wrapper=wrapper,
                                 extra_files=model_states_files(tag_folder), replace=force)
    return {"output": published, "quantized_elements": report.quantized_elements,
            "max_abs_error": report.max_abs_error, "relative_rms_error": report.relative_rms_error}


def _default_min_8bit_size(spec: OptimizerSpec, optimizer: str | None) -> int:
    """bitsandbytes' default ``min_8bit_size`` of the class that wrote a stock checkpoint (named, or the family's)."""
    cls = getattr(bnb.optim, optimizer or spec.classes[0])
    return int(inspect.signature(cls).parameters["min_8bit_size"].default)


def _read_stock(tag_folder: str, optimizer: str | None) -> tuple[StockCheckpoint, OptimizerSpec, str, str]:
    """The stock checkpoint of ``tag_folder`` in zero_bnb's layout: one group per flat group (ZeRO stages 1/2) or
    per parameter (stage 3); with its family and the model file to keep (name, path)."""
    names = zero_file_names(tag_folder)
    if not names:
        raise CheckpointFormatError(f"{tag_folder} holds no stock DeepSpeed ZeRO optimizer files (zero_pp_rank_*)")
    model_files = model_states_files(tag_folder)
    model_name, model_file = model_file_of(tag_folder, model_files)
    stage3 = is_stage3_model_file(model_name)
    model_count = len(model_files)
    if stage3 and model_count != len(names):
        raise CheckpointFormatError(
            f"{tag_folder} holds {model_count} stage-3 model-states files but optimizer files of ranks 0..{len(names) - 1} "
            f"only ({len(names)}); a rank's file is missing or left over from another save. Copy the complete tag "
            f"folder as DeepSpeed wrote it"
        )
    rank_sds = read_rank_files(names)
    with malformed(f"stock DeepSpeed checkpoint {tag_folder}"):
        written_at3 = {is_stage3(sd) for sd in rank_sds}
        if written_at3 != {stage3}:
            raise CheckpointFormatError(
                f"{tag_folder} holds {'per-rank stage-3' if stage3 else 'stage-1/2'} model files but optimizer files "
                f"written at ZeRO stage {'3' if True in written_at3 else '1/2'}; the files come from different saves"
            )
        spec = _stock_family(rank_sds, optimizer, tag_folder)
        rule = StateRule(unsharded_keys=frozenset(spec.replicated_by_default))
        if stage3:
            stock = StockCheckpoint.from_stage3_rank_states(
                rank_sds, spec=spec, rule=rule, sub_groups=param_entries(model_file),
                optimizer_class="stock DeepSpeed checkpoint", min_8bit_size=_default_min_8bit_size(spec, optimizer))
        else:
            stock = StockCheckpoint.from_rank_states(rank_sds, spec=spec, rule=rule, params=param_entries(model_file),
                                                     optimizer_class="stock DeepSpeed checkpoint", log=False)
    return stock, spec, model_name, model_file


def rescue_stock(path: str, out_dir: str, *, tag: str | None = None, out_tag: str | None = None,
                 force: bool = False, optimizer: str | None = None) -> dict[str, Any]:
    """Rewrite a stock DeepSpeed ZeRO + bitsandbytes checkpoint (stage 1, 2 or 3, any DP size) as a zero_bnb
    checkpoint.

    Master weights, counters and hyper-parameters are copied exactly. 8-bit state already on the
    aligned grid is copied exactly; other 8-bit state (partitions not on the block grid; at stage 3,
    any parameter whose slices do not start on blocks of its sub-group's flat tensor) is dequantized
    per rank with its own ``absmax`` and map, then requantized once on the aligned global grid
    (stage 3: on each parameter's own grid, for parameters of at least bitsandbytes' default
    ``min_8bit_size`` elements, as zero_bnb's stage 3 decides; smaller ones keep the dequantized fp32
    values). A stage-3 input gives one group per parameter, zero_bnb's stage-3 layout, which loads
    at stage 3 at any DP size without another requantization (and at stages 1/2 as any stage-3
    checkpoint does). Works for every declared bitsandbytes family: Adam and AdEMAMix are told by
    their state keys, the one-state families (Lion, SGD, RMSprop, Adagrad) need ``optimizer`` (the
    class name, e.g. ``"Lion8bit"``). Returns the error introduced. The output's manifest records the DP size the
    stock checkpoint was saved at (``migrated_from``), which ``inspect`` and ``verify`` report as its saved DP size.
    """
    tag_folder, out_tag = _target(path, tag, out_dir, out_tag, latest=LATEST_NAME, force=force)
    stock, spec, model_name, model_file = _read_stock(tag_folder, optimizer)
    report = QuantizationReport()
    with malformed(f"stock DeepSpeed checkpoint {tag_folder}"):
        groups = gather_full(stock)
        for index, group in enumerate(groups):
            for key, qmap in stock.requantize.get(index, {}).items():  # dequantized 8-bit moments: 8 bits again, once
                triple = spec.triple_for(key)
                group.state[key], group.state[triple.absmax] = quantize_moment(
                    group.state[key], qmap, spec.block_size, spec.moment_names.get(key, key), report)
                group.state[triple.qmap] = qmap
            group.states = _entries(group.state, "rescued from a stock DeepSpeed checkpoint", spec)
    wrapper = dict(stock.replicated.wrapper)
    published = write_checkpoint(out_dir, out_tag, groups, spec=spec,
                                 block_size=spec.block_size, optimizer_class="bitsandbytes (rescued)",
                                 wrapper=wrapper, extra_files={model_name: model_file}, replace=force,
                                 migrated_from={"format": STOCK_FORMAT, "dp_world_size": stock.manifest.dp_world_size})
    return {"output": published, "saved_dp_size": stock.manifest.dp_world_size,
            "zero_stage": 3 if is_stage3_model_file(model_name) else "1 or 2",
            "requantized_elements": report.quantized_elements,
            "max_abs_error": report.max_abs_error, "relative_rms_error": report.relative_rms_error}


