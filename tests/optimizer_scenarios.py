"""The optimizer x precision x ZeRO-stage matrix: train and save at DP=2, load at DP=3 (one launch per side)."""

from __future__ import annotations

import functools
import itertools
import os

import bitsandbytes as bnb
import torch
from scenarios import _error, _save_result, run_phases

from zero_bnb.testing.consolidate import consolidated_state
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import build_engine, train_steps

#: name -> optimizer class (with its required arguments); lr is the toy's.
OPTIMIZERS = {
    "Adam8bit": bnb.optim.Adam8bit,
    "AdamW8bit": bnb.optim.AdamW8bit,
    # On CPU bitsandbytes falls back to non-paged buffers (with a warning); on GPU they are paged.
    "PagedAdamW8bit": bnb.optim.PagedAdamW8bit,
    "Adam32bit": bnb.optim.Adam32bit,
    # bitsandbytes 0.50.2's CPU backend cannot step AdEMAMix's 32-bit state, so on CPU every group stays 8-bit.
    "AdEMAMix8bit": functools.partial(bnb.optim.AdEMAMix8bit, min_8bit_size=1),
    "AdEMAMix32bit": bnb.optim.AdEMAMix32bit,
    "Lion8bit": bnb.optim.Lion8bit,
    "Lion32bit": bnb.optim.Lion32bit,
    "SGD8bit": functools.partial(bnb.optim.SGD8bit, momentum=0.9),
    "RMSprop8bit": bnb.optim.RMSprop8bit,
    "Adagrad8bit": bnb.optim.Adagrad8bit,
    "torch.AdamW": torch.optim.AdamW,
    "torch.Adam": torch.optim.Adam,
}
#: bf16acc: bf16 weights, fp32 gradient accumulation (DeepSpeed's BF16_Optimizer at stage 1).
PRECISIONS = ("fp32", "bf16", "bf16acc", "fp16")
STAGES = (1, 2)
CASES = [f"{o}-{p}-zero{s}" for o, p, s in itertools.product(OPTIMIZERS, PRECISIONS, STAGES)]
STEPS = 2


def runnable(case: str) -> bool:
    """fp16 needs CUDA (DeepSpeed's CPU accelerator refuses it), and so does AdEMAMix32bit (bitsandbytes' CPU backend);
    the matrix runs 3 ranks, one device each."""
    return ("-fp16-" not in case and not case.startswith("AdEMAMix32bit")) or torch.cuda.device_count() >= 3


def _engine(world: int, case: str):
    optimizer, precision, stage = case.rsplit("-", 2)
    config = {"zero_optimization": {"stage": int(stage.removeprefix("zero"))}}
    if precision == "bf16acc":
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    elif precision != "fp32":
        config[precision] = {"enabled": True}
    return build_engine(world, OPTIMIZERS[optimizer], **config)


def _override_engine(world: int):
    """Adam8bit with a 32-bit override for the first layer's weight (9600 elements: 8-bit without it)."""
    import zero_bnb
    from zero_bnb.testing.toy import LEARNING_RATE, build_model, param_groups

    model = build_model()
    bnb.optim.GlobalOptimManager.get_instance().register_module_override(model[0], "weight", {"optim_bits": 32})
    optimizer = bnb.optim.Adam8bit(param_groups(model), lr=LEARNING_RATE)
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=RUN.ds_config(world))
    return engine


def _state_dtypes(engine) -> list[str | None]:
    """dtype of ``state1`` of each flat group (what the override decides)."""
    return [str(engine.optimizer.optimizer.state[flat].get("state1", torch.empty(0)).dtype)
            for flat in map(engine.optimizer.master_partition, range(engine.optimizer.num_groups))]


def save_all(rank, world, workdir):
    out = {}
    engine = _override_engine(world)
    train_steps(engine, RUN, 0, STEPS)
    engine.save_checkpoint(os.path.join(workdir, "override"), tag="a")
    out["override"] = consolidated_state(engine)
    out["override_dtypes"] = _state_dtypes(engine)
    out["override_groups"] = [[engine.param_names[p] for p in engine.optimizer.group_params(index)]
                              for index in range(engine.optimizer.num_groups)]
    def save(case):
        def phase(context, out):
            engine = _engine(world, case)
            train_steps(engine, RUN, 0, STEPS)
            engine.save_checkpoint(os.path.join(workdir, case), tag="a")
            out[case] = consolidated_state(engine)

        phase.__name__ = case
        return phase

    run_phases(out, {}, *map(save, filter(runnable, CASES)))  # one failing row fails only its own test
    out["wrappers"] = {case: type(_engine(world, case).optimizer).__name__
                       for case in ("Adam8bit-bf16acc-zero1", "Adam8bit-bf16acc-zero2", "Adam8bit-bf16-zero1")}
    offload = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    out["offload_stock_check"] = _error(lambda: build_engine(world, bnb.optim.Adam8bit, **offload))
    out["offload"] = _error(lambda: build_engine(world, bnb.optim.Adam8bit, zero_force_ds_cpu_optimizer=False,
                                                 **offload))
    out["stage3"] = _error(lambda: build_engine(world, bnb.optim.Adam8bit, zero_optimization={"stage": 3}))
    _save_result(os.path.join(workdir, f"saved_dp{world}.pt"), out)


def load_all(rank, world, workdir):
    out = {}
    engine = _override_engine(world)
    engine.load_checkpoint(os.path.join(workdir, "override"))
    out["override"] = {"state": consolidated_state(engine), "dtypes": _state_dtypes(engine)}
    def load(case):
        def phase(context, out):
            engine = _engine(world, case)
            engine.load_checkpoint(os.path.join(workdir, case))
            state = consolidated_state(engine)
            module_is_master = all(
                rank != 0 or torch.equal(p.detach(), state["params"][n]["fp32"].to(p.dtype))
                for n, p in engine.module.named_parameters()
            )
            out[case] = {"state": state, "module_is_master": module_is_master,
                         "loss": train_steps(engine, RUN, STEPS, 1)[0]}

        phase.__name__ = case
        return phase

    run_phases(out, {}, *map(load, filter(runnable, CASES)))
    _save_result(os.path.join(workdir, f"loaded_dp{world}.pt"), out)
