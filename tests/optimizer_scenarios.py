"""The optimizer x precision x ZeRO-stage matrix: train and save at DP=2, load at DP=3 (one launch per side).

Offloaded rows (``...-offload``: ``offload_optimizer: {"device": "cpu"}``) also continue training after
the save (the uninterrupted reference), load at DP=3 offloaded and at DP=1 not offloaded (a third,
one-process launch), and the non-offloaded rows of ``BACK`` load offloaded at DP=3.
"""

from __future__ import annotations

import functools
import itertools
import os

import bitsandbytes as bnb
import torch
import torch.distributed as dist
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
#: Optimizer offload: every family at ZeRO-2 in fp32 (classic ZeRO-Offload), and Adam8bit at ZeRO-1 and in bf16.
#: bf16acc under offload is DeepSpeed's ZeRO optimizer (its BF16_Optimizer has no offload path).
OFFLOAD_CASES = [f"{o}-fp32-zero2-offload" for o in OPTIMIZERS] + [
    "Adam8bit-fp32-zero1-offload", "Adam8bit-bf16-zero1-offload", "Adam8bit-bf16acc-zero1-offload",
    "AdamW8bit-bf16-zero2-offload",
]
#: Non-offloaded checkpoints loaded into offloaded engines at DP=3 ("and back").
BACK = ["Adam8bit-fp32-zero2", "Lion8bit-fp32-zero1", "AdamW8bit-bf16-zero2"]
OFFLOAD = {"device": "cpu", "pin_memory": False}
STEPS = 2
#: Steps the offloaded rows train after saving, and the resumed runs after loading.
STEPS_AFTER = 2


#: Offload settings zero_bnb refuses (DeepSpeed cannot honour them at stages 1 and 2), by name.
OFFLOAD_REFUSALS = {
    "nvme": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
    "ratio": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
    "offload_param": {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
    "forced": {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
               "zero_force_ds_cpu_optimizer": True},
}


def runnable(case: str) -> bool:
    """fp16 needs CUDA (DeepSpeed's CPU accelerator refuses it), and so does AdEMAMix32bit (bitsandbytes' CPU backend);
    the matrix runs 3 ranks, one device each."""
    return ("-fp16-" not in case and not case.startswith("AdEMAMix32bit")) or torch.cuda.device_count() >= 3


def _engine(world: int, case: str, offload: bool | None = None):
    """The toy engine of row ``case``; ``offload`` overrides the row's own ``-offload`` suffix."""
    offloaded = case.endswith("-offload") if offload is None else offload
    optimizer, precision, stage = case.removesuffix("-offload").rsplit("-", 2)
    config = {"zero_optimization": {"stage": int(stage.removeprefix("zero"))}}
    if offloaded:
        config["zero_optimization"]["offload_optimizer"] = OFFLOAD
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


def _fused_steps(engine) -> int | None:
    """How many updates the fused CPU 8-bit kernel made (``None``: not installed, as for torch optimizers)."""
    from zero_bnb.kernels.cpu_update import CpuUpdate

    update = engine.optimizer.optimizer.__dict__.get("update_step")
    while update is not None and not isinstance(update, CpuUpdate):
        update = getattr(update, "original", None)  # inside zero_bnb.bnb.chunked.ChunkedUpdate
    return None if update is None else update.fused_steps


def _offload_facts(engine) -> dict:
    """Where the optimizer lives: DeepSpeed's offload flag, the device of masters and state, the 8-bit dtypes."""
    wrapper = engine.optimizer
    partitions = [wrapper.master_partition(index) for index in range(wrapper.num_groups)]
    states = [wrapper.optimizer.state.get(flat, {}) for flat in partitions]
    return {
        "wrapper": type(wrapper).__name__,
        "base": type(wrapper.optimizer).__name__,
        "cpu_offload": bool(getattr(wrapper, "cpu_offload", False)),
        "devices": sorted({str(t.device) for t in partitions} | {str(v.device) for state in states
                                                                   for v in state.values() if torch.is_tensor(v)}),
        "state1_dtypes": [str(state["state1"].dtype) if "state1" in state else None for state in states],
        "fused_steps": _fused_steps(engine),
    }


def _module_is_master(engine, state) -> bool:
    return all(dist.get_rank() != 0 or torch.equal(p.detach(), state["params"][n]["fp32"].to(p.dtype))
               for n, p in engine.module.named_parameters())


def _resumed(engine, workdir: str, case: str) -> dict:
    """Load ``case``'s checkpoint into ``engine``; its state, placement and the losses of STEPS_AFTER more steps."""
    engine.load_checkpoint(os.path.join(workdir, case))
    state = consolidated_state(engine)
    return {"state": state, "module_is_master": _module_is_master(engine, state), "offload": _offload_facts(engine),
            "losses": train_steps(engine, RUN, STEPS, STEPS_AFTER)}


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
            out[f"{case}/fused_steps"] = _fused_steps(engine)

        phase.__name__ = case
        return phase

    def save_offloaded(case):
        def phase(context, out):
            engine = _engine(world, case)
            losses = train_steps(engine, RUN, 0, STEPS)
            engine.save_checkpoint(os.path.join(workdir, case), tag="a")
            out[case] = consolidated_state(engine)
            out[f"{case}:offload"] = _offload_facts(engine)
            out[f"{case}:losses"] = losses + train_steps(engine, RUN, STEPS, STEPS_AFTER)  # uninterrupted reference

        phase.__name__ = case
        return phase

    run_phases(out, {}, *map(save, filter(runnable, CASES)),  # one failing row fails only its own test
               *map(save_offloaded, filter(runnable, OFFLOAD_CASES)))
    out["wrappers"] = {case: type(_engine(world, case).optimizer).__name__
                       for case in ("Adam8bit-bf16acc-zero1", "Adam8bit-bf16acc-zero2", "Adam8bit-bf16-zero1")}
    out["offload_refusals"] = {name: _error(lambda: build_engine(world, bnb.optim.Adam8bit, **config))
                               for name, config in OFFLOAD_REFUSALS.items()}
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
            out[case] = {"state": state, "module_is_master": _module_is_master(engine, state),
                         "loss": train_steps(engine, RUN, STEPS, 1)[0]}

        phase.__name__ = case
        return phase

    def load_offloaded(case, offload, key):
        def phase(context, out):
            out[key] = _resumed(_engine(world, case, offload), workdir, case)

        phase.__name__ = key
        return phase

    offloaded = [load_offloaded(case, None, case) for case in filter(runnable, OFFLOAD_CASES)]
    back = [load_offloaded(case, True, f"back:{case}") for case in BACK]
    run_phases(out, {}, *map(load, filter(runnable, CASES)), *offloaded, *back)
    _save_result(os.path.join(workdir, f"loaded_dp{world}.pt"), out)


def load_offloaded_at_dp1(rank, world, workdir):
    """Every offloaded row's checkpoint loaded at DP=1 without offload, then trained on."""
    out = {}

    def load(case):
        def phase(context, out):
            out[case] = _resumed(_engine(world, case, offload=False), workdir, case)

        phase.__name__ = case
        return phase

    run_phases(out, {}, *map(load, filter(runnable, OFFLOAD_CASES)))
    _save_result(os.path.join(workdir, f"loaded_dp{world}.pt"), out)
