"""The optimizer x precision x ZeRO-stage matrix: every row saves at DP=2 and loads at DP=3 exactly."""

from __future__ import annotations

import math

import bitsandbytes as bnb
import pytest
import torch
from optimizer_scenarios import CASES, STEPS, load_all, runnable, save_all
from scenarios import result

from zero_bnb.core.state_spec import UnsupportedOptimizerError, spec_for
from zero_bnb.testing.consolidate import state_differences
from zero_bnb.testing.launch import run_distributed

GPU_ONLY = ("needs 3 CUDA devices: DeepSpeed's CPU accelerator raises 'Type fp16 is not supported on your device', and "
            "bitsandbytes 0.50.2's CPU backend cannot step AdEMAMix32bit ('output with shape [] doesn't match the "
            "broadcast shape'); the matrix saves at DP=2 and loads at DP=3, one device per rank")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("optimizers")
    run_distributed(save_all, 2, str(workdir))
    run_distributed(load_all, 3, str(workdir))
    load = lambda name: torch.load(workdir / name, weights_only=False)
    return load("saved_dp2.pt"), load("loaded_dp3.pt")


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.skipif(not runnable(case), reason=GPU_ONLY)) for case in CASES
])
def test_save_at_dp2_load_at_dp3_is_exact(matrix, case):
    saved, loaded = (result([side], case) for side in matrix)  # a row whose launch phase raised reports it here
    checked, differences = state_differences(saved, loaded["state"])
    assert not differences, differences
    assert checked >= 12  # 6 parameters x (master weight + at least one state)
    assert [int(counters["step"]) for counters in saved["counters"]] == [STEPS] * len(saved["counters"])
    assert loaded["module_is_master"], "module weights must be the master weights in the module dtype"
    assert math.isfinite(loaded["loss"])


def test_bitsandbytes_override_gets_its_own_flat_group_and_survives_resume(matrix):
    saved, loaded = matrix
    assert saved["override_groups"] == [["2.weight"], ["0.bias", "2.bias", "4.bias"], ["4.weight"], ["0.weight"]]
    # 0.weight (9600 elements) would be 8-bit; its 32-bit override holds, alone in its group, at DP=2 and DP=3.
    assert saved["override_dtypes"] == ["torch.uint8", "torch.float32", "torch.uint8", "torch.float32"]
    assert loaded["override"]["dtypes"][3] == "torch.float32"
    assert not state_differences(saved["override"], loaded["override"]["state"])[1]


def test_each_precision_runs_through_the_deepspeed_wrapper_it_selects(matrix):
    saved, _ = matrix
    assert saved["wrappers"]["Adam8bit-bf16acc-zero1"] == "BlockAlignedBF16Optimizer"
    assert saved["wrappers"]["Adam8bit-bf16acc-zero2"] == "BlockAlignedZeroOptimizer"
    assert saved["wrappers"]["Adam8bit-bf16-zero1"] == "BlockAlignedZeroOptimizer"


def test_unsupported_zero_modes_are_refused_with_the_setting_named(matrix):
    saved, _ = matrix
    assert "zero_optimization.stage=3" in saved["stage3"] and "ZeroBnbConfigError" in saved["stage3"]
    # Offload: DeepSpeed itself refuses a client optimizer (no silent swap to its CPU Adam); forced, zero_bnb refuses.
    assert "ZeRO-Offload with a client provided optimizer" in saved["offload_stock_check"]
    assert "offload_optimizer is not supported" in saved["offload"] and "remove the offload section" in saved["offload"]


@pytest.mark.parametrize(("make", "name"), [
    (lambda p: bnb.optim.LAMB8bit(p), "bitsandbytes.optim.lamb.LAMB8bit"),
    (lambda p: bnb.optim.LARS8bit(p, lr=0.1, momentum=0.9), "bitsandbytes.optim.lars.LARS8bit"),
])
def test_optimizers_without_a_state_declaration_are_refused_naming_the_class_and_the_alternatives(make, name):
    """LAMB/LARS keep a per-partition trust ratio (unorm_vec) that cannot be merged across DP sizes."""
    with pytest.raises(UnsupportedOptimizerError) as refused:
        spec_for(make([torch.nn.Parameter(torch.zeros(4))]))
    message = str(refused.value)
    assert f"no state declaration for {name}" in message
    assert "Supported: bitsandbytes Adam (Adam8bit" in message and "Lion8bit" in message
    assert "pass the optimizer to deepspeed.initialize directly" in message
