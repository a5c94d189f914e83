"""bf16 training: module weights back in DeepSpeed's model file cost 2 B/param; the checkpoint stays <= 0.6x AdamW's."""

from __future__ import annotations

import torch
from size_scenarios import checkpoint_sizes

from zero_bnb.testing.launch import run_distributed


def test_bf16_checkpoint_with_module_weights_stays_under_0_6_of_adamw(tmp_path):
    run_distributed(checkpoint_sizes, 2, str(tmp_path))
    sizes = torch.load(tmp_path / "sizes.pt", weights_only=False)
    per_param = {name: sizes[name] / sizes["params"] for name in ("stock_adamw", "zero_bnb", "zero_bnb_derived")}
    # stock: bf16 module 2 + fp32 master 4 + two fp32 moments 8 = 14 B/param; zero_bnb: 2 + 4 + 2 x 1 (+ absmax).
    assert 13.9 < per_param["stock_adamw"] < 14.2, per_param
    assert per_param["zero_bnb"] - per_param["zero_bnb_derived"] > 1.99, per_param  # the module weights, bf16
    assert sizes["zero_bnb"] <= 0.6 * sizes["stock_adamw"], per_param
