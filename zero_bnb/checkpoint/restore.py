"""Fill a :class:`~zero_bnb.checkpoint.partitioned.PartitionedOptimizer` optimizer from a saved checkpoint at any DP size.

Loading is all-or-nothing: :func:`plan_restore` reads everything (each rank only the saved
ranges that overlap its new partition) into new tensors and raises on any mismatch without
touching the optimizer; :func:`apply_restore` then swaps the planned values in and cannot
fail. While a plan is held, the new state and the old one both exist (one partition's
optimizer state and master weights more than training needs).

No collectives: both may be called on every rank independently, and must be called on all
of them for the engine to be consistent (the engine agrees on the plan's success first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zero_bnb.checkpoint.partitioned import PartitionedOptimizer
from zero_bnb.checkpoint.precision import Conversion
from zero_bnb.core import quant
from zero_bnb.core.kinds import is_partitioned, local_range, saved_length, saved_ranges, whole_length
from zero_bnb.core.layout import plan_copy
from zero_bnb.core.state_spec import StateKind
from zero_bnb.errors import CheckpointFormatError, CheckpointMismatchError
from zero_bnb.format.manifest import MASTER_KEY, GroupEntry, Manifest
from zero_bnb.format.payload import ReplicatedPayload
from zero_bnb.format.values import undeclared_non_finite

__all__ = [
    "GroupPlan",
    "RestorePlan",
    "SavedState",
    "apply_masters",
    "apply_restore",
    "check_compatible",
    "check_family",
    "copy_piece_range",
    "gather_range",
    "master_weights",
    "plan_restore",
    "saved_dp",
]

logger = logging.getLogger(__name__)

class SavedState(Protocol):
    """What :func:`plan_restore` reads: a manifest, the replicated payload, and shard pieces.

    A state regrouped by parameter name (:class:`~zero_bnb.checkpoint.regroup.RegroupedState`) also has
    ``origin_dp`` (the DP size the checkpoint was saved at; its ``manifest`` describes one whole shard) and
    ``source_dtypes`` (per group, each element-wise key's dtypes in the checkpoint, before 8-bit moments were
    dequantized): what a load's messages report (:func:`saved_dp`, :class:`~zero_bnb.checkpoint.precision.Conversion`).
    """

    manifest: Manifest
    replicated: ReplicatedPayload

    def piece(self, rank: int, group_index: int, key: str) -> torch.Tensor:
        """Saved tensor ``key`` (``"fp32"`` for master weights) of group ``group_index`` from shard ``rank``."""

    def copy_range(self, rank: int, group_index: int, key: str, offset: int, out: torch.Tensor) -> None:
        """Elements ``[offset, offset + out.shape[-1])`` (last axis) of :meth:`piece` into ``out``
        (:func:`copy_piece_range`, or straight from what the piece is made of)."""


def saved_dp(saved: SavedState) -> int:
    """The DP size ``saved`` was written at (that of the checkpoint, also when it was regrouped by parameter name)."""
    origin = getattr(saved, "origin_dp", None)
    return saved.manifest.dp_world_size if origin is None else origin


def copy_piece_range(saved: SavedState, rank: int, group_index: int, key: str, offset: int, out: torch.Tensor) -> None:
    """:meth:`SavedState.copy_range` as a slice of :meth:`SavedState.piece`."""
    out.copy_(saved.piece(rank, group_index, key)[..., offset : offset + out.shape[-1]])


def check_compatible(
    optimizer: PartitionedOptimizer, manifest: Manifest, names: dict, *, optimizer_states: bool = True
) -> None:
    """Refuse a checkpoint whose groups, parameters or (with ``optimizer_states``) optimizer differ.

    Local, reads nothing but the manifest.

    Raises:
        CheckpointMismatchError: lists every difference found and what to do.
    """
    problems = []
    if len(manifest.groups) != optimizer.num_groups:
        problems.append(f"the checkpoint has {len(manifest.groups)} parameter groups, the optimizer {optimizer.num_groups}")
    for index, saved in enumerate(manifest.groups[: optimizer.num_groups]):
        current = optimizer.param_entries(index, names)
        if saved.params == current:
            continue
        saved_by_name = {p.name: p for p in saved.params}
        current_by_name = {p.name: p for p in current}
        missing = sorted(set(saved_by_name) - set(current_by_name))
        extra = sorted(set(current_by_name) - set(saved_by_name))
        reshaped = [
            f"{name}: saved {saved_by_name[name].shape}, model {current_by_name[name].shape}"
            for name in sorted(set(saved_by_name) & set(current_by_name))
            if saved_by_name[name].shape != current_by_name[name].shape
        ]
        detail = "; ".join(
            part
            for part in (
                f"only in checkpoint: {missing}" if missing else "",
                f"only in model: {extra}" if extra else "",
                f"shape differs: {reshaped}" if reshaped else "",
            )
            if part
        ) or "same parameters in another order"
        problems.append(f"group {index} differs ({detail})")
    spec = optimizer.zero_bnb_spec
    if optimizer_states:
        problems += _family_problems(optimizer, manifest)
    if optimizer_states and manifest.optimizer_spec == spec.name:
        for index, saved in enumerate(manifest.groups[: optimizer.num_groups]):
            current = optimizer.base_group(index)
            for key in spec.layout_hyperparameters:
                if key in saved.hyperparameters and saved.hyperparameters[key] != current.get(key):
                    problems.append(f"group {index} was saved with {key}={saved.hyperparameters[key]!r}, which "
                                    f"changes the optimizer's state keys, but the optimizer has {key}={current.get(key)!r}")
    _raise_mismatch(problems)


def _family_problems(optimizer: PartitionedOptimizer, manifest: Manifest) -> list[str]:
    spec = optimizer.zero_bnb_spec
    problems = []
    if manifest.optimizer_spec != spec.name:
        problems.append(f"the checkpoint was written by {manifest.optimizer_class} ({manifest.optimizer_spec}), "
                        f"the running optimizer is {type(optimizer.optimizer).__name__} ({spec.name})")
    if manifest.block_size != spec.block_size:
        problems.append(f"the checkpoint's block size is {manifest.block_size}, the optimizer's {spec.block_size}")
    return problems


def _raise_mismatch(problems: list[str]) -> None:
    if problems:
        raise CheckpointMismatchError(
            "cannot load this checkpoint into the running engine: " + "; ".join(problems)
            + ". Build the same model and optimizer that wrote it, or load with load_module_only=True."
        )


def check_family(optimizer: PartitionedOptimizer, manifest: Manifest) -> None:
    """Refuse a checkpoint of another optimizer family or block size (manifest only, before any file is read).

    Raises:
        CheckpointMismatchError: names both families or block sizes.
    """
    _raise_mismatch(_family_problems(optimizer, manifest))


def gather_range(saved: SavedState, group_index: int, key: str, ranges, target: tuple[int, int], out: torch.Tensor) -> None:
    """Copy the global ``target`` range of saved ``key`` (held in pieces at ``ranges``) into ``out[..., : length]``.

    Ranges run along the last axis (the partition axis); leading axes are copied whole.
    """
    for segment in plan_copy(ranges, target):
        saved.copy_range(segment.source, group_index, key, segment.src_offset,
                         out[..., segment.dst_offset : segment.dst_offset + segment.length])


def master_weights(saved: SavedState) -> Callable[..., torch.Tensor]:
    """A lookup: parameter name -> its whole fp32 master weight, in its shape, from any saved DP size.

    The name index is built once; each call reads only that parameter's saved ranges, into a new
    fp32 tensor, or with ``out=`` into that flat tensor of the parameter's size (any floating dtype:
    ``copy_`` casts exactly as ``Tensor.to`` does).
    """
    where = {param.name: (index, group, param) for index, group in enumerate(saved.manifest.groups)
             for param in group.params}

    def master_weight(name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        if name not in where:
            raise CheckpointMismatchError(f"the checkpoint has no master weight for parameter {name!r}")
        index, group, param = where[name]
        out = torch.empty(param.numel, dtype=torch.float32) if out is None else out
        gather_range(saved, index, MASTER_KEY, group.element_ranges, (param.offset, param.offset + param.numel), out)
        return out.view(param.shape)

    return master_weight


class _GroupRestorer:
    """Restores one flat group of one rank; a helper of :func:`plan_restore`."""

    def __init__(self, optimizer: PartitionedOptimizer, saved: SavedState, group_index: int) -> None:
        self.optimizer = optimizer
        self.saved = saved
        self.index = group_index
        self.entry: GroupEntry = saved.manifest.groups[group_index]
        self.record = saved.replicated.groups[group_index]
        self.geometry = geometry = optimizer.geometry(group_index)
        self.block_size = geometry.block_size
        self.param = optimizer.master_partition(group_index)
        sources = getattr(saved, "source_dtypes", None)
        self.regrouped = sources is not None
        self.sources: dict[str, tuple[str, ...]] = sources[group_index] if sources is not None else {}

    def gather(self, kind: StateKind, key: str, out: torch.Tensor) -> None:
        """This rank's range of saved ``key`` (of partitioned ``kind``) into ``out[..., :length]``."""
        ranges = saved_ranges(kind, self.entry.element_ranges, self.entry.block_ranges)
        gather_range(self.saved, self.index, key, ranges, local_range(kind, self.geometry, self.optimizer.dp_rank), out)

    def master(self) -> torch.Tensor:
        """The new partition's master weights (padding zero), in a new tensor."""
        values = torch.empty(self.param.numel(), dtype=self.param.dtype)
        values[self._length(StateKind.ELEMENTWISE):].zero_()  # the gather fills the rest (plan_copy tiles it)
        self.gather(StateKind.ELEMENTWISE, MASTER_KEY, values)
        return values

    def fresh_state(self) -> dict[str, Any]:
        """Empty state for the new partition, as the optimizer itself would create it; the optimizer is left as it was."""
        base = self.optimizer.optimizer
        init_state = self.optimizer.zero_bnb_spec.init_state
        if init_state is not None:
            previous = base.state.pop(self.param, None)
            try:
                init_state(base, self.optimizer.base_group_index(self.index), self.param)
                return base.state.pop(self.param, {})
            finally:
                base.state.pop(self.param, None)
                if previous is not None:
                    base.state[self.param] = previous
        state: dict[str, Any] = {}
        for saved in self.entry.states:
            if is_partitioned(saved.kind):
                length = whole_length(saved.kind, self.param.numel(), self.block_size)  # the padded partition
                state[saved.key] = torch.zeros(*saved.lead, length, dtype=getattr(torch, saved.dtype),
                                               device=self.param.device)
        return state

    def planned_state(self) -> tuple[dict[str, Any] | None, list[Conversion]]:
        """The new state (``None``: none) and the element-wise states loaded in another form than saved (8-bit <->
        fp32, or regrouped 8-bit moments quantized again); the optimizer is not touched."""
        if not self.entry.states:
            return None, []
        state = self.fresh_state()
        spec = self.optimizer.zero_bnb_spec
        keys = list(state) + [s.key for s in self.entry.states if s.key not in state]
        notes, done = [], set()
        for key in keys:
            if key in done:
                continue
            saved = self.entry.state(key)
            triple = spec.triple_for(key)
            current = state.get(key)
            if saved is None or current is None:
                if triple is not None and key != triple.codes and self._converted(triple, state):
                    continue  # absmax/qmap of a state that changes between 8-bit and fp32
                if saved is None:
                    raise CheckpointMismatchError(
                        f"the optimizer creates state {key!r} for group {self.index} but the checkpoint has no "
                        f"such state (it has {[s.key for s in self.entry.states]}); it was written by another "
                        f"optimizer configuration"
                    )
            if saved.kind is StateKind.COUNTER:
                value = self.record.counters[key]
                if isinstance(value, torch.Tensor):
                    value = value.clone().to(current.device if isinstance(current, torch.Tensor) else "cpu")
                state[key] = value
            elif saved.kind is StateKind.REPLICATED:
                device = current.device if isinstance(current, torch.Tensor) else self.param.device
                state[key] = self.record.replicated[key].clone().to(device)
            elif current is None:
                raise CheckpointMismatchError(
                    f"the checkpoint holds {saved.kind.value} state {key!r} for group {self.index}, which the "
                    f"running optimizer does not create (it creates {sorted(state)}); it was written by another "
                    f"optimizer configuration"
                )
            elif saved.kind is StateKind.BLOCKWISE:
                current.zero_()
                self.gather(StateKind.BLOCKWISE, key, current)
            else:  # element-wise: the manifest admits no other kind (Manifest.validate)
                saved_dtype = getattr(torch, saved.dtype)
                if saved_dtype == current.dtype:
                    self._restore_same_dtype(key, current, state, triple)
                elif triple is not None and saved_dtype == torch.uint8:
                    self._dequantize_into(triple, current)
                elif triple is not None and current.dtype == torch.uint8:
                    self._quantize_into(triple, state)
                    done.add(triple.absmax)
                else:
                    raise CheckpointMismatchError(
                        f"state {key!r} of group {self.index} was saved as {saved.dtype} but the optimizer holds it "
                        f"as {current.dtype}, and zero_bnb knows no exact conversion"
                    )
                conversion = self._conversion(key, saved.dtype, current)
                if conversion is not None:
                    notes.append(conversion)
        return state, notes

    def _conversion(self, key: str, dtype: str, current: torch.Tensor) -> Conversion | None:
        """What loading ``key`` (held as ``dtype`` by the saved state read here) into ``current`` did, if it did not
        copy it as the checkpoint holds it."""
        now = str(current.dtype).removeprefix("torch.")
        saved = self.sources.get(key, (dtype,))
        if saved == (now,) and not (self.regrouped and now == "uint8"):
            return None  # copied (a regrouped fp32 moment is copied too)
        return Conversion(key, saved, now, self.regrouped)

    def _converted(self, triple, state: dict[str, Any]) -> bool:
        """Whether ``triple``'s codes are saved in one dtype and held in the other."""
        saved = self.entry.state(triple.codes)
        current = state.get(triple.codes)
        return saved is not None and current is not None and getattr(torch, saved.dtype) != current.dtype

    def _restore_same_dtype(self, key, current, state, triple) -> None:
        if current.dtype == torch.uint8 and triple is not None:
            current.fill_(quant.zero_code(self.record.replicated.get(triple.qmap, state.get(triple.qmap))))
        else:
            current.zero_()
        self.gather(StateKind.ELEMENTWISE, key, current)

    def _length(self, kind: StateKind) -> int:
        return saved_length(kind, self.geometry, self.optimizer.dp_rank)

    def _dequantize_into(self, triple, current: torch.Tensor) -> None:
        n = self._length(StateKind.ELEMENTWISE)
        lead = tuple(current.shape[:-1])
        codes = torch.empty(*lead, n, dtype=torch.uint8)
        absmax = torch.empty(*lead, self._length(StateKind.BLOCKWISE), dtype=torch.float32)
        self.gather(StateKind.ELEMENTWISE, triple.codes, codes)
        self.gather(StateKind.BLOCKWISE, triple.absmax, absmax)
        qmap = self.record.replicated[triple.qmap]
        current.zero_()
        current[..., :n].copy_(quant.dequantize(codes, absmax, qmap, self.block_size))

    def _quantize_into(self, triple, state: dict[str, Any]) -> None:
        n = self._length(StateKind.ELEMENTWISE)
        values = torch.empty(*state[triple.codes].shape[:-1], n, dtype=torch.float32)
        self.gather(StateKind.ELEMENTWISE, triple.codes, values)
        qmap = state[triple.qmap]
        codes, absmax = quant.quantize(values, qmap.to("cpu"), self.block_size)
        state[triple.codes].fill_(quant.zero_code(qmap))
        state[triple.codes][..., :n].copy_(codes)
        state[triple.absmax].zero_()
        state[triple.absmax][..., : absmax.shape[-1]].copy_(absmax)

    def plan(self, load_optimizer_states: bool, names: dict) -> GroupPlan:
        if not load_optimizer_states:
            plan = GroupPlan(self.index, self.master(), None, None, [])
        else:
            state, notes = self.planned_state()
            plan = GroupPlan(self.index, self.master(), state, dict(self.record.param_group), notes)
        self._check_finite(plan, names)
        return plan

    def _check_finite(self, plan: GroupPlan, names: dict) -> None:
        """Refuse NaN/Inf in the planned masters or float state that the manifest's ``non_finite`` does not declare."""
        tensors = [(MASTER_KEY, StateKind.ELEMENTWISE, plan.master)]
        for key, value in (plan.state or {}).items():
            entry = self.entry.state(key)
            if entry is not None and is_partitioned(entry.kind) and isinstance(value, torch.Tensor) \
                    and value.is_floating_point():  # 8-bit codes cannot hold NaN
                tensors.append((key, entry.kind, value))
        params = self.optimizer.param_entries(self.index, names)
        same_as = self.optimizer.zero_bnb_spec.same_quantized_state()
        for key, kind, value in tensors:
            found = undeclared_non_finite(value[..., : self._length(kind)], key, kind,
                                          local_range(kind, self.geometry, self.optimizer.dp_rank), params,
                                          self.block_size, self.saved.manifest.non_finite, same_as)
            if found:
                raise CheckpointFormatError(
                    f"the checkpoint's {key!r} of parameter(s) {found[:5]} holds NaN/Inf, but its manifest's "
                    f"non_finite declares none there ({ {name: self.saved.manifest.non_finite.get(name, []) for name in found[:5]} }); "
                    f"it was edited or damaged after it was written. Load an earlier tag"
                )


@dataclass
class GroupPlan:
    """What loading writes into one flat group: master weights, base-optimizer state, hyper-parameters."""

    index: int
    master: torch.Tensor
    state: dict[str, Any] | None
    hyperparameters: dict[str, Any] | None
    #: element-wise states loaded in another form than saved (:mod:`zero_bnb.checkpoint.precision`)
    conversions: list[Conversion]


@dataclass
class RestorePlan:
    """A checked, fully read load of one rank's partitions (see :func:`plan_restore`)."""

    groups: list[GroupPlan]
    load_optimizer_states: bool
    wrapper: dict[str, Any]
    saved_dp: int
    #: whether the state was moved between flat groups by parameter name (:mod:`zero_bnb.checkpoint.regroup`)
    regrouped: bool = False


def plan_restore(
    optimizer: PartitionedOptimizer, saved: SavedState, names: dict, *, load_optimizer_states: bool = True
) -> RestorePlan:
    """Read and check everything a load will write into this rank's partitions, changing nothing.

    Local (no collectives); the checkpoint's DP size may differ from the running one.

    Raises:
        CheckpointMismatchError: the checkpoint does not fit the running model or optimizer.
    """
    check_compatible(optimizer, saved.manifest, names, optimizer_states=load_optimizer_states)
    groups = [_GroupRestorer(optimizer, saved, index).plan(load_optimizer_states, names)
              for index in range(optimizer.num_groups)]
    wrapper = {}
    if load_optimizer_states:
        wrapper = dict(saved.replicated.wrapper)  # plain data, checked when read
    return RestorePlan(groups, load_optimizer_states, wrapper, saved_dp(saved),
                       getattr(saved, "source_dtypes", None) is not None)


def apply_masters(optimizer: PartitionedOptimizer, plan: RestorePlan) -> None:
    """Copy the planned fp32 master weights into the partitions (exact, whatever the module dtype). Local."""
    for group in plan.groups:
        optimizer.master_partition(group.index).data.copy_(group.master)


def _log_hyperparameters(optimizer: PartitionedOptimizer, plan: RestorePlan) -> None:
    changed = {}
    for group in plan.groups:
        current = optimizer.base_group(group.index)
        for key, value in (group.hyperparameters or {}).items():
            if key != "params" and key in current and current[key] != value:
                changed.setdefault(key, (current[key], value))
    if changed:
        logger.info(
            "zero_bnb: the checkpoint's hyper-parameters replace the optimizer's, as in stock DeepSpeed: %s; set "
            "them on optimizer.param_groups after load_checkpoint to change them",
            ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in sorted(changed.items())),
        )


def apply_restore(optimizer: PartitionedOptimizer, plan: RestorePlan) -> None:
    """Write a plan into the optimizer: master weights, and unless planned without them, state,
    hyper-parameters and the ZeRO wrapper's scalars. Local; raises nothing a plan did not.
    """
    apply_masters(optimizer, plan)
    if not plan.load_optimizer_states:
        return
    if optimizer.dp_rank == 0:
        _log_hyperparameters(optimizer, plan)
    base = optimizer.optimizer
    for group in plan.groups:
        param = optimizer.master_partition(group.index)
        base.state.pop(param, None)
        if group.state is not None:
            base.state[param] = group.state
        optimizer.base_group(group.index).update(group.hyperparameters or {})
    optimizer.load_wrapper_scalars(plan.wrapper)
    optimizer.relink_state_views()  # else DeepSpeed's views keep the replaced state alive, and read it back
