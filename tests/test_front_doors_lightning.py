"""Lightning front door: ``strategy="deepspeed_zero_bnb_stage_1"`` on CPU, save at 2 processes, resume at 3.

Two launches: at DP=2 an uninterrupted 2-epoch run and a 1-epoch run with the optimizer offloaded
(``"deepspeed_zero_bnb_stage_1_offload"``) saved with ``trainer.save_checkpoint``; at DP=3 the
second epoch from that checkpoint, not offloaded, with
``accumulate_grad_batches`` 3 -> 2 (global batch 12 kept).
"""

from __future__ import annotations

import pytest
import torch
from lightning_scenarios import lightning_dp2, lightning_dp3

from zero_bnb.testing.launch import run_distributed


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lightning")
    run_distributed(lightning_dp2, 2, str(workdir))
    run_distributed(lightning_dp3, 3, str(workdir))
    return (torch.load(workdir / "lightning_dp2.pt", weights_only=False),
            torch.load(workdir / "lightning_dp3.pt", weights_only=False))


def test_strategy_builds_zero_bnb_engine_on_cpu(lightning_runs):
    dp2, _ = lightning_runs
    assert dp2["strategy"] == "ZeroBnbStrategy" and dp2["engine"] == "ZeroBnbEngine"
    # Same seed, same data: the two DP=2 runs agree, the second one with the optimizer offloaded to the CPU.
    assert dp2["first_epoch"] == dp2["uninterrupted"][:4]
    assert dp2["optimizer"] == {"optimizer": "bitsandbytes.optim.adam.Adam8bit", "cpu_offload": False,
                                "state1": "torch.uint8"}
    assert dp2["offloaded_optimizer"] == {**dp2["optimizer"], "cpu_offload": True}


def test_resume_at_3_with_other_accumulation_continues_the_curve(lightning_runs):
    """Lightning divides the loss by accumulate_grad_batches; DeepSpeed must not divide it again (it would
    make the update depend on the accumulation setting, so changing it on resume would drift)."""
    dp2, dp3 = lightning_runs
    assert dp3["global_step"] == 8
    assert dp3["resumed"] == pytest.approx(dp2["uninterrupted"][4:], rel=1e-5)


def test_strategy_names_and_stage_check():
    from lightning.pytorch.strategies import StrategyRegistry

    import zero_bnb.lightning as integration

    assert set(integration.STRATEGY_NAMES) == {f"deepspeed_zero_bnb_stage_{stage}{offload}"
                                               for stage in (1, 2) for offload in ("", "_offload")}
    for name, params in integration.STRATEGY_NAMES.items():
        assert "deepspeed" in name  # Lightning's accelerator connector looks for this substring
        assert StrategyRegistry[name]["strategy"] is integration.ZeroBnbStrategy
        assert StrategyRegistry[name]["init_params"] == params
        assert params.get("offload_optimizer", False) is name.endswith("_offload")
    with pytest.raises(ValueError, match="stages 1 and 2.*deepspeed_zero_bnb_stage_1"):
        integration.ZeroBnbStrategy(stage=3)
