"""Checkpoint tools as Python functions: inspect, convert (universal <-> zero_bnb, stock rescue), export.

All functions run in one process, without a DeepSpeed engine or ``torch.distributed``. The
command line (``zero-bnb inspect|verify|convert|export``) is a thin layer over them.

Paths: ``path`` may be a save folder (holding ``latest`` / ``latest_universal`` and tag
folders; ``tag=None`` then follows the pointer file) or one tag folder. Outputs are save
folders: the result goes to ``out_dir/<tag>`` and the pointer file is updated, atomically.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import bitsandbytes as bnb
import torch
from deepspeed.checkpoint.constants import CAT_DIM, PARAM, PARAM_GROUPS
from tqdm import tqdm

from zero_bnb.checkpoint_format import SUBDIR, ParamEntry, StateEntry
from zero_bnb.commit import prepare_staging, publish, resolve_tag
from zero_bnb.derived import restore_derived
from zero_bnb.durable import save_torch
from zero_bnb.errors import CheckpointFormatError
from zero_bnb.integrity import verify_checkpoint
from zero_bnb.layout import GroupGeometry
from zero_bnb.load import CheckpointReader
from zero_bnb.offline import (
    FullGroup,
    QuantizationReport,
    gather_full,
    moments,
    per_parameter,
    quantize_moment,
    write_checkpoint,
)
from zero_bnb.save import WRAPPER_SCALARS
from zero_bnb.state_spec import BNB_ADAM, StateKind, StateRule, spec_named
from zero_bnb.stock_import import (
    StockCheckpoint,
    group_states,
    read_rank_files,
    zero_file_names,
)

__all__ = ["detect", "export_fp32", "from_universal", "inspect_checkpoint", "locate", "rescue_stock", "to_universal"]

UNIVERSAL_LATEST = "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"
#: bitsandbytes optimizers a universal checkpoint can be converted to.
TARGET_OPTIMIZERS = ("AdamW8bit", "Adam8bit")
_ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def locate(path: str, tag: str | None = None, *, latest: str = "latest") -> tuple[str, str]:
    """``(save_dir, folder_tag)`` of the checkpoint at ``path`` (a save folder or a tag folder).

    Raises:
        CheckpointFormatError: ``path`` does not exist, or names no checkpoint.
    """
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise CheckpointFormatError(f"{path} is not a folder; pass a checkpoint save folder or one of its tag folders")
    is_tag_folder = os.path.isdir(os.path.join(path, SUBDIR)) or glob.glob(os.path.join(path, "mp_rank_*_model_states.pt"))
    if tag is None and is_tag_folder:
        return os.path.dirname(path) or ".", os.path.basename(path)
    if tag is None and not os.path.isfile(os.path.join(path, latest)):
        raise CheckpointFormatError(
            f"{path} holds no '{latest}' file and is not a tag folder; pass the tag folder (for example "
            f"{os.path.join(path, 'global_step100')}) or --tag"
        )
    if latest == "latest":
        folder_tag = resolve_tag(path, tag)
    else:
        with open(os.path.join(path, latest)) as handle:
            folder_tag = tag or handle.read().strip()
        if not os.path.isdir(os.path.join(path, folder_tag)):
            raise CheckpointFormatError(f"{os.path.join(path, folder_tag)} does not exist (named by {latest})")
    return path, folder_tag


def detect(path: str, tag: str | None = None) -> str:
    """What the checkpoint at ``path`` is: ``"zero_bnb"``, ``"universal"`` or ``"stock"`` (DeepSpeed ZeRO).

    A save folder holding only ``latest_universal`` is universal; a tag folder is judged by its content.

    Raises:
        CheckpointFormatError: none of them.
    """
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, UNIVERSAL_LATEST)) and not os.path.isfile(os.path.join(path, "latest")):
        save_dir, folder_tag = locate(path, tag, latest=UNIVERSAL_LATEST)
    else:
        save_dir, folder_tag = locate(path, tag)
    tag_folder = os.path.join(save_dir, folder_tag)
    if os.path.isfile(os.path.join(tag_folder, "zero", "optimizer_state.pt")):
        return "universal"
    if os.path.isdir(os.path.join(tag_folder, SUBDIR)):
        return "zero_bnb"
    if zero_file_names(tag_folder):
        return "stock"
    raise CheckpointFormatError(
        f"{tag_folder} is neither a zero_bnb, a DeepSpeed universal nor a stock DeepSpeed ZeRO checkpoint"
    )


def _open_verified(path: str, tag: str | None) -> tuple[str, CheckpointReader]:
    save_dir, folder_tag = locate(path, tag)
    tag_folder, _ = verify_checkpoint(save_dir, folder_tag)
    reader = CheckpointReader(tag_folder)
    reader.preload()
    return folder_tag, reader


def inspect_checkpoint(path: str, tag: str | None = None) -> dict[str, Any]:
    """A JSON-friendly summary of a zero_bnb checkpoint (verified first).

    Per group: its parameters, and per state key the kind, dtype, bytes on disk, and whether it
    is 8-bit; plus the saved DP size, block size, optimizer, versions and total bytes.
    """
    folder_tag, reader = _open_verified(path, tag)
    manifest = reader.manifest
    groups = []
    for index, entry in enumerate(manifest.groups):
        states = []
        for item in entry.states:
            if item.kind in (StateKind.ELEMENTWISE, StateKind.BLOCKWISE):
                nbytes = sum(reader.piece(r, index, item.key).nbytes for r in range(len(manifest.shards)))
            elif item.kind is StateKind.REPLICATED:
                nbytes = reader.replicated["groups"][index]["replicated"][item.key].nbytes
            else:
                nbytes = 0
            states.append({"key": item.key, "kind": item.kind.value, "dtype": item.dtype, "bytes": nbytes,
                           "8bit": item.dtype == "uint8", "reason": item.reason})
        groups.append({
            "numel": entry.numel,
            "parameters": [{"name": p.name, "shape": list(p.shape), "offset": p.offset} for p in entry.params],
            "states": states,
            "hyperparameters": entry.hyperparameters,
        })
    return {
        "path": reader.tag_folder,
        "tag": folder_tag,
        "saved_dp_size": manifest.dp_world_size,
        "block_size": manifest.block_size,
        "optimizer_class": manifest.optimizer_class,
        "optimizer_family": manifest.optimizer_spec,
        "parameters": sum(entry.numel for entry in manifest.groups),
        "bytes": sum(record.size for record in manifest.files),
        "files": [{"path": f.path, "bytes": f.size, "sha256": f.sha256} for f in manifest.files],
        "non_finite": manifest.non_finite,
        "versions": manifest.versions,
        "format_version": manifest.format_version,
        "groups": groups,
    }


def _model_states_files(tag_folder: str) -> dict[str, str]:
    files = sorted(glob.glob(os.path.join(tag_folder, "*model_states.pt")))
    if [os.path.basename(f) for f in files] != [MODEL_STATES]:
        raise CheckpointFormatError(
            f"{tag_folder} holds model-states files {[os.path.basename(f) for f in files]}; the tools handle one "
            f"{MODEL_STATES} (no tensor or pipeline parallelism)"
        )
    return {MODEL_STATES: files[0]}


def to_universal(path: str, out_dir: str, *, tag: str | None = None, out_tag: str | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """Write a zero_bnb checkpoint as a DeepSpeed universal checkpoint (``out_dir/<tag>``, ``latest_universal``).

    Every parameter gets ``fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (8-bit moments dequantized
    exactly) and ``step.pt``; ``zero/optimizer_state.pt`` holds the Adam hyper-parameters and loss
    scaler. Stock DeepSpeed loads it with ``checkpoint.load_universal: true`` into
    ``torch.optim.AdamW`` (or ``Adam``) at any DP size.
    """
    folder_tag, reader = _open_verified(path, tag)
    manifest = reader.manifest
    spec = spec_named(manifest.optimizer_spec)
    out_tag = out_tag or folder_tag
    staging = prepare_staging(out_dir, out_tag)
    zero_folder = os.path.join(staging, "zero")
    groups = gather_full(reader)
    param_groups, written = [], 0
    for index, group in enumerate(tqdm(groups, desc="groups", unit="group", disable=not progress)):
        tensors = {"fp32": group.fp32, **moments(group, spec, manifest.block_size)}
        sliced = {key: per_parameter(group, flat) for key, flat in tensors.items()}
        step = group.state.get("step", 0)
        for param in group.params:
            folder = os.path.join(zero_folder, param.name)
            os.makedirs(folder, exist_ok=True)
            for key, by_name in sliced.items():
                save_torch({PARAM: by_name[param.name].clone(), CAT_DIM: 0}, os.path.join(folder, f"{key}.pt"),
                           root=staging)
            save_torch(torch.tensor(float(step)), os.path.join(folder, "step.pt"), root=staging)
            written += 1
        hyper = {k: group.param_group[k] for k in _ADAM_HYPERPARAMETERS if k in group.param_group}
        param_groups.append({**hyper, "params": [index]})
    wrapper = reader.replicated.get("zero_wrapper", {})
    import deepspeed

    optimizer_state = {name: wrapper.get(name) for name in WRAPPER_SCALARS}
    optimizer_state.update({"ds_version": deepspeed.__version__, "zero_stage": 1,
                            "partition_count": manifest.dp_world_size, PARAM_GROUPS: param_groups})
    save_torch(optimizer_state, os.path.join(zero_folder, "optimizer_state.pt"), root=staging)
    weights = {name: value for group in groups for name, value in per_parameter(group, group.fp32).items()}
    for name, source in _model_states_files(reader.tag_folder).items():
        model_states = torch.load(source, map_location="cpu", weights_only=False)
        restore_derived(model_states, weights.__getitem__)  # DeepSpeed reads the module weights from this file
        save_torch(model_states, os.path.join(staging, name), root=staging)
    published = publish(out_dir, out_tag, latest_name=UNIVERSAL_LATEST)
    return {"output": published, "parameters": written, "moments": sorted(spec.moment_names.values()),
            "dropped_hyperparameters": sorted({k for g in groups for k in g.param_group} - {*_ADAM_HYPERPARAMETERS})}


def _param_entries(model_file: str) -> list[tuple[ParamEntry, ...]]:
    """Per flat group, its parameters with offsets, from DeepSpeed's ``param_shapes`` record."""
    shapes = torch.load(model_file, map_location="cpu", weights_only=False)["param_shapes"]
    params = []
    for group_shapes in shapes:
        offset, entries = 0, []
        for name, shape in group_shapes.items():
            entries.append(ParamEntry(name, tuple(shape), offset))
            offset += entries[-1].numel
        params.append(tuple(entries))
    return params


def _load_universal(path: str, tag: str | None) -> tuple[str, str, dict, list[tuple[ParamEntry, ...]]]:
    save_dir, folder_tag = locate(path, tag, latest=UNIVERSAL_LATEST)
    tag_folder = os.path.join(save_dir, folder_tag)
    state_path = os.path.join(tag_folder, "zero", "optimizer_state.pt")
    if not os.path.isfile(state_path):
        raise CheckpointFormatError(f"{tag_folder} is not a DeepSpeed universal checkpoint: {state_path} is missing")
    optimizer_state = torch.load(state_path, map_location="cpu", weights_only=False)
    params = _param_entries(_model_states_files(tag_folder)[MODEL_STATES])
    return tag_folder, folder_tag, optimizer_state, params


def _read_param_file(tag_folder: str, name: str, key: str) -> torch.Tensor:
    path = os.path.join(tag_folder, "zero", name, f"{key}.pt")
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"the universal checkpoint has no {key} for parameter {name!r} ({path} is missing)")
    value = torch.load(path, map_location="cpu", weights_only=False)
    return value if key == "step" else value[PARAM].reshape(-1).float()


def _fresh_bnb_state(optimizer_name: str, numel: int, hyper: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state and param group ``bnb.optim.<optimizer_name>`` creates for the DP=1 partition of a group."""
    partition = GroupGeometry(numel, 1, BNB_ADAM.block_size).partition_numel
    param = torch.nn.Parameter(torch.empty(partition))
    optimizer = getattr(bnb.optim, optimizer_name)([param], **hyper)
    BNB_ADAM.init_state(optimizer, 0, param)
    return optimizer.state[param], {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}


def _entries(state: dict[str, Any], reason: str) -> tuple[StateEntry, ...]:
    return tuple(StateEntry(key, BNB_ADAM.kinds[key], "", reason) for key in sorted(state))


def from_universal(path: str, out_dir: str, *, tag: str | None = None, out_tag: str | None = None,
                   optimizer: str = "AdamW8bit", progress: bool = False) -> dict[str, Any]:
    """Start 8-bit training from a DeepSpeed universal (fp32 Adam) checkpoint.

    Moments are quantized once, on the global 256-element block grid, for every group that
    ``bnb.optim.<optimizer>`` keeps in 8 bits at DP=1 (a load at a DP size where a partition
    falls under ``min_8bit_size`` dequantizes exactly). Returns the quantization error.
    """
    if optimizer not in TARGET_OPTIMIZERS:
        raise CheckpointFormatError(f"--optimizer must be one of {list(TARGET_OPTIMIZERS)}, got {optimizer!r}")
    tag_folder, folder_tag, optimizer_state, params = _load_universal(path, tag)
    report = QuantizationReport()
    groups = []
    for index, group_params in enumerate(tqdm(params, desc="groups", unit="group", disable=not progress)):
        saved_group = optimizer_state[PARAM_GROUPS][index]
        hyper = {k: saved_group[k] for k in _ADAM_HYPERPARAMETERS if k in saved_group}
        numel = sum(p.numel for p in group_params)
        flat = {key: torch.cat([_read_param_file(tag_folder, p.name, key) for p in group_params])
                for key in ("fp32", "exp_avg", "exp_avg_sq")}
        steps = {float(_read_param_file(tag_folder, p.name, "step")) for p in group_params}
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
    out_tag = out_tag or folder_tag
    wrapper = {name: optimizer_state.get(name) for name in WRAPPER_SCALARS if name in optimizer_state}
    published = write_checkpoint(out_dir, out_tag, groups, spec=BNB_ADAM, block_size=BNB_ADAM.block_size,
                                 optimizer_class=f"bitsandbytes.optim.{optimizer}", wrapper=wrapper,
                                 extra_files=_model_states_files(tag_folder))
    return {"output": published, "quantized_elements": report.quantized_elements,
            "max_abs_error": report.max_abs_error, "relative_rms_error": report.relative_rms_error}


def rescue_stock(path: str, out_dir: str, *, tag: str | None = None, out_tag: str | None = None) -> dict[str, Any]:
    """Rewrite a stock DeepSpeed ZeRO-1 + bitsandbytes checkpoint (any DP size) as a zero_bnb checkpoint.

    Each rank's 8-bit partition is dequantized with its own ``absmax`` and map, then requantized
    once on the aligned global grid (partitions that were already block-aligned are copied
    exactly). Returns the error introduced.
    """
    save_dir, folder_tag = locate(path, tag)
    tag_folder = os.path.join(save_dir, folder_tag)
    names = zero_file_names(tag_folder)
    if not names:
        raise CheckpointFormatError(f"{tag_folder} holds no stock DeepSpeed ZeRO optimizer files (zero_pp_rank_*)")
    model_file = _model_states_files(tag_folder)[MODEL_STATES]
    rank_sds = read_rank_files(names)
    stock = StockCheckpoint.from_rank_states(
        rank_sds, spec=BNB_ADAM, rule=StateRule(unsharded_keys=frozenset(BNB_ADAM.replicated_by_default)),
        params=_param_entries(model_file), optimizer_class="stock DeepSpeed checkpoint", log=False)
    report = QuantizationReport()
    groups = gather_full(stock)
    for index, group in enumerate(groups):
        original = group_states(rank_sds[0])[index]
        for key in BNB_ADAM.moment_names:
            triple = BNB_ADAM.triple_for(key)
            if group.state[key].dtype != torch.uint8 and original[key].dtype == torch.uint8:
                qmap = original[triple.qmap]
                group.state[key], group.state[triple.absmax] = quantize_moment(
                    group.state[key], qmap, BNB_ADAM.block_size, BNB_ADAM.moment_names[key], report)
                group.state[triple.qmap] = qmap
        group.states = _entries(group.state, "rescued from a stock DeepSpeed checkpoint")
    wrapper = stock.replicated["zero_wrapper"]
    published = write_checkpoint(out_dir, out_tag or folder_tag, groups, spec=BNB_ADAM,
                                 block_size=BNB_ADAM.block_size, optimizer_class="bitsandbytes (rescued)",
                                 wrapper=wrapper, extra_files={MODEL_STATES: model_file})
    return {"output": published, "saved_dp_size": len(names), "requantized_elements": report.quantized_elements,
            "max_abs_error": report.max_abs_error, "relative_rms_error": report.relative_rms_error}


def export_fp32(path: str, out_path: str, *, tag: str | None = None, moments_too: bool = False,
                progress: bool = False) -> dict[str, Any]:
    """Consolidated fp32 weights (like DeepSpeed's ``zero_to_fp32``) as one safetensors file.

    With ``moments_too``, also ``<name>.exp_avg`` / ``<name>.exp_avg_sq`` (8-bit moments
    dequantized exactly).
    """
    from safetensors.torch import save_file

    _, reader = _open_verified(path, tag)
    spec = spec_named(reader.manifest.optimizer_spec)
    tensors: dict[str, torch.Tensor] = {}
    for group in tqdm(gather_full(reader), desc="groups", unit="group", disable=not progress):
        for name, value in per_parameter(group, group.fp32).items():
            tensors[name] = value.contiguous()
        if moments_too:
            for moment, flat in moments(group, spec, reader.manifest.block_size).items():
                for name, value in per_parameter(group, flat).items():
                    tensors[f"{name}.{moment}"] = value.contiguous()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    temporary = f"{out_path}.zero_bnb-tmp"
    save_file(tensors, temporary, metadata={"format": "pt", "source": reader.tag_folder})
    os.replace(temporary, out_path)
    return {"output": out_path, "tensors": len(tensors), "bytes": os.path.getsize(out_path)}
