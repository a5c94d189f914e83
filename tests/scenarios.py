"""Multi-process scenarios run by the tests; rank 0 writes results that pytest then checks.

Each function is one launch of ``world_size`` real processes (gloo on CPU), doing as many
checks as it can so the suite stays fast.
"""

from __future__ import annotations

import logging
import os

import bitsandbytes as bnb
import torch
import torch.distributed as dist

import zero_bnb
from zero_bnb.consolidate import consolidated_state
from zero_bnb.toy import ToyRun, build_model, param_groups, train_steps

RUN = ToyRun(global_batch_size=24, micro_batch=2)
LR = 1e-2

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def make_engine(dp: int, optimizer_name: str = "Adam8bit", **config):
    model = build_model()
    optimizer_cls = {"Adam8bit": bnb.optim.Adam8bit, "AdamW8bit": bnb.optim.AdamW8bit,
                     "AdamW": torch.optim.AdamW}[optimizer_name]
    optimizer = optimizer_cls(param_groups(model), lr=LR)
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=RUN.ds_config(dp, **config))
    return engine


def _save_result(path: str, obj) -> None:
    if dist.get_rank() == 0:
        torch.save(obj, path)


def train_save_continue(rank, world, workdir, optimizer_name, steps_before, steps_after):
    """Train, checkpoint, snapshot, then keep training: the uninterrupted reference run."""
    engine = make_engine(world, optimizer_name)
    losses = train_steps(engine, RUN, 0, steps_before)
    engine.save_checkpoint(os.path.join(workdir, "ckpt"), tag="mid")
    saved = consolidated_state(engine)
    after = train_steps(engine, RUN, steps_before, steps_after)
    final = consolidated_state(engine)
    # Reload into the same (advanced) engine: it must return exactly to the saved state.
    engine.load_checkpoint(os.path.join(workdir, "ckpt"), tag="mid")
    reloaded = consolidated_state(engine)
    _save_result(os.path.join(workdir, f"reference_dp{world}.pt"),
                 {"saved": saved, "final": final, "reloaded": reloaded, "losses": losses + after,
                  "global_steps": engine.global_steps})


def resume(rank, world, workdir, optimizer_name, steps_before, steps_after):
    """Load the checkpoint at DP=``world``, snapshot, re-save, and keep training."""
    engine = make_engine(world, optimizer_name)
    engine.load_checkpoint(os.path.join(workdir, "ckpt"))
    loaded = consolidated_state(engine)
    global_steps = engine.global_steps
    after = train_steps(engine, RUN, steps_before, steps_after)
    final = consolidated_state(engine)
    _save_result(os.path.join(workdir, f"resumed_dp{world}.pt"),
                 {"loaded": loaded, "final": final, "losses": after, "global_steps": global_steps})
