"""Read a ZeRO-1 checkpoint written by stock DeepSpeed as a :class:`~zero_bnb.restore.SavedState`.

Stock DeepSpeed pads flat groups to ``2 * dp`` only, so its partitions usually do not start
on quantization blocks. Where they do (partition size a multiple of the block size), the
8-bit codes and ``absmax`` are taken as they are: exact. Where they do not, each rank's
8-bit state is dequantized with its own ``absmax`` and map and presented as fp32; the
loader then quantizes it on zero_bnb's aligned grid (a one-time requantization, logged).
Loading is refused at another DP size than the one the checkpoint was written at.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from zero_bnb import quant
from zero_bnb.checkpoint_format import SUBDIR, GroupEntry, Manifest, StateEntry
from zero_bnb.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointMismatchError,
)
from zero_bnb.layout import ceil_div
from zero_bnb.save import WRAPPER_SCALARS
from zero_bnb.state_spec import StateKind, classify_state

__all__ = ["StockCheckpoint"]

logger = logging.getLogger(__name__)

_BNB_WRAPPED = "__bnb_optimizer_quant_state__"


def _unwrap(state: dict[str, Any]) -> dict[str, Any]:
    state = dict(state)
    state.update(state.pop(_BNB_WRAPPED, {}))
    return state


def _group_states(optimizer_sd: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-group base-optimizer state of one stock rank file (rigid or elastic layout)."""
    base = optimizer_sd["base_optimizer_state"]
    if isinstance(base, dict):  # rigid: the base optimizer's own state_dict()
        return [_unwrap(base["state"].get(group["params"][0], {})) for group in base["param_groups"]]
    return [_unwrap(group_state) for group_state in base]  # elastic: one dict per group


class StockCheckpoint:
    """A stock DeepSpeed ZeRO-1 checkpoint, converted in memory to zero_bnb's layout."""

    def __init__(self, manifest: Manifest, replicated: dict[str, Any], pieces: dict[tuple[int, int, str], torch.Tensor]):
        self.manifest = manifest
        self.replicated = replicated
        self._pieces = pieces

    def piece(self, rank: int, group_index: int, key: str) -> torch.Tensor:
        return self._pieces[(rank, group_index, key)]

    @classmethod
    def open(cls, engine, load_dir: str, tag: str) -> StockCheckpoint:
        """Read the stock files of ``load_dir/tag`` for ``engine`` (a ZeroBnbEngine).

        Raises:
            ZeRORuntimeException: the checkpoint was saved at another DP size.
            CheckpointFormatError: the folder has no ZeRO optimizer files.
            CheckpointCorruptError: a rank file cannot be read.
        """
        optimizer = engine.optimizer
        bf16 = engine.bfloat16_enabled()
        names = []
        while os.path.isfile(name := engine._get_rank_zero_ckpt_name(load_dir, tag, engine.checkpoint_mp_rank,
                                                                   len(names), bf16)):
            names.append(name)
        if not names:
            raise CheckpointFormatError(
                f"{os.path.join(load_dir, tag)} holds neither zero_bnb files ({SUBDIR}/) nor stock DeepSpeed ZeRO "
                f"optimizer files ({os.path.basename(name)}, ...): it is not a complete ZeRO checkpoint; pass the "
                f"tag of a complete one"
            )
        saved_dp = len(names)
        if saved_dp != optimizer.dp_size:
            raise ZeRORuntimeException(
                f"{os.path.join(load_dir, tag)} was written by stock DeepSpeed at DP={saved_dp} and has no zero_bnb "
                f"files; its 8-bit state can only be re-split at that DP size. Resume once at DP={saved_dp} with "
                f"zero_bnb and save again: that checkpoint loads at any DP size (now DP={optimizer.dp_size})."
            )
        rank_sds = []
        for name in names:
            try:
                rank_sds.append(torch.load(name, map_location="cpu", weights_only=False)["optimizer_state_dict"])
            except Exception as error:  # torch raises many types for damaged archives
                raise CheckpointCorruptError(
                    f"stock DeepSpeed optimizer file {name} cannot be read ({type(error).__name__}: {error}); "
                    f"the file is damaged"
                ) from error
        return cls._convert(optimizer, rank_sds, engine.param_names)

    @classmethod
    def _convert(cls, optimizer, rank_sds: list[dict[str, Any]], names) -> StockCheckpoint:
        spec, rule = optimizer.zero_bnb_spec, optimizer.zero_bnb_rule
        block = spec.block_size
        states_per_rank = [_group_states(sd) for sd in rank_sds]
        pieces: dict[tuple[int, int, str], torch.Tensor] = {}
        groups, replicated_groups = [], []
        for g in range(len(rank_sds[0]["single_partition_of_fp32_groups"])):
            lengths = [sd["single_partition_of_fp32_groups"][g].numel() for sd in rank_sds]
            if sum(lengths) != optimizer.geometry(g).numel:
                raise CheckpointMismatchError(
                    f"group {g} of the stock checkpoint holds {sum(lengths)} elements, the running model's "
                    f"{optimizer.geometry(g).numel}; build the model that wrote it"
                )
            partition = lengths[0] + rank_sds[0]["group_paddings"][g]
            element_ranges = tuple((min(r * partition, sum(lengths)), min(r * partition, sum(lengths)) + n)
                                   for r, n in enumerate(lengths))
            numel = sum(lengths)
            block_ranges = tuple((s // block, ceil_div(e, block)) for s, e in element_ranges)
            aligned = partition % block == 0
            first_state = states_per_rank[0][g]
            entries, counters, replicated = [], {}, {}
            requantized = []
            for key, value in sorted(first_state.items()):
                kind, reason = classify_state(key, value, spec=spec, rule=rule, partition_numel=partition)
                triple = spec.triple_for(key)
                if not aligned and triple is not None and first_state[triple.codes].dtype == torch.uint8:
                    if key != triple.codes:
                        continue  # absmax/qmap are folded into the dequantized codes below
                    for r, n in enumerate(lengths):
                        state = states_per_rank[r][g]
                        pieces[(r, g, key)] = quant.dequantize(
                            state[key][:n], state[triple.absmax][: ceil_div(n, block)], state[triple.qmap], block
                        )
                    entries.append(StateEntry(key, StateKind.ELEMENTWISE, "float32", f"{reason}; dequantized"))
                    requantized.append(key)
                    continue
                dtype = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else type(value).__name__
                entries.append(StateEntry(key, kind, dtype, reason))
                for r, n in enumerate(lengths):
                    value_r = states_per_rank[r][g][key]
                    if kind is StateKind.ELEMENTWISE:
                        pieces[(r, g, key)] = value_r[:n]
                    elif kind is StateKind.BLOCKWISE:
                        pieces[(r, g, key)] = value_r[: block_ranges[r][1] - block_ranges[r][0]]
                if kind is StateKind.COUNTER:
                    counters[key] = value
                elif kind is StateKind.REPLICATED:
                    replicated[key] = value
            for r, sd in enumerate(rank_sds):
                pieces[(r, g, "fp32")] = sd["single_partition_of_fp32_groups"][g]
            if requantized and optimizer.dp_rank == 0:
                logger.warning(
                    "zero_bnb: stock DeepSpeed partitions of group %d (%d elements) do not start on %d-element "
                    "blocks; requantizing %s on the aligned grid once (lossy within 8-bit precision)",
                    g, partition, block, requantized,
                )
            groups.append(GroupEntry(numel, optimizer.param_entries(g, names), tuple(entries), element_ranges, block_ranges))
            base = rank_sds[0]["base_optimizer_state"]
            param_group = base["param_groups"][g] if isinstance(base, dict) else optimizer.optimizer.param_groups[g]
            replicated_groups.append({
                "param_group": {k: v for k, v in param_group.items() if k != "params"},
                "counters": counters,
                "replicated": replicated,
            })
        manifest = Manifest(
            dp_world_size=len(rank_sds),
            block_size=block,
            optimizer_class=type(optimizer.optimizer).__qualname__,
            optimizer_spec=spec.name,
            groups=tuple(groups),
            shards=tuple(f"stock rank {r}" for r in range(len(rank_sds))),
            versions={"deepspeed": str(rank_sds[0].get("ds_version", "unknown"))},
        )
        wrapper = {name: rank_sds[0][name] for name in WRAPPER_SCALARS if name in rank_sds[0]}
        return cls(manifest, {"groups": replicated_groups, "zero_wrapper": wrapper}, pieces)
