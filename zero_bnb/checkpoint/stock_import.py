"""Read a ZeRO-1/2 checkpoint written by stock DeepSpeed as a :class:`~zero_bnb.checkpoint.restore.SavedState`.

Stock DeepSpeed pads flat groups to ``2 * dp`` only, so its partitions usually do not start
on quantization blocks. Where they do (partition size a multiple of the block size), the
8-bit codes and ``absmax`` are taken as they are: exact. Where they do not, each rank's
8-bit state is dequantized with its own ``absmax`` and map and presented as fp32; the
loader (or ``zero-bnb convert --to zero_bnb``'s offline writer) then quantizes it on zero_bnb's
aligned grid (a one-time requantization, logged). ``load_checkpoint`` refuses it at another DP
size than the one it was written at and names the conversion; the offline rescue reads it at
any size.

A stock ZeRO stage-3 checkpoint (:meth:`StockCheckpoint.from_stage3_rank_states`) becomes one group per
parameter, zero_bnb's stage-3 layout: stock stage 3 slices every parameter into ``ceil(numel / dp)``
elements per rank and packs a sub-group's slices into one flat tensor per rank, whose 8-bit blocks
start at the flat tensor's start and so straddle parameters and ranks. The same rule applies: state
already on each parameter's block grid is taken as it is (exact), other 8-bit state is dequantized per
rank with its own ``absmax`` and map and requantized once, offline (``zero-bnb convert --to zero_bnb``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from zero_bnb.checkpoint.restore import copy_piece_range
from zero_bnb.core import quant
from zero_bnb.core.kinds import is_partitioned, saved_ranges, to_axis
from zero_bnb.core.layout import ceil_div
from zero_bnb.core.stage3 import stock_slice_ranges
from zero_bnb.core.state_spec import OptimizerSpec, StateKind, StateRule, classify_state
from zero_bnb.errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
)
from zero_bnb.format.manifest import (
    SUBDIR,
    GroupEntry,
    Manifest,
    ParamEntry,
    StateEntry,
)
from zero_bnb.format.payload import ReplicatedGroup, ReplicatedPayload
from zero_bnb.format.stock_files import (
    fp32_partitions,
    group_hyperparameters,
    group_states,
    is_stage3_model_file,
    model_file_of,
    param_entries,
    read_rank_files,
    zero_file_names,
)
from zero_bnb.format.wrapper_state import WRAPPER_SCALARS, plain_wrapper

__all__ = ["StockCheckpoint"]

logger = logging.getLogger(__name__)

def _saved_params(folder: str, rank_sds: list[dict[str, Any]], live: list[tuple[ParamEntry, ...]]):
    """The stock checkpoint's groups: the running optimizer's when the sizes agree, else DeepSpeed's record.

    They differ when the running optimizer isolates bitsandbytes overrides that stock DeepSpeed
    dropped (:mod:`zero_bnb.checkpoint.regroup` then maps the state by parameter name).
    """
    sizes = [sum(fp32_partitions(sd)[g].numel() for sd in rank_sds) for g in range(len(fp32_partitions(rank_sds[0])))]
    if sizes == [sum(p.numel for p in group) for group in live]:
        return live
    return param_entries(model_file_of(folder)[1])


class StockCheckpoint:
    """A stock DeepSpeed ZeRO checkpoint, converted in memory to zero_bnb's layout.

    ``requantize`` maps a group index to the 8-bit states (codes key -> quantization map) that were
    dequantized because their blocks are not on the group's grid, and that belong in 8 bits again
    (the offline rescue quantizes them once on the aligned grid; a load does it itself).
    """

    def __init__(self, manifest: Manifest, replicated: ReplicatedPayload,
                 pieces: dict[tuple[int, int, str], torch.Tensor],
                 requantize: dict[int, dict[str, torch.Tensor]] | None = None):
        self.manifest = manifest
        self.replicated = replicated
        self._pieces = pieces
        self.requantize = requantize or {}

    def piece(self, rank: int, group_index: int, key: str) -> torch.Tensor:
        return self._pieces[(rank, group_index, key)]

    copy_range = copy_piece_range

    @classmethod
    def open(cls, engine, load_dir: str, tag: str) -> StockCheckpoint:
        """Read the stock files of ``load_dir/tag`` for ``engine`` (a ZeroBnbEngine).

        Raises:
            CheckpointMismatchError: the checkpoint was saved at another DP size.
            CheckpointFormatError: the folder has no ZeRO optimizer files.
            CheckpointCorruptError: a rank file cannot be read.
        """
        optimizer = engine.optimizer
        folder = os.path.join(load_dir, tag)
        names = zero_file_names(folder)
        if not names:
            raise CheckpointFormatError(
                f"{folder} holds neither zero_bnb files ({SUBDIR}/) nor stock DeepSpeed ZeRO optimizer files "
                f"(zero_pp_rank_*_mp_rank_00_optim_states.pt): it is not a complete ZeRO checkpoint; pass the tag of "
                f"a complete one"
            )
        saved_dp = len(names)
        if is_stage3_model_file(model_file_of(folder)[0]):
            raise CheckpointMismatchError(
                f"{folder} is a stock DeepSpeed ZeRO stage-3 checkpoint (DP={saved_dp}); its 8-bit blocks straddle "
                f"parameters and ranks, so zero_bnb reads it only through a one-time conversion: `zero-bnb convert "
                f"{folder} --to zero_bnb OUT` (the result loads at any DP size, at ZeRO stage 3 or 2)"
            )
        if saved_dp != optimizer.dp_size:
            raise CheckpointMismatchError(
                f"{folder} was written by stock DeepSpeed at DP={saved_dp} and has no zero_bnb files; its 8-bit "
                f"state can only be re-split at that DP size. Convert it once with `zero-bnb convert {folder} --to "
                f"zero_bnb OUT` (or resume once at DP={saved_dp} with zero_bnb and save again): the result loads at "
                f"any DP size (now DP={optimizer.dp_size})."
            )
        rank_sds = read_rank_files(names)
        return cls.from_rank_states(
            rank_sds,
            spec=optimizer.zero_bnb_spec,
            rule=optimizer.zero_bnb_rule,
            params=_saved_params(folder, rank_sds, [optimizer.param_entries(g, engine.param_names)
                                                   for g in range(optimizer.num_groups)]),
            optimizer_class=type(optimizer.optimizer).__qualname__,
            live_param_groups=optimizer.optimizer.param_groups,
            log=optimizer.dp_rank == 0,
        )

    @classmethod
    def from_rank_states(
        cls,
        rank_sds: list[dict[str, Any]],
        *,
        spec: OptimizerSpec,
        rule: StateRule,
        params: list[tuple[ParamEntry, ...]],
        optimizer_class: str,
        live_param_groups: list[dict[str, Any]] | None = None,
        log: bool = True,
    ) -> StockCheckpoint:
        """Convert the ``optimizer_state_dict`` of every stock rank file (in rank order).

        Args:
            params: per flat group, its parameters with offsets (the running optimizer's, or
                those recorded in DeepSpeed's model-states file).
            live_param_groups: the running optimizer's param groups, used for hyper-parameters
                when the files hold DeepSpeed's elastic layout (which stores none).

        Raises:
            CheckpointMismatchError: the files do not hold the groups ``params`` describes.
        """
        block = spec.block_size
        states_per_rank = [group_states(sd) for sd in rank_sds]
        pieces: dict[tuple[int, int, str], torch.Tensor] = {}
        groups, replicated_groups, requantize = [], [], {}
        hyperparameters = group_hyperparameters(rank_sds[0]) or [
            {k: v for k, v in group.items() if k != "params"} for group in live_param_groups or []]
        for g in range(len(fp32_partitions(rank_sds[0]))):
            lengths = [fp32_partitions(sd)[g].numel() for sd in rank_sds]
            expected = sum(p.numel for p in params[g]) if g < len(params) else None
            if sum(lengths) != expected:
                raise CheckpointMismatchError(
                    f"group {g} of the stock checkpoint holds {sum(lengths)} elements, the model's parameters "
                    f"{expected}; build the model that wrote it"
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
                kind, _, reason = classify_state(key, value, spec=spec, rule=rule, partition_numel=partition)
                triple = spec.triple_for(key)
                if not aligned and triple is not None and first_state[triple.codes].dtype == torch.uint8:
                    if key != triple.codes:
                        continue  # absmax/qmap are folded into the dequantized codes below
                    for r, n in enumerate(lengths):
                        pieces[(r, g, key)] = quant.state_values(states_per_rank[r][g], key, triple, block, length=n)
                    entries.append(StateEntry(key, StateKind.ELEMENTWISE, "float32", f"{reason}; dequantized"))
                    requantize.setdefault(g, {})[key] = first_state[triple.qmap]
                    requantized.append(key)
                    continue
                entries.append(StateEntry.describe(key, kind, value, reason))
                if is_partitioned(kind):
                    for r, (start, end) in enumerate(saved_ranges(kind, element_ranges, block_ranges)):
                        pieces[(r, g, key)] = states_per_rank[r][g][key][..., : end - start]
                if kind is StateKind.COUNTER:
                    counters[key] = value
                elif kind is StateKind.REPLICATED:
                    replicated[key] = value
            for r, sd in enumerate(rank_sds):
                pieces[(r, g, "fp32")] = fp32_partitions(sd)[g]
            if requantized and log:
                logger.warning(
                    "zero_bnb: stock DeepSpeed partitions of group %d (%d elements) do not start on %d-element "
                    "blocks; requantizing %s on the aligned grid once (lossy within 8-bit precision)",
                    g, partition, block, requantized,
                )
            groups.append(GroupEntry(numel, params[g], tuple(entries), element_ranges, block_ranges))
            replicated_groups.append(ReplicatedGroup(
                param_group=dict(hyperparameters[g]) if g < len(hyperparameters) else {},
                counters=counters,
                replicated=replicated,
            ))
        return cls._assemble(rank_sds, spec, optimizer_class, groups, replicated_groups, pieces, requantize)

    @classmethod
    def _assemble(cls, rank_sds: list[dict[str, Any]], spec: OptimizerSpec, optimizer_class: str,
                  groups: list[GroupEntry], replicated_groups: list[ReplicatedGroup],
                  pieces: dict[tuple[int, int, str], torch.Tensor],
                  requantize: dict[int, dict[str, torch.Tensor]]) -> StockCheckpoint:
        manifest = Manifest(
            dp_world_size=len(rank_sds),
            block_size=spec.block_size,
            optimizer_class=optimizer_class,
            optimizer_spec=spec.name,
            groups=tuple(groups),
            shards=tuple(f"stock rank {r}" for r in range(len(rank_sds))),
            versions={"deepspeed": str(rank_sds[0].get("ds_version", "unknown"))},
        )
        wrapper = plain_wrapper({name: rank_sds[0][name] for name in WRAPPER_SCALARS if name in rank_sds[0]})
        return cls(manifest, ReplicatedPayload(tuple(replicated_groups), wrapper), pieces, requantize)

    @classmethod
    def from_stage3_rank_states(
        cls,
        rank_sds: list[dict[str, Any]],
        *,
        spec: OptimizerSpec,
        rule: StateRule,
        sub_groups: list[tuple[ParamEntry, ...]],
        optimizer_class: str,
        min_8bit_size: int,
    ) -> StockCheckpoint:
        """Convert the ``optimizer_state_dict`` of every stock ZeRO stage-3 rank file (in rank order) into one
        group per parameter, in the sub-groups' order (zero_bnb's stage-3 layout).

        Rank ``r`` holds elements :func:`~zero_bnb.core.stage3.stock_slice_ranges` of every parameter, packed
        ``ceil(numel / dp)`` apart in its sub-group's flat fp32 tensor and in the optimizer state of that tensor.
        8-bit state of a parameter whose slices start on blocks of both the flat tensor and the parameter is
        taken as it is (exact); other 8-bit state is dequantized with its own rank's ``absmax`` and map.
        ``requantize`` names the latter for parameters of at least ``min_8bit_size`` elements (those that
        zero_bnb's stage 3, deciding on the whole parameter, keeps in 8 bits); smaller ones keep the
        dequantized fp32 values, exactly.

        Args:
            sub_groups: per sub-group, its parameters (DeepSpeed's ``param_shapes`` record; offsets unused).

        Raises:
            CheckpointMismatchError: the files do not hold the sub-groups ``sub_groups`` describes, or hold
                state of one value per partition, which no parameter can be given.
        """
        dp, block = len(rank_sds), spec.block_size
        flats = [fp32_partitions(sd) for sd in rank_sds]
        states = [group_states(sd) for sd in rank_sds]
        hyperparameters = group_hyperparameters(rank_sds[0])
        counts = {len(flats[r]) for r in range(dp)} | {len(states[r]) for r in range(dp)}
        if counts != {len(sub_groups)} or hyperparameters is None or len(hyperparameters) != len(sub_groups):
            raise CheckpointMismatchError(
                f"the stock stage-3 rank files hold {sorted(counts)} sub-groups, DeepSpeed's model file "
                f"{len(sub_groups)}; the checkpoint is inconsistent (files of different saves?)"
            )
        pieces: dict[tuple[int, int, str], torch.Tensor] = {}
        groups, replicated_groups, requantize = [], [], {}
        for g, params in enumerate(sub_groups):
            sizes = [ceil_div(p.numel, dp) for p in params]
            wrong = [r for r in range(dp) if flats[r][g].numel() != sum(sizes)]
            if wrong:
                raise CheckpointMismatchError(
                    f"sub-group {g} of stock rank {wrong[0]} holds {flats[wrong[0]][g].numel()} elements, its "
                    f"parameters {[p.name for p in params]} need {sum(sizes)} at DP={dp}; build the model that wrote it"
                )
            values: dict[tuple[int, str], torch.Tensor] = {}  # (rank, codes key) -> the sub-group's dequantized state

            def dequantized(r: int, key: str, triple) -> torch.Tensor:
                if (r, key) not in values:
                    values[(r, key)] = quant.state_values(states[r][g], key, triple, block)
                return values[(r, key)]

            first, offset = states[0][g], 0
            for param, size in zip(params, sizes):
                index = len(groups)
                ranges = stock_slice_ranges(param.numel, dp)
                block_ranges = tuple((start // block, ceil_div(end, block)) for start, end in ranges)
                aligned = size % block == 0 and offset % block == 0
                entries, counters, replicated, folded = [], {}, {}, {}
                for key, value in sorted(first.items()):
                    kind, _, reason = classify_state(key, value, spec=spec, rule=rule, partition_numel=sum(sizes))
                    triple = spec.triple_for(key)
                    if not aligned and triple is not None and first[triple.codes].dtype == torch.uint8:
                        if key == triple.codes:  # absmax/qmap are folded into the dequantized codes
                            for r, (start, end) in enumerate(ranges):
                                pieces[(r, index, key)] = dequantized(r, key, triple)[..., offset : offset + end - start]
                            entries.append(StateEntry(key, StateKind.ELEMENTWISE, "float32", f"{reason}; dequantized"))
                            folded[key] = first[triple.qmap]
                        continue
                    if kind is StateKind.PARTITION_SCALAR:
                        raise CheckpointMismatchError(
                            f"stock stage-3 sub-group {g} holds {key!r}, one value per rank's partition of "
                            f"{[p.name for p in params]}, which cannot be given to one parameter; disable the setting "
                            f"that creates it (max_unorm, non-blockwise 8-bit state) and train from the weights"
                        )
                    entries.append(StateEntry.describe(key, kind, value, reason))
                    if is_partitioned(kind):
                        origin = to_axis(kind, offset, offset, block)[0]
                        for r, (start, end) in enumerate(saved_ranges(kind, ranges, block_ranges)):
                            pieces[(r, index, key)] = states[r][g][key][..., origin : origin + end - start]
                    elif kind is StateKind.COUNTER:
                        counters[key] = value
                    elif kind is StateKind.REPLICATED:
                        replicated[key] = value
                for r, (start, end) in enumerate(ranges):
                    pieces[(r, index, "fp32")] = flats[r][g][offset : offset + end - start]
                if folded and param.numel >= min_8bit_size:
                    requantize[index] = folded
                groups.append(GroupEntry(param.numel, (ParamEntry(param.name, param.shape, 0),), tuple(entries),
                                         ranges, block_ranges))
                replicated_groups.append(ReplicatedGroup(param_group=dict(hyperparameters[g]), counters=counters,
                                                         replicated=replicated))
                offset += size
        return cls._assemble(rank_sds, spec, optimizer_class, groups, replicated_groups, pieces, requantize)
