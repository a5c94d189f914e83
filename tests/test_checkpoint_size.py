"""bf16 training: module weights back in DeepSpeed's model file cost 2 B/param; the README's 0.57x and 6.05 B/param."""

from __future__ import annotations

import torch
from scenarios import within
from size_scenarios import checkpoint_sizes

from zero_bnb.testing.launch import run_distributed


def test_bf16_checkpoint_is_0_57_of_adamw_with_module_weights_and_6_05_bytes_per_parameter_derived(tmp_path):
    run_distributed(checkpoint_sizes, 2, str(tmp_path))
    sizes = torch.load(tmp_path / "sizes.pt", weights_only=False)
    per_param = {name: sizes[name] / sizes["params"] for name in ("stock_adamw", "zero_bnb", "zero_bnb_derived")}
    # stock: bf16 module 2 + fp32 master 4 + two fp32 moments 8 = 14 B/param; zero_bnb: 2 + 4 + 2 x 1 (+ absmax).
    assert 13.9 < per_param["stock_adamw"] < 14.2, per_param
    assert per_param["zero_bnb"] - per_param["zero_bnb_derived"] > 1.99, per_param  # the module weights, bf16
    # Measured (1.05M parameters, 2 ranks): 8.047 and 6.046 B/param (2 x 1 B of moments + 4 B master + 2 x 4 B absmax
    # per 256 elements = 6.031, plus 0.015 of file headers and manifest), 0.574 of AdamW's 14.011. Bounds: the
    # README's figures rounded up by 0.01 (about 10 KB of headers per file at this size).
    within("derived checkpoint bytes per parameter", per_param["zero_bnb_derived"], 6.06)
    within("checkpoint bytes vs stock AdamW (bf16, module weights kept)", sizes["zero_bnb"] / sizes["stock_adamw"], 0.58)
