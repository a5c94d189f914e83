"""The optimizer matrix (fp32, ZeRO-1): every declared family saves at DP=2 and loads at DP=3 exactly."""

from __future__ import annotations

import math

import bitsandbytes as bnb
import pytest
import torch
from optimizer_scenarios import MATRIX, load_all, save_all

from zero_bnb.consolidate import state_differences
from zero_bnb.launch import run_distributed
from zero_bnb.state_spec import UnsupportedOptimizerError, spec_for


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("optimizers")
    run_distributed(save_all, 2, str(workdir))
    run_distributed(load_all, 3, str(workdir))
    load = lambda name: torch.load(workdir / name, weights_only=False)
    return load("saved_dp2.pt"), load("loaded_dp3.pt")


@pytest.mark.parametrize("name", list(MATRIX))
def test_save_at_dp2_load_at_dp3_is_exact(matrix, name):
    saved, loaded = matrix
    checked, differences = state_differences(saved[name], loaded[name]["state"])
    assert not differences, differences
    assert checked >= 12  # 6 parameters x (master weight + at least one state)
    assert all(counters.get("step") for counters in saved[name]["counters"])
    assert math.isfinite(loaded[name]["loss"])


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: bnb.optim.LAMB8bit(p), "no state declaration"),
    (lambda p: bnb.optim.LARS8bit(p, lr=0.1, momentum=0.9), "no state declaration"),
    (lambda p: bnb.optim.AdEMAMix8bit(p), "no state declaration"),
])
def test_optimizers_whose_state_cannot_move_are_refused_with_the_setting_named(make, message):
    with pytest.raises(UnsupportedOptimizerError, match=message):
        spec_for(make([torch.nn.Parameter(torch.zeros(4))]))
