"""Saved state mapped into other flat groups by parameter name (zero_bnb.checkpoint.regroup), in one process."""

from __future__ import annotations

import pytest
import torch

from zero_bnb.checkpoint.regroup import RegroupedState, by_name
from zero_bnb.core import quant
from zero_bnb.core.state_spec import BNB_ADAM, StateKind
from zero_bnb.errors import CheckpointMismatchError
from zero_bnb.format.manifest import GroupEntry, Manifest, ParamEntry, StateEntry
from zero_bnb.format.payload import ReplicatedGroup, ReplicatedPayload
from zero_bnb.integrations.scheduler_groups import fit_to_groups

BLOCK = BNB_ADAM.block_size


def _params(*named_sizes):
    entries, offset = [], 0
    for name, size in named_sizes:
        entries.append(ParamEntry(name, (size,), offset))
        offset += size
    return tuple(entries)


def _saved(groups, *, eight_bit):
    """A DP=1 Adam8bit-shaped checkpoint of ``groups`` (tuples of ParamEntry) with known values."""
    qmap = torch.linspace(-1, 1, 256)
    pieces, entries, records = {}, [], []
    for index, params in enumerate(groups):
        numel = sum(p.numel for p in params)
        pieces[(index, "fp32")] = torch.arange(numel, dtype=torch.float32) + 1000 * index
        states = []
        for key, absmax in (("state1", "absmax1"), ("state2", "absmax2")):
            values = torch.randn(numel, generator=torch.Generator().manual_seed(index))
            if eight_bit:
                pieces[(index, key)], pieces[(index, absmax)] = quant.quantize(values, qmap, BLOCK)
                states += [StateEntry(key, StateKind.ELEMENTWISE, "uint8", ""),
                           StateEntry(absmax, StateKind.BLOCKWISE, "float32", "")]
            else:
                pieces[(index, key)] = values
                states.append(StateEntry(key, StateKind.ELEMENTWISE, "float32", ""))
        if eight_bit:
            states += [StateEntry("qmap1", StateKind.REPLICATED, "float32", ""),
                       StateEntry("qmap2", StateKind.REPLICATED, "float32", "")]
        states.append(StateEntry("step", StateKind.COUNTER, "int", ""))
        blocks = -(-numel // BLOCK)
        entries.append(GroupEntry(numel, params, tuple(states), ((0, numel),), ((0, blocks),), {"lr": 0.1}))
        records.append(ReplicatedGroup(param_group={"lr": 0.1, "weight_decay": 0.01 * index}, counters={"step": 7},
                                       replicated={"qmap1": qmap, "qmap2": qmap} if eight_bit else {}))
    manifest = Manifest(dp_world_size=1, block_size=BLOCK, optimizer_class="x", optimizer_spec=BNB_ADAM.name,
                        groups=tuple(entries), shards=("s",), batch={"global": 12})
    return RegroupedState(manifest, ReplicatedPayload(tuple(records), {}), pieces)


def _whole(saved, group, key):
    return saved.piece(0, group, key)


@pytest.mark.parametrize("eight_bit", [True, False])
def test_isolated_parameters_get_their_saved_values(eight_bit):
    saved = _saved([_params(("emb", 700), ("w", 5000)), _params(("b", 90))], eight_bit=eight_bit)
    live = [_params(("w", 5000)), _params(("b", 90)), _params(("emb", 700))]  # emb isolated, as for an override
    regrouped = by_name(saved, live, BNB_ADAM, log=False)
    assert [g.params for g in regrouped.manifest.groups] == live
    assert regrouped.manifest.batch == {"global": 12}
    fp32 = _whole(saved, 0, "fp32")
    assert torch.equal(_whole(regrouped, 0, "fp32"), fp32[700:]) and torch.equal(_whole(regrouped, 2, "fp32"), fp32[:700])
    first = _whole(saved, 0, "state1")
    if eight_bit:  # dequantized with the saved absmax and map: the loader requantizes where the group is 8-bit
        first = quant.dequantize(first, _whole(saved, 0, "absmax1"), saved.replicated.groups[0].replicated["qmap1"], BLOCK)
    assert torch.equal(_whole(regrouped, 2, "state1"), first[:700])
    assert {s.key for s in regrouped.manifest.groups[2].states} == {"state1", "state2", "step"}
    records = regrouped.replicated.groups
    assert [r.param_group["weight_decay"] for r in records] == [0.0, 0.01, 0.0]
    assert [r.counters["step"] for r in records] == [7, 7, 7]


def test_same_grouping_is_returned_untouched():
    saved = _saved([_params(("w", 300))], eight_bit=False)
    assert by_name(saved, [_params(("w", 300))], BNB_ADAM) is saved


def test_other_parameters_are_named_with_the_overrides():
    saved = _saved([_params(("emb", 700), ("w", 5000))], eight_bit=True)
    live = [_params(("w", 5000)), _params(("embedding", 700))]
    with pytest.raises(CheckpointMismatchError) as caught:
        by_name(saved, live, BNB_ADAM, ["embedding"], log=False)
    message = str(caught.value)
    for part in ("1 parameter groups, the optimizer 2", "only in checkpoint: ['emb']", "only in model: ['embedding']",
                 "['embedding'] groups of their own because of their bitsandbytes overrides", "Build the model"):
        assert part in message, part


def test_parameters_from_groups_with_other_settings_cannot_share_a_group():
    saved = _saved([_params(("a", 300)), _params(("b", 300))], eight_bit=False)
    with pytest.raises(CheckpointMismatchError, match=r"saved groups \[0, 1\].*weight_decay"):
        by_name(saved, [_params(("a", 300), ("b", 300))], BNB_ADAM, log=False)


def test_scheduler_lists_are_extended_from_the_group_each_came_from():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 1.0}, {"params": [model.bias], "lr": 2.0},
                                 {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0}], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    scheduler.base_lrs, scheduler._last_lr = [1.0, 2.0], [0.5, 1.0]  # saved by a run with 2 groups
    assert fit_to_groups(scheduler, (0, 1, 0)) == ["base_lrs", "_last_lr"]
    assert scheduler.base_lrs == [1.0, 2.0, 1.0]
    scheduler.step()  # failed with "zip() argument 2 is shorter than argument 1" before
    assert fit_to_groups(scheduler, (0, 1, 0)) == []  # already fits
