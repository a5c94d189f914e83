"""Multi-process halves of the conversion tests: write the checkpoints, then resume the converted ones.

:func:`write_sources` (DP=2) writes zero_bnb and stock DeepSpeed Adam8bit checkpoints (ZeRO stage 1 and
stage 3, fp32 and bf16) and the runs that never stopped; :func:`resume_converted` (any DP) loads the converted
checkpoints into stock DeepSpeed (universal, torch AdamW, stages 1 and 3) and into zero_bnb (stages 1, 2 and 3), and
trains on.
"""

from __future__ import annotations

import logging
import os

import bitsandbytes as bnb
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from scenarios import _error, _save_result, _stock_engine, make_engine, run_phases
from stage3_scenarios import stage3_config

import zero_bnb

from zero_bnb.testing.consolidate import consolidated_state
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import LEARNING_RATE as LR
from zero_bnb.testing.toy import build_model, param_groups, train_steps

STEPS, MORE = 3, 2
ONE_STATE = ("Lion8bit", "SGD8bit")
#: Stock ZeRO-3 sources: name -> extra config (``zero_optimization`` keys merged with stage 3). DeepSpeed's default
#: sub-groups pack 0.weight and 2.weight into one flat tensor per rank (every 8-bit block off the parameters' grids);
#: sub_group_size 4000 gives each weight a sub-group of its own, where 2.weight's slices (7680 = 30 blocks) start on
#: blocks: copied exactly; the third trains with the optimizer offloaded to the CPU (ZeRO-Offload), the fourth in bf16.
STOCK3 = {"stock3": {}, "stock3_aligned": {"zero_optimization": {"sub_group_size": 4000}},
          "stock3_offload": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}},
                             "zero_force_ds_cpu_optimizer": False},
          "stock3_bf16": {"bf16": {"enabled": True}}}
#: Stock ZeRO-3 sources rescued and resumed under zero_bnb: their runs also continue uninterrupted.
RESUMED3 = ("stock3", "stock3_bf16")


def stage3_zero_bnb(world: int, **config):
    """The toy model and Adam8bit under zero_bnb at ZeRO stage 3 (``config``: extra top-level keys). Collective."""
    model = build_model()
    optimizer = bnb.optim.Adam8bit(param_groups(model), lr=LR)
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=stage3_config(world, **config))
    return engine


def _full_weights(engine) -> dict:
    """Every parameter's whole fp32 master (gathered at stage 3). Collective."""
    return {name: safe_get_full_fp32_param(param) for name, param in engine.module.named_parameters()}


def _save_and_continue(engine, c, out, name: str) -> None:
    """Train, save as ``name``, record the saved state and the steps of the run that never stopped."""
    train_steps(engine, RUN, 0, STEPS)
    engine.save_checkpoint(os.path.join(c["workdir"], name), tag="s3")
    out[f"{name}_saved"] = consolidated_state(engine)
    out[f"{name}_after"] = train_steps(engine, RUN, STEPS, MORE)


def _zero_bnb_sources(c, out):
    _save_and_continue(make_engine(c["world"]), c, out, "zero_bnb")
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


def _stock3_source(name: str):
    def phase(c, out):
        extra = dict(STOCK3[name])
        zero = {"stage": 3, **extra.pop("zero_optimization", {})}
        stock = _stock_engine(c["world"], "Adam8bit", zero_optimization=zero, **extra)
        train_steps(stock, RUN, 0, STEPS)
        stock.save_checkpoint(os.path.join(c["workdir"], name), tag="s3")
        out[f"{name}_weights"] = _full_weights(stock)
        if name in RESUMED3:  # the run that never stopped, for the rescued resumes
            out[f"{name}_after"] = train_steps(stock, RUN, STEPS, MORE)

    phase.__name__ = name
    return phase


def _zero_bnb3_source(c, out):
    _save_and_continue(stage3_zero_bnb(c["world"]), c, out, "zero_bnb3")


def write_sources(rank, world, workdir):
    out: dict = {}
    # Adam8bit, then the other declared families (their stock state keys need --optimizer to rescue).
    stocks = [_stock_source("Adam8bit", "stock", "stock")]
    stocks += [_stock_source(family, f"stock_{family}", f"stock_{family}") for family in ONE_STATE]
    stocks += [_stock3_source(name) for name in STOCK3]
    run_phases(out, {"world": world, "workdir": workdir}, _zero_bnb_sources, _zero_bnb3_source, *stocks)
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
        logged: list[str] = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: logged.append(record.getMessage())
        logger = logging.getLogger("zero_bnb.ds.engine")
        level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        try:
            engine.load_checkpoint(os.path.join(c["workdir"], folder))
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        out[f"{folder}_log"] = [message for message in logged if "loaded checkpoint" in message]
        out[folder] = consolidated_state(engine)
        if module:
            out[f"{folder}_module"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        else:
            out[f"{folder}_after"] = train_steps(engine, RUN, STEPS, MORE)

    phase.__name__ = folder
    return phase


def _universal3_into_adamw(c, out):
    """The universal checkpoint of a zero_bnb stage-3 checkpoint into stock DeepSpeed stage 3 + torch AdamW."""
    import deepspeed

    model = build_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    config = stage3_config(c["world"], checkpoint={"load_universal": True})
    stock, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    stock.load_checkpoint(os.path.join(c["workdir"], "universal3"))
    out["universal3"] = {
        name: {key: safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")}
        | {"fp32": safe_get_full_fp32_param(param)}
        for name, param in stock.module.named_parameters()
    }
    state, groups = stock.optimizer.optimizer.state, stock.optimizer.optimizer.param_groups
    out["universal3_steps"] = sorted({float(s["step"]) for s in state.values()})
    out["universal3_step_tensors"] = len({id(s["step"]) for s in state.values()})
    out["universal3_weight_decay"] = [group["weight_decay"] for group in groups]
    # What the converter's note says to do after stock DeepSpeed's ZeRO-3 universal load: set the hyper-parameters
    # of the other groups again and give each state its own step.
    for group, wanted in zip(groups, param_groups(build_model()), strict=True):
        group["weight_decay"] = wanted["weight_decay"]
    for entry in state.values():
        entry["step"] = entry["step"].clone()
    out["universal3_after"] = train_steps(stock, RUN, STEPS, MORE)
    out["universal3_steps_after"] = sorted({float(s["step"]) for s in state.values()})


def _rescued3_resume(c, out):
    """The rescued stock stage-3 checkpoint into zero_bnb at stage 3 (a direct load of the stock one is refused
    first, naming the conversion); at DP=3 also into stage 2."""
    # the rescued checkpoint trains on as stock does: with bitsandbytes' CPU arithmetic
    engine = stage3_zero_bnb(c["world"], zero_cpu_update="bitsandbytes")
    out["stock3_direct"] = _error(lambda: engine.load_checkpoint(os.path.join(c["workdir"], "stock3")))
    engine.load_checkpoint(os.path.join(c["workdir"], "rescued3"))
    out["rescued3"] = consolidated_state(engine)
    out["rescued3_after"] = train_steps(engine, RUN, STEPS, MORE)
    if c["world"] == 3:
        engine = make_engine(c["world"], zero_cpu_update="bitsandbytes", zero_optimization={"stage": 2})
        engine.load_checkpoint(os.path.join(c["workdir"], "rescued3"))
        out["rescued3_stage2"] = consolidated_state(engine)
        out["rescued3_stage2_after"] = train_steps(engine, RUN, STEPS, MORE)


def _rescued3_bf16_resume(c, out):
    """The rescued stock stage-3 bf16 checkpoint into zero_bnb at stage 3 in bf16: state, module weights, steps."""
    import deepspeed

    engine = stage3_zero_bnb(c["world"], zero_cpu_update="bitsandbytes", bf16={"enabled": True})
    engine.load_checkpoint(os.path.join(c["workdir"], "rescued3_bf16"))
    out["rescued3_bf16"] = consolidated_state(engine)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        out["rescued3_bf16_module"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out["rescued3_bf16_after"] = train_steps(engine, RUN, STEPS, MORE)


def resume_converted(rank, world, workdir):
    out: dict = {}
    phases = [_universal_into_adamw, _zero_bnb_resume("back"), _zero_bnb_resume("derived", module=True),
              _zero_bnb_resume("rescued")] + [_zero_bnb_resume(f"rescued_{family}", family) for family in ONE_STATE]
    phases += [_universal3_into_adamw, _rescued3_resume, _rescued3_bf16_resume]
    run_phases(out, {"world": world, "workdir": workdir}, *phases)
    dist.barrier()
    _save_result(os.path.join(workdir, f"resumed_dp{world}.pt"), out)
