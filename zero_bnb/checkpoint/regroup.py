"""Load saved optimizer state into other flat groups, matching parameters by name.

A checkpoint's flat groups are the optimizer's param groups as ZeRO flattened them. They
change when bitsandbytes per-parameter overrides do: zero_bnb gives every overridden
parameter a group of its own (:mod:`zero_bnb.bnb.overrides`), stock DeepSpeed silently drops the
overrides and keeps them in their original group. So a stock Trainer checkpoint (its
embeddings in the decay group) and zero_bnb's engine for the same model (embeddings in groups
of their own, 32-bit) hold the same parameters in different groups. :func:`by_name` detects
that case and presents the saved state regrouped like the running optimizer: every
parameter's master weight, and its moments dequantized to fp32 (the loader quantizes them
again where the new group keeps 8-bit state, once, on the aligned grid, and logs it).

Local, no collectives; every rank computes the same result (rank 0 logs).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from zero_bnb.checkpoint.restore import SavedState, copy_piece_range
from zero_bnb.checkpoint.whole import FullGroup, gather_full
from zero_bnb.core import quant
from zero_bnb.core.layout import ceil_div
from zero_bnb.core.state_spec import OptimizerSpec, StateKind
from zero_bnb.errors import CheckpointMismatchError
from zero_bnb.format.manifest import MASTER_KEY, GroupEntry, Manifest, ParamEntry, StateEntry
from zero_bnb.format.payload import ReplicatedGroup, ReplicatedPayload

__all__ = ["RegroupedState", "by_name", "for_engine", "live_params"]

logger = logging.getLogger(__name__)


def live_params(optimizer: Any, names: dict) -> list[tuple[ParamEntry, ...]]:
    """Per flat group of the running (block-aligned) optimizer, its parameters with offsets."""
    return [optimizer.param_entries(index, names) for index in range(optimizer.num_groups)]


def for_engine(engine: Any, saved: SavedState) -> SavedState:
    """:func:`by_name` for a :class:`~zero_bnb.ds.engine.ZeroBnbEngine` (its optimizer, names and overrides). Local."""
    optimizer = engine.optimizer
    return by_name(saved, live_params(optimizer, engine.param_names), optimizer.zero_bnb_spec,
                   getattr(engine, "zero_bnb_isolated", None), log=optimizer.dp_rank == 0)


class RegroupedState:
    """A :class:`~zero_bnb.checkpoint.restore.SavedState` in the running optimizer's grouping (one whole shard per group)."""

    def __init__(self, manifest: Manifest, replicated: ReplicatedPayload, pieces: dict[tuple[int, str], torch.Tensor]):
        self.manifest = manifest
        self.replicated = replicated
        self._pieces = pieces

    def piece(self, rank: int, group_index: int, key: str) -> torch.Tensor:
        return self._pieces[(group_index, key)]

    copy_range = copy_piece_range


def _flatten_by_param(group: FullGroup, spec: OptimizerSpec, block_size: int) -> tuple[dict, dict[str, str], dict]:
    """Per parameter name: ``{key: tensor slice}`` (8-bit moments dequantized), plus dtypes and the rest of the state."""
    whole: dict[str, torch.Tensor] = {MASTER_KEY: group.fp32}
    folded: set[str] = set()
    other: dict[str, tuple[StateKind, Any]] = {}
    for item in group.states:
        value = group.state[item.key]
        triple = spec.triple_for(item.key)
        if item.kind is StateKind.ELEMENTWISE:
            if triple is not None and value.dtype == torch.uint8:
                whole[item.key] = quant.state_values(group.state, item.key, triple, block_size)
                folded |= {triple.absmax, triple.qmap}
            else:
                whole[item.key] = value
        elif item.kind in (StateKind.COUNTER, StateKind.REPLICATED):
            other[item.key] = (item.kind, value)
        elif item.kind is not StateKind.BLOCKWISE or triple is None:
            raise CheckpointMismatchError(
                f"the checkpoint's {item.kind.value} state {item.key!r} cannot be moved to another parameter group; "
                f"load it into an optimizer with the same param groups as the run that wrote it"
            )
    other = {key: value for key, value in other.items() if key not in folded}
    slices = {p.name: {key: flat[..., p.offset : p.offset + p.numel] for key, flat in whole.items()} for p in group.params}
    return slices, {key: str(value.dtype).removeprefix("torch.") for key, value in whole.items()}, other


def _mismatch(saved: dict[str, ParamEntry], live: dict[str, ParamEntry]) -> str:
    missing, extra = sorted(set(saved) - set(live)), sorted(set(live) - set(saved))
    reshaped = [f"{n}: saved {saved[n].shape}, model {live[n].shape}" for n in sorted(set(saved) & set(live))
                if saved[n].shape != live[n].shape]
    parts = [f"only in checkpoint: {missing}" if missing else "", f"only in model: {extra}" if extra else "",
             f"shape differs: {reshaped}" if reshaped else ""]
    return "; ".join(part for part in parts if part)


def by_name(saved: SavedState, live: list[tuple[ParamEntry, ...]], spec: OptimizerSpec,
            overrides: list[str] | None = None, *, log: bool = True) -> SavedState:
    """``saved`` as it is when its groups hold the live parameters; else regrouped by parameter name.

    Args:
        live: per flat group of the running optimizer, its parameters (:func:`live_params`).
        overrides: names of the parameters the running optimizer isolated for their
            bitsandbytes overrides, for the error message.

    Raises:
        CheckpointMismatchError: the checkpoint holds other parameters (names or shapes) than
            the model, or state that cannot move between groups; names the cause.
    """
    saved_groups = [group.params for group in saved.manifest.groups]
    if saved_groups == [tuple(group) for group in live]:
        return saved
    saved_params = {p.name: p for group in saved_groups for p in group}
    live_by_name = {p.name: p for group in live for p in group}
    differences = _mismatch(saved_params, live_by_name)
    if differences:
        isolated = ""
        if overrides:
            isolated = (f"; the running optimizer also gives {sorted(overrides)} groups of their own because of their "
                        f"bitsandbytes overrides (GlobalOptimManager)")
        raise CheckpointMismatchError(
            f"cannot load this checkpoint into the running engine: the checkpoint has {len(saved_groups)} parameter "
            f"groups, the optimizer {len(live)}, and the parameters differ ({differences}){isolated}. Build the model "
            f"that wrote it, or load with load_module_only=True."
        )
    return _regroup(saved, live, spec, log=log)


def _regroup(saved: SavedState, live: list[tuple[ParamEntry, ...]], spec: OptimizerSpec, *, log: bool) -> RegroupedState:
    block = saved.manifest.block_size
    source_of: dict[str, int] = {}
    slices: dict[str, dict[str, torch.Tensor]] = {}
    dtypes, others, records = [], [], []
    for index, group in enumerate(gather_full(saved)):
        group_slices, group_dtypes, other = _flatten_by_param(group, spec, block)
        slices.update(group_slices)
        source_of.update({p.name: index for p in group.params})
        dtypes.append(group_dtypes)
        others.append(other)
        records.append(group)
    pieces: dict[tuple[int, str], torch.Tensor] = {}
    entries, replicated_groups = [], []
    for target, params in enumerate(live):
        sources = sorted({source_of[p.name] for p in params})
        first = sources[0]
        hyper = {k: v for k, v in records[first].param_group.items() if k != "params"}
        for other_source in sources[1:]:
            differing = sorted(k for k, v in records[other_source].param_group.items()
                               if k != "params" and hyper.get(k) != v)
            if differing or others[other_source].keys() != others[first].keys() or dtypes[other_source] != dtypes[first]:
                raise CheckpointMismatchError(
                    f"flat group {target} of the running optimizer takes parameters from saved groups {sources}, which "
                    f"differ in {differing or 'optimizer state layout'}; give those parameters the same param group "
                    f"settings as the run that wrote the checkpoint"
                )
            counters = {k: v for k, (kind, v) in others[other_source].items() if kind is StateKind.COUNTER}
            if any(_differs(v, others[first][k][1]) for k, v in counters.items()):
                raise CheckpointMismatchError(
                    f"flat group {target} of the running optimizer takes parameters from saved groups {sources}, "
                    f"whose step counters differ; they cannot share one group"
                )
        numel = sum(p.numel for p in params)
        for key in dtypes[first]:
            pieces[(target, key)] = torch.cat([slices[p.name][key] for p in params], dim=-1).contiguous()
        states = tuple(
            StateEntry(key, StateKind.ELEMENTWISE, dtype, "regrouped by parameter name", tuple(pieces[(target, key)].shape[:-1]))
            for key, dtype in dtypes[first].items() if key != MASTER_KEY
        ) + tuple(StateEntry(key, kind, "", "regrouped by parameter name") for key, (kind, _) in others[first].items())
        entries.append(GroupEntry(numel, tuple(params), states, ((0, numel),), ((0, ceil_div(numel, block)),),
                                  saved.manifest.groups[first].hyperparameters))
        replicated_groups.append(ReplicatedGroup(
            param_group=hyper,
            counters={k: v for k, (kind, v) in others[first].items() if kind is StateKind.COUNTER},
            replicated={k: v for k, (kind, v) in others[first].items() if kind is StateKind.REPLICATED},
        ))
    if log:
        logger.warning(
            "zero_bnb: the checkpoint's %d flat groups differ from the optimizer's %d (bitsandbytes overrides isolate "
            "parameters in groups of their own, stock DeepSpeed does not; ZeRO stage 3 keeps one group per parameter, "
            "stages 1 and 2 one per param group); state mapped by parameter name, 8-bit moments dequantized and "
            "requantized where the new group is 8-bit (once)",
            len(saved.manifest.groups), len(live),
        )
    old = saved.manifest
    manifest = Manifest(dp_world_size=1, block_size=block, optimizer_class=old.optimizer_class,
                        optimizer_spec=old.optimizer_spec, groups=tuple(entries), shards=("regrouped",),
                        non_finite=old.non_finite, versions=old.versions, batch=old.batch)
    return RegroupedState(manifest, ReplicatedPayload(tuple(replicated_groups), saved.replicated.wrapper), pieces)


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a != b
