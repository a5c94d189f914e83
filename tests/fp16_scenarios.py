"""fp16 on CPU ranks (:mod:`zero_bnb.testing.cpu_fp16`): train Adam8bit through overflow-skipped steps at DP=2,
save, continue (the uninterrupted reference); load at DP=3 into engines whose loss scaler starts elsewhere, record
what the load restored, continue. ZeRO stages 1 and 2 in each launch."""

from __future__ import annotations

import os

import bitsandbytes as bnb
import torch.distributed as dist
from optimizer_scenarios import bnb_view
from scenarios import _save_result

from zero_bnb.testing.cpu_fp16 import allow_fp16_on_cpu
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import build_engine, param_groups, train_steps

STAGES = (1, 2)
BEFORE, AFTER = 6, 6
#: Starts at 2^16 so a first step overflows (and are skipped); a window of 2 grows the scale again every two clean
#: steps, so later steps overflow too: the scaler's every field moves before the save and after the load.
SAVED_SCALER = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 2,
                "min_loss_scale": 1}
#: What the resuming engine's scaler would start from without the checkpoint.
OTHER_SCALER = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 4,
                "min_loss_scale": 1}


def scaler_state(engine) -> dict:
    """DeepSpeed's dynamic loss scaler, every field (the dtype aside), and the engine's step counters."""
    scaler = engine.optimizer.loss_scaler
    return {**{key: value for key, value in vars(scaler).items() if key != "dtype"},
            "class": type(scaler).__name__, "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps}


def _engine(dp: int, stage: int, fp16: dict):
    allow_fp16_on_cpu()
    return build_engine(dp, bnb.optim.Adam8bit, fp16=fp16, zero_optimization={"stage": stage})


def save_and_continue(rank: int, world: int, workdir: str) -> None:
    out: dict = {}
    for stage in STAGES:
        engine = _engine(world, stage, SAVED_SCALER)
        record = {"dtype": str(next(engine.module.parameters()).dtype), "losses": train_steps(engine, RUN, 0, BEFORE)}
        engine.save_checkpoint(os.path.join(workdir, f"stage{stage}"), tag="saved")
        record["saved"] = bnb_view(engine, param_groups(engine.module))  # bitsandbytes' view: no zero_bnb code
        record["scaler_saved"] = scaler_state(engine)
        record["losses"] += train_steps(engine, RUN, BEFORE, AFTER)
        record["scaler_after"] = scaler_state(engine)
        out[stage] = record
        engine.destroy()
    if rank == 0:
        _save_result(os.path.join(workdir, f"fp16_dp{world}.pt"), out)
    dist.barrier()


def resume(rank: int, world: int, workdir: str) -> None:
    out: dict = {}
    for stage in STAGES:
        engine = _engine(world, stage, OTHER_SCALER)
        record = {"scaler_fresh": scaler_state(engine)}
        engine.load_checkpoint(os.path.join(workdir, f"stage{stage}"))
        record["loaded"] = bnb_view(engine, param_groups(engine.module))
        record["scaler_loaded"] = scaler_state(engine)
        record["losses"] = train_steps(engine, RUN, engine.global_steps, AFTER)
        record["scaler_after"] = scaler_state(engine)
        out[stage] = record
        engine.destroy()
    if rank == 0:
        _save_result(os.path.join(workdir, f"fp16_resumed_dp{world}.pt"), out)
    dist.barrier()
