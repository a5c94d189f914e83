"""Whole checkpoints in one process: write groups as a zero_bnb checkpoint, quantize moments once.

The building blocks of the conversion tools (:mod:`zero_bnb.tools.convert`). No collectives
and no DeepSpeed engine: any single process may call these functions.
:func:`write_checkpoint` writes whole groups (:class:`~zero_bnb.checkpoint.whole.FullGroup`)
as a DP=1 zero_bnb checkpoint, which - like every zero_bnb checkpoint - loads at any DP size.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from zero_bnb.checkpoint.commit import local_commit
from zero_bnb.checkpoint.recovery_script import write_recovery_script
from zero_bnb.checkpoint.save import split_by_kind
from zero_bnb.checkpoint.whole import FullGroup
from zero_bnb.core import quant
from zero_bnb.core.layout import ceil_div
from zero_bnb.core.state_spec import OptimizerSpec
from zero_bnb.format.durable import FileRecord, copy_file, makedirs
from zero_bnb.format.manifest import (
    SUBDIR,
    GroupEntry,
    Manifest,
    StateEntry,
    write_manifest,
)
from zero_bnb.format.payload import (
    ReplicatedGroup,
    ReplicatedPayload,
    ShardGroup,
    ShardPayload,
    write_replicated,
    write_shard,
)
from zero_bnb.format.tags import LATEST_NAME
from zero_bnb.format.wrapper_state import plain_wrapper

__all__ = ["QuantizationReport", "quantize_moment", "write_checkpoint"]

logger = logging.getLogger(__name__)


@dataclass
class QuantizationReport:
    """Error introduced by quantizing fp32 moments once: per state key, worst over groups."""

    max_abs_error: dict[str, float] = field(default_factory=dict)
    relative_rms_error: dict[str, float] = field(default_factory=dict)
    quantized_elements: int = 0

    def add(self, key: str, original: torch.Tensor, restored: torch.Tensor) -> None:
        difference = (restored - original).abs()
        norm = float(original.norm())
        self.max_abs_error[key] = max(self.max_abs_error.get(key, 0.0), float(difference.max()) if difference.numel() else 0.0)
        relative = float(difference.norm()) / norm if norm > 0 else 0.0
        self.relative_rms_error[key] = max(self.relative_rms_error.get(key, 0.0), relative)
        self.quantized_elements += original.numel()


def quantize_moment(values: torch.Tensor, qmap: torch.Tensor, block_size: int, key: str,
                    report: QuantizationReport) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes and absmax of fp32 ``values`` on the global block grid; the error goes to ``report``."""
    codes, absmax = quant.quantize(values, qmap, block_size)
    report.add(key, values, quant.dequantize(codes, absmax, qmap, block_size))
    return codes, absmax


def write_checkpoint(
    save_dir: str,
    tag: str,
    groups: list[FullGroup],
    *,
    spec: OptimizerSpec,
    block_size: int,
    optimizer_class: str,
    wrapper: dict[str, Any],
    extra_files: dict[str, str | Callable[[str, str], FileRecord]],
    save_latest: bool = True,
    replace: bool = False,
    migrated_from: dict[str, Any] | None = None,
) -> str:
    """Write ``groups`` as a DP=1 zero_bnb checkpoint ``save_dir/tag``, committed atomically, and
    ``save_dir/zero_to_fp32.py`` (zero_bnb's, replacing stock DeepSpeed's) as saves do.

    Args:
        extra_files: file name in the tag folder -> source path copied byte for byte, or a
            writer ``(path, root) -> FileRecord`` (DeepSpeed's model-states file, so that
            ``engine.load_checkpoint`` finds the weights).
        wrapper: the ZeRO wrapper's scalars (loss scaler, ...).
        replace: replace an existing ``save_dir/tag`` (else it is refused, under the lock).
        migrated_from: the checkpoint these groups come from, recorded in the manifest
            (``{"format": "stock DeepSpeed", "dp_world_size": 2}``: the DP size it was saved at,
            which ``inspect`` and ``verify`` report beside the DP=1 layout written here).

    Returns:
        The published tag folder.
    """
    shard_groups, replicated_groups, entries = [], [], []
    for group in groups:
        kinds = {item.key: item.kind for item in group.states}
        sharded, replicated, counters = split_by_kind(  # the split a save makes (DP=1: whole tensors)
            ((key, kinds[key], value) for key, value in group.state.items()), lambda kind, value: value,
            lambda value: value)
        shard_groups.append(ShardGroup(group.fp32.contiguous(), sharded))
        replicated_groups.append(ReplicatedGroup(param_group=group.param_group, counters=counters,
                                                 replicated=replicated))
        states = tuple(StateEntry.describe(item.key, item.kind, group.state[item.key], item.reason)
                       for item in group.states)
        entries.append(GroupEntry.describe(group.numel, group.params, states, ((0, group.numel),),
                                           ((0, ceil_div(group.numel, block_size)),), group.param_group))
    with local_commit(save_dir, tag, latest_name=LATEST_NAME if save_latest else None, replace=replace,
                      after_publish=lambda: write_recovery_script(save_dir)) as staging:
        folder = os.path.join(staging, SUBDIR)
        makedirs(folder)
        files: list[FileRecord] = [
            write_shard(ShardPayload(0, 1, tuple(shard_groups)), folder, root=staging),
            write_replicated(ReplicatedPayload(tuple(replicated_groups), plain_wrapper(wrapper)), folder, root=staging),
        ]
        for name, source in extra_files.items():
            target = os.path.join(staging, name)
            files.append(copy_file(source, target, root=staging) if isinstance(source, str) else source(target, staging))
        manifest = Manifest.create(dp_world_size=1, block_size=block_size, optimizer_class=optimizer_class,
                                   optimizer_spec=spec.name, groups=tuple(entries), files=files,
                                   migrated_from=migrated_from,
                                   source=f"the checkpoint being written to {os.path.join(save_dir, tag)}")
        write_manifest(manifest, folder, root=staging)
    published = os.path.join(save_dir, tag)
    logger.info("zero_bnb: wrote %s (%d groups)", published, len(groups))
    return published
