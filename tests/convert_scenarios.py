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
from scenarios import _save_result, _stock_engine, make_engine, run_phases

from zero_bnb.testing.consolidate import consolidated_state
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import LEARNING_RATE as LR
from zero_bnb.testing.toy import build_model, param_groups, train_steps

STEPS, MORE = 3, 2
ONE_STATE = ("Lion8bit", "SGD8bit")


def _zero_bnb_sources(c, out):
    ours = make_engine(c["world"])
    train_steps(ours, RUN, 0, STEPS)
    ours.save_checkpoint(os.path.join(c["workdir"], "zero_bnb"), tag="s3")
    out["zero_bnb_saved"] = consolidated_state(ours)
    out["zero_bnb_after"] = train_steps(ours, RUN, STEPS, MORE)
    derived = make_engine(c["world"], zero_derived_module_weights=True)
    train_steps(derived, RUN, 0, STEPS)
    derived.save_checkpoint(os.path.join(c["workdir"], "derived"), tag="s3")
    out["derived_saved"] = consolidated_state(derived)


def _stock_source(family: str, folder: str, prefix: str):
    def phase(c, out):
        stock = _stock_engine(c["world"], family)
        train_steps(stock, RUN, 0, STEPS)
        stock.save_checkpoint(os.path.join(c["workdir"], folder), tag="s3")
        out[f"{prefix}_weights"] = {n: p.detach().clone() for n, p in stock.module.named_parameters()}
        out[f"{prefix}_after"] = train_steps(stock, RUN, STEPS, MORE)

    phase.__name__ = f"stock_{family}"
    return phase


def write_sources(rank, world, workdir):
    out: dict = {}
    # Adam8bit, then the other declared families (their stock state keys need --optimizer to rescue).
    stocks = [_stock_source("Adam8bit", "stock", "stock")]
    stocks += [_stock_source(family, f"stock_{family}", f"stock_{family}") for family in ONE_STATE]
    run_phases(out, {"world": world, "workdir": workdir}, _zero_bnb_sources, *stocks)
    _save_result(os.path.join(workdir, "sources.pt"), out)


def _universal_adamw(world):
    import deepspeed

    model = build_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    config = RUN.ds_config(world, checkpoint={"load_universal": True})
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _universal_into_adamw(c, out):
    stock = _universal_adamw(c["world"])
    stock.load_checkpoint(os.path.join(c["workdir"], "universal"))
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


def _zero_bnb_resume(folder: str, family: str = "Adam8bit", module: bool = False):
    def phase(c, out):
        # A rescued stock checkpoint trains on as stock does: with bitsandbytes' CPU arithmetic.
        config = {"zero_cpu_update": "bitsandbytes"} if folder.startswith("rescued") else {}
        engine = make_engine(c["world"], family, **config)
        engine.load_checkpoint(os.path.join(c["workdir"], folder))
        out[folder] = consolidated_state(engine)
        if module:
            out[f"{folder}_module"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        else:
            out[f"{folder}_after"] = train_steps(engine, RUN, STEPS, MORE)

    phase.__name__ = folder
    return phase


def resume_converted(rank, world, workdir):
    out: dict = {}
    phases = [_universal_into_adamw, _zero_bnb_resume("back"), _zero_bnb_resume("derived", module=True),
              _zero_bnb_resume("rescued")] + [_zero_bnb_resume(f"rescued_{family}", family) for family in ONE_STATE]
    run_phases(out, {"world": world, "workdir": workdir}, *phases)
    dist.barrier()
    _save_result(os.path.join(workdir, f"resumed_dp{world}.pt"), out)
