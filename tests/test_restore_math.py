"""The restore math of ``zero_bnb/checkpoint/restore.py`` in one process, against slices of the whole tensors.

A checkpoint of one or two flat groups is saved at DP size A, cut on the library's block-aligned layout, and held
in memory (a :class:`~zero_bnb.checkpoint.restore.SavedState` whose ``copy_range`` is ``copy_piece_range``);
:func:`plan_restore` then plans it onto every rank of DP size B. The oracle is the whole, unpartitioned tensor the
test made (distinct values, so an off-by-one shows), cut with plain indexing at the target partition's
``[start, end)``, which :func:`_partition` derives from the padding rule itself, not from ``zero_bnb.core``.
No ``torch.distributed``, no DeepSpeed (issue 44, item 5).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_bnb.checkpoint.precision import Conversion
from zero_bnb.checkpoint.restore import copy_piece_range, gather_range, master_weights, plan_restore
from zero_bnb.core.layout import GroupGeometry
from zero_bnb.core.state_spec import BNB_ADAM, BNB_ADEMAMIX, BNB_BLOCK_SIZE, OptimizerSpec, StateKind, StateRule
from zero_bnb.format.manifest import MASTER_KEY, GroupEntry, Manifest, ParamEntry, StateEntry
from zero_bnb.format.payload import ReplicatedGroup, ReplicatedPayload

BLOCK = BNB_BLOCK_SIZE
dps = st.integers(min_value=1, max_value=8)
#: What a running rank's fp32 partition holds before the plan: planning must leave it so.
SENTINEL = -7.0
WRAPPER = {"loss_scale": 1024.0}
#: Two quantization maps with an exact zero at different codes (127 and 0), as bitsandbytes' signed and unsigned
#: dynamic maps have: padding must take the zero code of its own triple's map.
SIGNED_MAP = torch.cat([torch.linspace(-1.0, 0.0, 128), torch.linspace(0.0, 1.0, 129)[1:]])
UNSIGNED_MAP = torch.linspace(0.0, 1.0, 256)


@dataclasses.dataclass(frozen=True)
class Family:
    """A bitsandbytes optimizer as saved: its spec, and per partitioned key its dtype and leading axes."""

    name: str
    spec: OptimizerSpec
    elementwise: dict[str, tuple[str, tuple[int, ...]]]
    blockwise: dict[str, tuple[int, ...]]
    replicated: dict[str, torch.Tensor]


ADAM_8BIT = Family("Adam8bit", BNB_ADAM, {"state1": ("uint8", ()), "state2": ("uint8", ())},
                   {"absmax1": (), "absmax2": ()}, {"qmap1": SIGNED_MAP, "qmap2": UNSIGNED_MAP})
ADAM_32BIT = Family("Adam32bit", BNB_ADAM, {"state1": ("float32", ()), "state2": ("float32", ())}, {}, {})
#: AdEMAMix keeps its fast and slow moments in one ``(2, n)`` state1: two rows split on the last axis.
ADEMAMIX_8BIT = Family("AdEMAMix8bit", BNB_ADEMAMIX, {"state1": ("uint8", (2,)), "state2": ("uint8", ())},
                       {"absmax1": (2,), "absmax2": ()}, {"qmap1": SIGNED_MAP, "qmap2": UNSIGNED_MAP})
FAMILIES = {family.name: family for family in (ADAM_8BIT, ADAM_32BIT, ADEMAMIX_8BIT)}
#: Strategies draw a family's name, which is what a falsifying example then shows.
families = st.sampled_from(sorted(FAMILIES))
eight_bit = st.sampled_from([ADAM_8BIT.name, ADEMAMIX_8BIT.name])


def _partition(numel: int, dp: int, rank: int) -> tuple[int, int, int]:
    """Rank ``rank``'s partition of a group of ``numel`` elements at DP size ``dp``, by the padding rule: the flat
    buffer padded to a multiple of ``BLOCK * dp`` (``lcm(256, 2) = 256``) and cut into ``dp`` equal parts. Returns
    its padded size and the ``[start, end)`` of the real elements it holds."""
    chunk = BLOCK * dp
    size = -(-numel // chunk) * chunk // dp
    start = min(rank * size, numel)
    return size, start, min(start + size, numel)


def _blocks(start: int, end: int) -> tuple[int, int]:
    """The blocks that hold the real elements ``[start, end)`` (none for an empty range)."""
    return (start // BLOCK, -(-end // BLOCK)) if start < end else (0, 0)


def _expect(got: torch.Tensor, real: torch.Tensor, size: int, pad: float, where: str) -> None:
    """``got`` is ``real`` followed by ``pad`` up to ``size`` entries on the last axis; names the first wrong entry."""
    lead, n = tuple(real.shape[:-1]), real.shape[-1]
    assert tuple(got.shape) == (*lead, size), f"{where}: shape {tuple(got.shape)}, expected {(*lead, size)}"
    expected = torch.cat([real.to(got.dtype), torch.full((*lead, size - n), pad, dtype=got.dtype)], dim=-1)
    wrong = (got != expected).nonzero()
    if len(wrong):
        at = tuple(wrong[0].tolist())
        raise AssertionError(f"{where}: entry {at} (of {n} real, {size - n} padding) is {got[at].item()}, expected "
                             f"{expected[at].item()}; {len(wrong)} wrong entries")


class InMemory:
    """A :class:`~zero_bnb.checkpoint.restore.SavedState` held in memory: ``pieces[rank][group][key]``."""

    def __init__(self, manifest: Manifest, replicated: ReplicatedPayload, pieces: list[list[dict[str, torch.Tensor]]]):
        self.manifest = manifest
        self.replicated = replicated
        self.pieces = pieces

    def piece(self, rank: int, group_index: int, key: str) -> torch.Tensor:
        return self.pieces[rank][group_index][key]

    copy_range = copy_piece_range


def _save(family: Family, shapes_per_group: list[list[tuple[int, ...]]], dp: int, seed: int):
    """The checkpoint of groups with these parameter shapes saved at DP size ``dp``, and per group its whole
    tensors (``MASTER_KEY`` and every partitioned state key), from which the pieces were cut."""
    generator = torch.Generator().manual_seed(seed)
    counter = 1.0

    def distinct(*shape: int) -> torch.Tensor:  # fp32 integers, exact, none repeated across keys and groups
        nonlocal counter
        values = torch.arange(counter, counter + math.prod(shape), dtype=torch.float32).reshape(shape)
        counter += math.prod(shape)
        return values

    entries, records, wholes = [], [], []
    pieces: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(dp)]
    for g, shapes in enumerate(shapes_per_group):
        params, offset = [], 0
        for p, shape in enumerate(shapes):
            params.append(ParamEntry(f"g{g}.p{p}", shape, offset))
            offset += math.prod(shape)
        numel, blocks = offset, -(-offset // BLOCK)
        whole = {MASTER_KEY: distinct(numel)}
        states = []
        for key, (dtype, lead) in family.elementwise.items():
            whole[key] = (torch.randint(0, 256, (*lead, numel), generator=generator, dtype=torch.uint8)
                          if dtype == "uint8" else distinct(*lead, numel))  # 8-bit codes: random bytes
            states.append(StateEntry(key, StateKind.ELEMENTWISE, dtype, "test", lead))
        for key, lead in family.blockwise.items():
            whole[key] = distinct(*lead, blocks)
            states.append(StateEntry(key, StateKind.BLOCKWISE, "float32", "test", lead))
        states += [StateEntry(key, StateKind.REPLICATED, "float32", "test") for key in family.replicated]
        states.append(StateEntry("step", StateKind.COUNTER, "int", "test"))
        geometry = GroupGeometry(numel, dp, BLOCK)  # the library's layout builds the saved pieces
        element_ranges, block_ranges = geometry.element_ranges(), geometry.block_ranges()
        for rank in range(dp):
            (e0, e1), (b0, b1) = element_ranges[rank], block_ranges[rank]
            pieces[rank].append({key: (value[..., b0:b1] if key in family.blockwise else value[..., e0:e1]).clone()
                                 for key, value in whole.items()})
        param_group = {"lr": 0.001 * (g + 1), "betas": (0.9, 0.995), "weight_decay": 0.0}
        entries.append(GroupEntry.describe(numel, tuple(params), tuple(states), element_ranges, block_ranges,
                                           param_group))
        records.append(ReplicatedGroup(param_group, {"step": 11 + g},
                                       {key: value.clone() for key, value in family.replicated.items()}))
        wholes.append(whole)
    manifest = Manifest.create(dp_world_size=dp, block_size=BLOCK, optimizer_class=family.name,
                               optimizer_spec=family.spec.name, groups=tuple(entries), files=[])
    return InMemory(manifest, ReplicatedPayload(tuple(records), dict(WRAPPER)), pieces), wholes


@dataclasses.dataclass
class RankView:
    """The face of :class:`~zero_bnb.checkpoint.partitioned.PartitionedOptimizer` that :func:`plan_restore` reads:
    rank ``dp_rank`` of ``dp_size``, running the saved parameters, its fp32 partitions holding :data:`SENTINEL`."""

    zero_bnb_spec: OptimizerSpec
    dp_rank: int
    dp_size: int
    entries: tuple[GroupEntry, ...]
    masters: list[torch.Tensor]
    groups: list[dict[str, Any]]
    optimizer: Any = dataclasses.field(default_factory=lambda: SimpleNamespace(state={}))
    zero_bnb_rule: StateRule = dataclasses.field(default_factory=StateRule)
    module_weights_partitioned: bool = False

    @classmethod
    def of(cls, spec: OptimizerSpec, manifest: Manifest, dp: int, rank: int) -> RankView:
        masters = [torch.full((GroupGeometry(e.numel, dp, BLOCK).partition_numel,), SENTINEL) for e in manifest.groups]
        groups = [{"lr": 0.5, "betas": (0.5, 0.5), "weight_decay": 0.0} for _ in manifest.groups]
        return cls(spec, rank, dp, manifest.groups, masters, groups)

    @property
    def num_groups(self) -> int:
        return len(self.entries)

    def base_group_index(self, group_index: int) -> int:
        return group_index

    def base_group(self, group_index: int) -> dict[str, Any]:
        return self.groups[group_index]

    def geometry(self, group_index: int) -> GroupGeometry:
        return GroupGeometry(self.entries[group_index].numel, self.dp_size, BLOCK)

    def master_partition(self, group_index: int) -> torch.Tensor:
        return self.masters[group_index]

    def param_entries(self, group_index: int, names: dict) -> tuple[ParamEntry, ...]:
        return self.entries[group_index].params


#: A parameter's shape: 1-D or 2-D, from one element to several blocks, often just around a block boundary.
shapes = st.one_of(
    st.tuples(st.integers(1, 3000)),
    st.tuples(st.sampled_from([BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK - 2])),
    st.tuples(st.integers(1, 40), st.integers(1, 70)),
)
groups = st.lists(st.lists(shapes, min_size=1, max_size=4), min_size=1, max_size=2)
seeds = st.integers(0, 2**32 - 1)


def _not_loaded_by(family: Family) -> OptimizerSpec:
    """``family``'s spec with no state initialisation: the loader builds each partition's state from the
    checkpoint's dtypes (so it holds every state as saved)."""
    return dataclasses.replace(family.spec, init_state=None)


@settings(max_examples=100, deadline=None)
@given(optimizer=families, groups=groups, saved_at=dps, loaded_at=dps, seed=seeds)
def test_every_new_rank_gets_the_slice_of_the_whole_tensor(optimizer, groups, saved_at, loaded_at, seed):
    """Saved at A, planned at B: each rank's masters and element-wise state are the whole tensor's
    ``[start, end)`` then padding (0, or the zero code of the state's own map), its block-wise state the blocks that
    hold those elements then 0, replicated maps and counters whole; nothing is converted and nothing written."""
    family = FAMILIES[optimizer]
    saved, wholes = _save(family, groups, saved_at, seed)
    spec = _not_loaded_by(family)
    for rank in range(loaded_at):
        view = RankView.of(spec, saved.manifest, loaded_at, rank)
        plan = plan_restore(view, saved, {})
        where = f"{family.name} saved at DP={saved_at}, rank {rank} of DP={loaded_at}"
        assert all(bool((m == SENTINEL).all()) for m in view.masters) and view.optimizer.state == {}, where
        assert (plan.saved_dp, plan.wrapper, plan.regrouped, plan.load_optimizer_states) == (saved_at, WRAPPER,
                                                                                            False, True)
        for g, (entry, whole, group) in enumerate(zip(saved.manifest.groups, wholes, plan.groups, strict=True)):
            size, start, end = _partition(entry.numel, loaded_at, rank)
            first, last = _blocks(start, end)
            at = f"{where}, group {g} of {entry.numel} elements, elements [{start}, {end}) in a partition of {size}"
            assert group.index == g and group.conversions == [], at  # the block grid is the same: no requantization
            assert group.hyperparameters == saved.replicated.groups[g].param_group, at
            _expect(group.master, whole[MASTER_KEY][start:end], size, 0.0, f"{at}: master")
            assert sorted(group.state) == sorted(s.key for s in entry.states), at
            assert group.state["step"] == 11 + g, at
            for key, value in family.replicated.items():
                assert torch.equal(group.state[key], value), f"{at}: {key}"
            for key, (dtype, _) in family.elementwise.items():
                qmap = family.replicated.get(f"qmap{key[-1]}")
                pad = int((qmap == 0).nonzero()) if dtype == "uint8" else 0.0
                _expect(group.state[key], whole[key][..., start:end], size, pad, f"{at}: {key}")
            for key in family.blockwise:
                _expect(group.state[key], whole[key][..., first:last], size // BLOCK, 0.0,
                        f"{at}: {key} (blocks [{first}, {last}))")


@settings(max_examples=60, deadline=None)
@given(optimizer=eight_bit, groups=groups, saved_at=dps, loaded_at=dps, seed=seeds)
def test_eight_bit_state_held_in_fp32_is_dequantized_block_by_block(optimizer, groups, saved_at, loaded_at, seed):
    """A rank whose optimizer holds the moments in fp32 (a partition under bitsandbytes' ``min_8bit_size``) gets
    ``qmap[code[i]] * absmax[i // 256]`` of the whole tensors for its elements, then 0; the plan names the
    conversions, and the absmax and maps it no longer needs are not in its state."""
    family = FAMILIES[optimizer]
    saved, wholes = _save(family, groups, saved_at, seed)
    leads = {key: lead for key, (_, lead) in family.elementwise.items()}

    def fp32_moments(base, group_index: int, param: torch.Tensor) -> None:
        base.state[param] = {"step": 0, **{key: torch.zeros(*lead, param.numel()) for key, lead in leads.items()}}

    spec = dataclasses.replace(family.spec, init_state=fp32_moments)
    for rank in range(loaded_at):
        view = RankView.of(spec, saved.manifest, loaded_at, rank)
        plan = plan_restore(view, saved, {})
        assert all(bool((m == SENTINEL).all()) for m in view.masters) and view.optimizer.state == {}
        for g, (whole, group) in enumerate(zip(wholes, plan.groups, strict=True)):
            size, start, end = _partition(saved.manifest.groups[g].numel, loaded_at, rank)
            at = (f"{family.name} saved at DP={saved_at}, rank {rank} of DP={loaded_at}, group {g}, "
                  f"elements [{start}, {end}) in a partition of {size}")
            assert group.conversions == [Conversion(key, ("uint8",), "float32", False) for key in leads], at
            assert sorted(group.state) == sorted(["step", *leads]) and group.state["step"] == 11 + g, at
            for n, key in enumerate(leads, start=1):
                codes, absmax, qmap = whole[key], whole[f"absmax{n}"], family.replicated[f"qmap{n}"]
                index = torch.arange(start, end)
                values = qmap[codes[..., start:end].long()] * absmax[..., index // BLOCK]
                _expect(group.state[key], values, size, 0.0, f"{at}: {key}")


@settings(max_examples=100, deadline=None)
@given(optimizer=eight_bit, groups=groups, saved_at=dps, seed=seeds, data=st.data())
def test_any_range_and_any_parameter_read_back_as_saved(optimizer, groups, saved_at, seed, data):
    """``gather_range`` fills exactly ``out[..., :length]`` with the whole tensor's range (element-wise and
    block-wise, any start and end, leading rows whole) and nothing past it; ``master_weights`` gives each parameter
    its own elements in its shape."""
    family = FAMILIES[optimizer]
    saved, wholes = _save(family, groups, saved_at, seed)
    g = data.draw(st.integers(0, len(wholes) - 1), label="group")
    entry, whole = saved.manifest.groups[g], wholes[g]
    for key in (MASTER_KEY, *family.elementwise, *family.blockwise):
        ranges = entry.block_ranges if key in family.blockwise else entry.element_ranges
        total = whole[key].shape[-1]
        lo = data.draw(st.integers(0, total), label=f"{key} start")
        hi = data.draw(st.integers(lo, total), label=f"{key} end")
        extra = data.draw(st.integers(0, 3), label=f"{key} spare room")
        out = torch.full((*whole[key].shape[:-1], hi - lo + extra), 99, dtype=whole[key].dtype)
        gather_range(saved, g, key, ranges, (lo, hi), out)
        _expect(out, whole[key][..., lo:hi], hi - lo + extra, 99, f"{key} [{lo}, {hi}) of group {g} saved at "
                                                                    f"DP={saved_at}")
    lookup = master_weights(saved)
    for param in entry.params:
        got = lookup(param.name)
        expected = whole[MASTER_KEY][param.offset : param.offset + param.numel].reshape(param.shape)
        assert got.shape == param.shape and torch.equal(got, expected), f"{param} saved at DP={saved_at}"
