"""Read-only views of a zero_bnb checkpoint: a summary (``inspect``) and consolidated fp32 weights (``export``).

Single-process functions; no DeepSpeed engine or ``torch.distributed``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zero_bnb.core.kinds import is_partitioned
from zero_bnb.core.state_spec import StateKind
from zero_bnb.errors import CheckpointUsageError
from zero_bnb.format.stock_files import MODEL_STATES
from zero_bnb.tools.checkpoint_paths import locate, open_verified, require_zero_bnb
from zero_bnb.tools.outputs import check_output_file, replacing_file
from zero_bnb.tools.recovery import get_fp32_state_dict_from_zero_checkpoint

__all__ = ["OUTPUT_SUFFIXES", "export_fp32", "inspect_checkpoint", "output_format", "write_state_dict"]

#: File suffix -> how a state dict is written: ``safetensors`` or ``torch`` (``torch.save`` of the dict).
OUTPUT_SUFFIXES = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def inspect_checkpoint(path: str, tag: str | None = None) -> dict[str, Any]:
    """A JSON-friendly summary of a zero_bnb checkpoint (verified first).

    Per group: its parameters, how its fp32 master weights are stored (whole, or derived from the
    module weights in DeepSpeed's model file) and their bytes, and per state key the kind, dtype,
    bytes on disk, and whether it is 8-bit; plus the saved DP size, block size, optimizer, versions,
    total bytes and bytes per kind (``bytes_by_kind``). ``saved_dp_size`` is the DP size of the run that saved the
    state (for a checkpoint migrated offline from stock DeepSpeed, the stock run's, named in ``migrated_from``);
    ``stored_dp_size`` the number of partitions the files hold.
    """
    folder_tag, reader = open_verified(path, tag, command="inspect")
    manifest = reader.manifest
    groups = []
    for index, entry in enumerate(manifest.groups):
        states = []
        for item in entry.states:
            if is_partitioned(item.kind):
                nbytes = sum(reader.piece(r, index, item.key).nbytes for r in range(len(manifest.shards)))
            elif item.kind is StateKind.REPLICATED:
                nbytes = reader.replicated.groups[index].replicated[item.key].nbytes
            else:
                nbytes = 0
            states.append({"key": item.key, "kind": item.kind.value, "dtype": item.dtype, "bytes": nbytes,
                           "8bit": item.dtype == "uint8", "reason": item.reason})
        master_bytes = sum(reader.stored_master_bytes(r, index) for r in range(len(manifest.shards)))
        groups.append({
            "numel": entry.numel,
            "masters": {"storage": entry.masters, "bytes": master_bytes},
            "parameters": [{"name": p.name, "shape": list(p.shape), "offset": p.offset} for p in entry.params],
            "states": states,
            "hyperparameters": entry.hyperparameters,
        })
    total = sum(record.size for record in manifest.files)
    by_kind = {
        "master weights (shards)": sum(g["masters"]["bytes"] for g in groups),
        "optimizer state": sum(s["bytes"] for g in groups for s in g["states"]),
        "model file (module weights, DeepSpeed's)": sum(r.size for r in manifest.files if r.path == _model_file(manifest)),
    }
    by_kind["other (file framing, hyper-parameters, manifest)"] = total - sum(by_kind.values())
    return {
        "path": reader.tag_folder,
        "tag": folder_tag,
        "saved_dp_size": manifest.saved_dp_size,
        "stored_dp_size": manifest.dp_world_size,
        "migrated_from": dict(manifest.migrated_from) or None,
        "block_size": manifest.block_size,
        "optimizer_class": manifest.optimizer_class,
        "optimizer_family": manifest.optimizer_spec,
        "parameters": sum(entry.numel for entry in manifest.groups),
        "bytes": total,
        "bytes_by_kind": by_kind,
        "files": [{"path": f.path, "bytes": f.size, "algorithm": f.algorithm, "digest": f.digest}
                  for f in manifest.files],
        "non_finite": manifest.non_finite,
        "versions": manifest.versions,
        "format_version": manifest.format_version,
        "groups": groups,
    }


def _model_file(manifest) -> str:
    return manifest.module_file or MODEL_STATES


def output_format(path: str) -> str:
    """``"safetensors"`` or ``"torch"``: how a state dict goes to ``path``, by its suffix.

    Raises:
        CheckpointUsageError: another suffix (named, with the ones that work).
    """
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise CheckpointUsageError(
            f"the output {path} has the suffix {suffix or '(none)'!r}; name it .safetensors (safetensors) or "
            f".pt / .pth / .bin (torch.save of the state dict)"
        )
    return OUTPUT_SUFFIXES[suffix]


def write_state_dict(state: dict[str, torch.Tensor], path: str, *, metadata: dict[str, str] | None = None) -> int:
    """Write ``state`` to ``path`` as :func:`output_format` says, replacing it only once complete; returns the
    number of tensors written (every name of ``state``).

    Names that share one tensor (tied weights, e.g. ``lm_head.weight`` and the input embeddings)
    are all written: ``torch.save`` keeps them shared, safetensors (which refuses shared storage)
    gets a copy under each name, so ``load_state_dict(strict=True)`` and ``from_pretrained`` find
    every name. The file is created with the process umask, like any other file.
    """
    kind = output_format(path)
    with replacing_file(path) as temporary:
        if kind == "torch":
            torch.save(state, temporary)
        else:
            from safetensors.torch import save_file

            seen: set[tuple[int, int]] = set()
            unshared = {}
            for name, value in state.items():
                key = (value.untyped_storage().data_ptr(), value.storage_offset())
                unshared[name] = value.contiguous() if key not in seen else value.clone()  # a tied name: a copy
                seen.add(key)
            save_file(unshared, temporary, metadata=metadata)
        os.chmod(temporary, _new_file_mode())  # safetensors creates its files 0600 whatever the umask
    return len(state)


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file in this process: 0o666 less the umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:  # Linux: read without changing it
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)  # elsewhere: read it by setting it (and put it back at once)
    os.umask(umask)
    return 0o666 & ~umask


def export_fp32(path: str, out_path: str, *, tag: str | None = None, moments_too: bool = False,
                force: bool = False, progress: bool = False) -> dict[str, Any]:
    """Consolidated fp32 weights (like DeepSpeed's ``zero_to_fp32``) as one safetensors or torch file.

    The module's state dict in fp32: every trained parameter's master weight, tied names (each
    name written), buffers and frozen parameters (:func:`~zero_bnb.tools.recovery.get_fp32_state_dict_from_zero_checkpoint`).
    With ``moments_too``, also ``<name>.exp_avg`` / ``<name>.exp_avg_sq`` (8-bit moments
    dequantized exactly). ``out_path``'s suffix chooses the format (:data:`OUTPUT_SUFFIXES`); it
    must lie outside the checkpoint; an existing file is replaced (atomically) only with ``force``.

    Raises:
        CheckpointUsageError: ``out_path`` has another suffix, is part of the input, a folder, or
            exists without ``force``; nothing was read or written.
    """
    require_zero_bnb(path, tag, "export")
    save_dir, folder_tag = locate(path, tag)
    check_output_file(out_path, source_tag_folder=os.path.join(save_dir, folder_tag), source_save_dir=save_dir,
                      force=force)
    output_format(out_path)
    tensors = get_fp32_state_dict_from_zero_checkpoint(path, tag, moments_too=moments_too, progress=progress,
                                                       command="export")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    count = write_state_dict(tensors, out_path, metadata={"format": "pt", "source": os.path.join(save_dir, folder_tag)})
    return {"output": out_path, "tensors": count, "bytes": os.path.getsize(out_path)}
