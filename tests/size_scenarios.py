"""Checkpoint bytes of zero_bnb (Adam8bit) against stock DeepSpeed with fp32-state AdamW, fp32 and bf16 training."""

from __future__ import annotations

import os

import bitsandbytes as bnb
import torch
import torch.distributed as dist

import zero_bnb

WIDTH = 512  # 4 x 512 x 512 weights + biases: about 1.05M parameters, so per-file overhead is negligible


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])


def _config(world, dtype, **extra):
    return {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 1}, "bf16": {"enabled": dtype == "bf16"}, "steps_per_print": 10**9,
            **extra}


def _folder_bytes(folder):
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def _train_and_save(engine, folder, dtype):
    inputs = torch.randn(2, WIDTH, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    loss = engine(inputs).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(folder, tag="t")
    dist.barrier()
    return _folder_bytes(os.path.join(folder, "t"))


def checkpoint_sizes(rank, world, workdir):
    import deepspeed

    out = {"params": sum(p.numel() for p in _model().parameters())}
    for dtype in ("fp32", "bf16"):
        model = _model()
        stock, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                         config=_config(world, dtype))
        out[f"stock_adamw:{dtype}"] = _train_and_save(stock, os.path.join(workdir, f"stock_{dtype}"), dtype)
        model = _model()
        ours, *_ = zero_bnb.initialize(model=model, optimizer=bnb.optim.Adam8bit(model.parameters()),
                                       config=_config(world, dtype))
        out[f"zero_bnb:{dtype}"] = _train_and_save(ours, os.path.join(workdir, f"ours_{dtype}"), dtype)
    model = _model()
    derived, *_ = zero_bnb.initialize(model=model, optimizer=bnb.optim.Adam8bit(model.parameters()),
                                      config=_config(world, "bf16", zero_derived_module_weights=True))
    out["zero_bnb_derived:bf16"] = _train_and_save(derived, os.path.join(workdir, "derived"), "bf16")
    if rank == 0:
        torch.save(out, os.path.join(workdir, "sizes.pt"))
