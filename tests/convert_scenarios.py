"""Multi-process halves of the conversion tests: write the checkpoints, then resume the converted ones.

:func:`write_sources` (DP=2) writes a zero_bnb and a stock DeepSpeed Adam8bit checkpoint and the
runs that never stopped; :func:`resume_converted` (any DP) loads the converted checkpoints into
stock DeepSpeed (universal, torch AdamW) and into zero_bnb, and trains on.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from scenarios import _save_result, _stock_engine, make_engine

from zero_bnb.testing.consolidate import consolidated_state
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import LEARNING_RATE as LR
from zero_bnb.testing.toy import build_model, param_groups, train_steps

STEPS, MORE = 3, 2
ONE_STATE = ("Lion8bit", "SGD8bit")


def write_sources(rank, world, workdir):
    out = {}
    ours = make_engine(world)
    train_steps(ours, RUN, 0, STEPS)
    ours.save_checkpoint(os.path.join(workdir, "zero_bnb"), tag="s3")
    out["zero_bnb_saved"] = consolidated_state(ours)
    out["zero_bnb_after"] = train_steps(ours, RUN, STEPS, MORE)
    derived = make_engine(world, zero_derived_module_weights=True)
    train_steps(derived, RUN, 0, STEPS)
    derived.save_checkpoint(os.path.join(workdir, "derived"), tag="s3")
    out["derived_saved"] = consolidated_state(derived)
    stock = _stock_engine(world)
    train_steps(stock, RUN, 0, STEPS)
    stock.save_checkpoint(os.path.join(workdir, "stock"), tag="s3")
    out["stock_weights"] = {n: p.detach().clone() for n, p in stock.module.named_parameters()}
    out["stock_after"] = train_steps(stock, RUN, STEPS, MORE)
    for family in ONE_STATE:  # the other declared families rescue too (their state keys need --optimizer)
        other = _stock_engine(world, family)
        train_steps(other, RUN, 0, STEPS)
        other.save_checkpoint(os.path.join(workdir, f"stock_{family}"), tag="s3")
        out[f"stock_{family}_weights"] = {n: p.detach().clone() for n, p in other.module.named_parameters()}
        out[f"stock_{family}_after"] = train_steps(other, RUN, STEPS, MORE)
    _save_result(os.path.join(workdir, "sources.pt"), out)


def _universal_adamw(world):
    import deepspeed

    model = build_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    config = RUN.ds_config(world, checkpoint={"load_universal": True})
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def resume_converted(rank, world, workdir):
    out = {}
    stock = _universal_adamw(world)
    stock.load_checkpoint(os.path.join(workdir, "universal"))
    out["universal"] = {
        name: {
            "fp32": safe_get_full_fp32_param(param),
            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq"),
        }
        for name, param in stock.module.named_parameters()
    }
    out["universal_steps"] = sorted({float(s["step"]) for s in stock.optimizer.optimizer.state.values()})
    out["universal_after"] = train_steps(stock, RUN, STEPS, MORE)
    back = make_engine(world)
    back.load_checkpoint(os.path.join(workdir, "back"))
    out["back"] = consolidated_state(back)
    out["back_after"] = train_steps(back, RUN, STEPS, MORE)
    derived = make_engine(world)
    derived.load_checkpoint(os.path.join(workdir, "derived"))
    out["derived"] = consolidated_state(derived)
    out["derived_module"] = {n: p.detach().clone() for n, p in derived.module.named_parameters()}
    rescued = make_engine(world)
    rescued.load_checkpoint(os.path.join(workdir, "rescued"))
    out["rescued"] = consolidated_state(rescued)
    out["rescued_after"] = train_steps(rescued, RUN, STEPS, MORE)
    for family in ONE_STATE:
        engine = make_engine(world, family)
        engine.load_checkpoint(os.path.join(workdir, f"rescued_{family}"))
        out[f"rescued_{family}"] = consolidated_state(engine)
        out[f"rescued_{family}_after"] = train_steps(engine, RUN, STEPS, MORE)
    dist.barrier()
    _save_result(os.path.join(workdir, f"resumed_dp{world}.pt"), out)
