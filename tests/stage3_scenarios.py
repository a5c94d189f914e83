"""ZeRO stage 3 scenarios: one launch per DP size, each running many phases (see ``scenarios.run_phases``).

``stage3_dp2`` trains and saves (Adam8bit fp32, Lion8bit, Adam8bit bf16, Adam8bit under ``deepspeed.zero.Init``)
and keeps training uninterrupted; ``stage3_resume`` loads those checkpoints at another DP size and keeps
training. Rank 0 of each launch writes ``stage3_dp{world}.pt`` for the tests to read.
"""

from __future__ import annotations

import os

import deepspeed
import torch
import torch.distributed as dist
from scenarios import OPTIMIZERS, _save_result, make_engine, run_phases

import zero_bnb
from zero_bnb.testing.consolidate import consolidated_state
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import LEARNING_RATE as LR
from zero_bnb.testing.toy import build_model, param_groups, train_steps

STEPS_BEFORE, STEPS_AFTER = 3, 3

#: name -> (optimizer, extra config, whether the model is built under deepspeed.zero.Init)
CASES = {
    "adam8bit": ("Adam8bit", {}, False),
    "lion8bit": ("Lion8bit", {}, False),
    "adamw8bit": ("AdamW8bit", {}, False),
    "bf16": ("Adam8bit", {"bf16": {"enabled": True}}, False),
    "zero_init": ("Adam8bit", {}, True),
}


def stage3_config(dp: int, **extra) -> dict:
    config = RUN.ds_config(dp, **extra)
    config["zero_optimization"] = {"stage": 3, **extra.get("zero_optimization", {})}
    return config


def stage3_engine(dp: int, case: str):
    """The toy model and optimizer under zero_bnb at ZeRO stage 3. Collective."""
    optimizer_name, extra, zero_init = CASES[case]
    config = stage3_config(dp, **extra)
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_model()
    else:
        model = build_model()
    optimizer = OPTIMIZERS[optimizer_name](param_groups(model), lr=LR)
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _partition_sizes(engine) -> dict[str, int]:
    return {engine.param_names[p]: p.ds_tensor.ds_numel for p in engine.module.parameters()}


def _train_save(case: str):
    def phase(context, out):
        world, workdir = context["world"], context["workdir"]
        engine = stage3_engine(world, case)
        out[f"{case}_partitions"] = _partition_sizes(engine)
        losses = train_steps(engine, RUN, 0, STEPS_BEFORE)
        engine.save_checkpoint(os.path.join(workdir, case), tag="mid")
        saved = consolidated_state(engine)
        after = train_steps(engine, RUN, STEPS_BEFORE, STEPS_AFTER)
        final = consolidated_state(engine)
        engine.load_checkpoint(os.path.join(workdir, case), tag="mid")
        reloaded = consolidated_state(engine)
        out[case] = {"saved": saved, "final": final, "reloaded": reloaded, "losses": losses + after,
                     "global_steps": engine.global_steps}
    phase.__name__ = f"train_save_{case}"
    return phase


def _resume(case: str):
    def phase(context, out):
        world, workdir = context["world"], context["workdir"]
        engine = stage3_engine(world, case)
        engine.load_checkpoint(os.path.join(workdir, case))
        loaded = consolidated_state(engine)
        global_steps = engine.global_steps
        after = train_steps(engine, RUN, STEPS_BEFORE, STEPS_AFTER)
        out[case] = {"loaded": loaded, "final": consolidated_state(engine), "losses": after,
                     "global_steps": global_steps}
    phase.__name__ = f"resume_{case}"
    return phase


def _stage2_save(context, out):
    """A zero_bnb ZeRO-2 checkpoint (three flat groups) of the same model, for a stage-3 engine to load."""
    world, workdir = context["world"], context["workdir"]
    engine = make_engine(world, zero_optimization={"stage": 2})
    losses = train_steps(engine, RUN, 0, STEPS_BEFORE)
    engine.save_checkpoint(os.path.join(workdir, "stage2"), tag="mid")
    out["stage2"] = {"saved": consolidated_state(engine), "losses": losses + train_steps(engine, RUN, STEPS_BEFORE, 1)}


def _across_stages(context, out):
    """Stage 2 -> stage 3 and stage 3 -> stage 2, at another DP size: state mapped by parameter name."""
    world, workdir = context["world"], context["workdir"]
    into3 = stage3_engine(world, "adam8bit")
    into3.load_checkpoint(os.path.join(workdir, "stage2"))
    out["stage2_into_3"] = {"loaded": consolidated_state(into3), "losses": train_steps(into3, RUN, STEPS_BEFORE, 1)}
    into2 = make_engine(world, zero_optimization={"stage": 2})
    into2.load_checkpoint(os.path.join(workdir, "adam8bit"))
    out["stage3_into_2"] = {"loaded": consolidated_state(into2), "losses": train_steps(into2, RUN, STEPS_BEFORE, 1)}


def _module_only(context, out):
    """Weights-only loads at stage 3: exact fp32 masters, module weights equal to them, optimizer state fresh."""
    world, workdir = context["world"], context["workdir"]
    for name, kwargs in {"module_only": {"load_module_only": True},
                         "no_optimizer": {"load_optimizer_states": False}}.items():
        engine = stage3_engine(world, "adam8bit")
        engine.load_checkpoint(os.path.join(workdir, "adam8bit"), **kwargs)
        state = consolidated_state(engine)
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            weights = {engine.param_names[p]: p.detach().clone() for p in engine.module.parameters()}
        out[name] = {"masters": state and {n: t["fp32"] for n, t in state["params"].items()}, "weights": weights,
                     "steps": engine.global_steps, "loss": train_steps(engine, RUN, STEPS_BEFORE, 1)[0]}


def stage3_dp2(rank, world, workdir):
    out: dict = {}
    run_phases(out, {"world": world, "workdir": workdir}, *(_train_save(case) for case in CASES), _stage2_save)
    _save_result(os.path.join(workdir, f"stage3_dp{world}.pt"), out)
    dist.barrier()


def stage3_resume(rank, world, workdir):
    out: dict = {}
    phases = [_resume(case) for case in CASES]
    if world == 3:
        phases += [_across_stages, _module_only]
    run_phases(out, {"world": world, "workdir": workdir}, *phases)
    out["partitions"] = _partition_sizes(stage3_engine(world, "adam8bit"))
    _save_result(os.path.join(workdir, f"stage3_dp{world}.pt"), out)


__all__ = ["CASES", "stage3_dp2", "stage3_resume", "torch"]
