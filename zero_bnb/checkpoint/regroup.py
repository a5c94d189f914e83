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

from zero_bnb.checkpoint.restore import RestorePlan, SavedState, copy_piece_range, master_weights, saved_dp
from zero_bnb.checkpoint.whole import FullGroup, gather_full
from zero_bnb.core import quant
from zero_bnb.core.kinds import local_range
from zero_bnb.core.layout import ceil_div
from zero_bnb.core.state_spec import OptimizerSpec, StateKind
from zero_bnb.errors import CheckpointMismatchError
from zero_bnb.format.manifest import MASTER_KEY, GroupEntry, Manifest, ParamEntry, StateEntry
from zero_bnb.format.payload import ReplicatedGroup, ReplicatedPayload

__all__ = ["RegroupedState", "by_name", "for_engine", "keep_fresh_masters", "live_params", "masters_by_name",
           "saved_fresh_weights"]

logger = logging.getLogger(__name__)


def live_params(optimizer: Any, names: dict) -> list[tuple[ParamEntry, ...]]:
    """Per flat group of the running (block-aligned) optimizer, its parameters with offsets."""
    return [optimizer.param_entries(index, names) for index in range(optimizer.num_groups)]


def for_engine(engine: Any, saved: SavedState, *, module_only: bool = False) -> SavedState:
    """:func:`by_name` for a :class:`~zero_bnb.ds.engine.ZeroBnbEngine` (its optimizer, names and overrides); with
    ``module_only``, :func:`masters_by_name` (a weights-only load into a changed model). Local."""
    optimizer = engine.optimizer
    live = live_params(optimizer, engine.param_names)
    if module_only:
        aliases: dict[str, list[str]] = {}
        for name, param in engine.module.named_parameters(remove_duplicate=False):
            if param in engine.param_names:
                aliases.setdefault(engine.param_names[param], []).append(name)
        return masters_by_name(saved, live, aliases)
    return by_name(saved, live, optimizer.zero_bnb_spec, getattr(engine, "zero_bnb_isolated", None),
                   log=optimizer.dp_rank == 0)


def masters_by_name(saved: SavedState, live: list[tuple[ParamEntry, ...]],
                    aliases: dict[str, list[str]] | None = None) -> SavedState:
    """``saved`` as it is when its groups hold the live parameters; else only its master weights, regrouped like the
    running optimizer by parameter name, for a weights-only load (``load_module_only``) into a changed model.

    A live parameter takes the saved master of its name or of another name it has in the module (``aliases``: a
    tied weight whose first name changed with the module's definition order). A live parameter with none (a new
    head) is listed in the result's ``fresh`` and keeps its current weights (:func:`keep_fresh_masters`); saved
    parameters the model lacks are left out. Whether the module's entries may be missing or unexpected
    (``load_module_strict``) is the model file's check (:func:`~zero_bnb.checkpoint.model_file.check_model_states`).

    Raises:
        CheckpointMismatchError: a parameter whose saved master has another shape, naming it and both shapes.
    """
    saved_groups = [group.params for group in saved.manifest.groups]
    if saved_groups == [tuple(group) for group in live]:
        return saved
    saved_params = {p.name: p for group in saved_groups for p in group}
    master = master_weights(saved)
    block = saved.manifest.block_size
    pieces: dict[tuple[int, str], torch.Tensor] = {}
    entries, fresh, reshaped = [], [], []
    for target, params in enumerate(live):
        numel = sum(p.numel for p in params)
        flat = torch.zeros(numel, dtype=torch.float32)
        for p in params:
            source = next((name for name in (aliases or {}).get(p.name, [p.name]) if name in saved_params), None)
            if source is None:
                fresh.append(p.name)
            elif saved_params[source].shape != p.shape:
                reshaped.append(f"{p.name}: saved {saved_params[source].shape}, model {p.shape}")
            else:
                master(source, out=flat[p.offset : p.offset + p.numel])
        pieces[(target, MASTER_KEY)] = flat
        entries.append(GroupEntry(numel, tuple(params), (), ((0, numel),), ((0, ceil_div(numel, block)),)))
    if reshaped:
        raise CheckpointMismatchError(
            f"cannot load the module weights of this checkpoint into the running model: parameter shapes differ "
            f"({reshaped}). Build the model that wrote it, or give the changed parameters new names"
        )
    old = saved.manifest
    manifest = Manifest(dp_world_size=1, block_size=block, optimizer_class=old.optimizer_class,
                        optimizer_spec=old.optimizer_spec, groups=tuple(entries), shards=("regrouped",),
                        non_finite=old.non_finite, versions=old.versions, batch=old.batch,
                        migrated_from=old.migrated_from)
    empty = ReplicatedGroup(param_group={}, counters={}, replicated={})
    state = RegroupedState(manifest, ReplicatedPayload((empty,) * len(live), saved.replicated.wrapper), pieces,
                           origin_dp=saved_dp(saved), source_dtypes=({},) * len(live))
    state.fresh = frozenset(fresh)
    return state


def saved_fresh_weights(fresh: frozenset[str], model_states: Any, numels: dict[str, int],
                        model_file: str) -> dict[str, torch.Tensor]:
    """The weights DeepSpeed's model file holds for ``fresh`` parameters (:func:`masters_by_name`: no saved master),
    flat and in fp32: those frozen when it was saved. DeepSpeed's module load sets such a parameter to its saved
    weight, so its master must be that weight too (as stock DeepSpeed's ``refresh_fp32_params`` makes it), or the
    next step would put the model's old weight back. Local, pure.

    Args:
        numels: each live parameter's name -> its number of elements (the whole parameter at stage 3).

    Raises:
        CheckpointMismatchError: the file holds only a part of such a weight (a ZeRO-3 save keeps a frozen
            parameter's slices in each rank's model file and an empty entry here), naming the parameters and the fix.
    """
    module = model_states.get("module") if isinstance(model_states, dict) else None
    if not fresh or not isinstance(module, dict):
        return {}
    weights, partial = {}, []
    for name in sorted(fresh):
        entry = module.get(name)
        if not isinstance(entry, torch.Tensor):
            continue  # a new parameter: it keeps its weights
        if entry.numel() != numels[name]:
            partial.append(f"{name} ({entry.numel()} of {numels[name]} elements)")
        else:
            weights[name] = entry.detach().reshape(-1).to(torch.float32)
    if partial:
        raise CheckpointMismatchError(
            f"{model_file}: parameter(s) {partial[:5]} were frozen when this checkpoint was saved and are trained now, "
            f"but its model file holds only a part of their weights (a ZeRO-3 save keeps each rank's slice of a frozen "
            f"parameter in that rank's file), so a weights-only load cannot start them from their saved values. "
            f"Write the whole weights with `zero-bnb export` (or the folder's zero_to_fp32.py), load them into the "
            f"model before zero_bnb.initialize, and start without load_checkpoint; or freeze them as the saved run did"
        )
    return weights


def keep_fresh_masters(optimizer: Any, plan: RestorePlan, fresh: frozenset[str], names: dict,
                       saved_weights: dict[str, torch.Tensor]) -> None:
    """Put the master weights of the ``fresh`` parameters (:func:`masters_by_name`) into ``plan``'s partitions of
    this rank: from ``saved_weights`` (:func:`saved_fresh_weights`: the weights DeepSpeed's module load gives them)
    where it has them, else the running optimizer's current ones, so that a new parameter keeps its weights. Local."""
    if not fresh:
        return
    for group in plan.groups:
        start, end = local_range(StateKind.ELEMENTWISE, optimizer.geometry(group.index), optimizer.dp_rank)
        current = optimizer.master_partition(group.index).detach()
        for p in optimizer.param_entries(group.index, names):
            low, high = max(start, p.offset), min(end, p.offset + p.numel)
            if p.name not in fresh or low >= high:
                continue
            if p.name in saved_weights:
                source = saved_weights[p.name][low - p.offset : high - p.offset]
            else:
                source = current[low - start : high - start]
            group.master[low - start : high - start].copy_(source)


class RegroupedState:
    """A :class:`~zero_bnb.checkpoint.restore.SavedState` in the running optimizer's grouping (one whole shard per group).
    ``fresh``: live parameters it holds no saved master of (:func:`masters_by_name`)."""

    def __init__(self, manifest: Manifest, replicated: ReplicatedPayload, pieces: dict[tuple[int, str], torch.Tensor],
                 *, origin_dp: int | None = None, source_dtypes: tuple[dict[str, tuple[str, ...]], ...] | None = None):
        self.manifest = manifest
        self.replicated = replicated
        self._pieces = pieces
        self.fresh: frozenset[str] = frozenset()
        #: the DP size the checkpoint was saved at (``manifest`` describes one whole shard); ``None``: the manifest's
        self.origin_dp = origin_dp
        #: per group, each element-wise key's dtypes in the checkpoint (8-bit moments are held here in fp32);
        #: ``None``: not regrouped, the manifest's dtypes are the checkpoint's
        self.source_dtypes = source_dtypes

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
    dtypes, others, records, originals = [], [], [], []
    for index, group in enumerate(gather_full(saved)):
        group_slices, group_dtypes, other = _flatten_by_param(group, spec, block)
        slices.update(group_slices)
        source_of.update({p.name: index for p in group.params})
        dtypes.append(group_dtypes)
        others.append(other)
        records.append(group)
        originals.append({item.key: str(group.state[item.key].dtype).removeprefix("torch.") for item in group.states
                          if item.kind is StateKind.ELEMENTWISE})
    pieces: dict[tuple[int, str], torch.Tensor] = {}
    entries, replicated_groups, source_dtypes = [], [], []
    for target, params in enumerate(live):
        sources = sorted({source_of[p.name] for p in params})
        first = sources[0]
        source_dtypes.append({key: tuple(sorted({originals[index][key] for index in sources if key in originals[index]}))
                              for key in originals[first]})
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
    if log:  # INFO: the load's own WARNING names each group whose state was requantized (checkpoint/precision.py)
        logger.info(
            "zero_bnb: the checkpoint's %d flat groups differ from the optimizer's %d (bitsandbytes overrides isolate "
            "parameters in groups of their own, stock DeepSpeed does not; ZeRO stage 3 keeps one group per parameter, "
            "stages 1 and 2 one per param group); state mapped by parameter name, 8-bit moments dequantized and "
            "requantized where the new group is 8-bit (once)",
            len(saved.manifest.groups), len(live),
        )
    old = saved.manifest
    manifest = Manifest(dp_world_size=1, block_size=block, optimizer_class=old.optimizer_class,
                        optimizer_spec=old.optimizer_spec, groups=tuple(entries), shards=("regrouped",),
                        non_finite=old.non_finite, versions=old.versions, batch=old.batch,
                        migrated_from=old.migrated_from)
    return RegroupedState(manifest, ReplicatedPayload(tuple(replicated_groups), saved.replicated.wrapper), pieces,
                          origin_dp=saved_dp(saved), source_dtypes=tuple(source_dtypes))


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a != b
