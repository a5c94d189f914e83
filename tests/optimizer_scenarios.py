"""The optimizer x precision x ZeRO-stage matrix: train and save at DP=2, load at DP=3 (one launch per side).

Each row also continues the DP=2 run past the checkpoint (the uninterrupted reference its resumed losses are
compared with), records the optimizer's hyper-parameters, and reads every rank's partition through bitsandbytes'
own dequantization (:func:`bnb_view`), a path that shares no code with zero_bnb's consolidation. The DP=2 launch
also trains stock DeepSpeed + bitsandbytes and zero_bnb side by side on a model whose groups are multiples of
2 x 256 elements, where both partition on the same block grid (:func:`_stock_reference`).

Offloaded rows (``...-offload``: ``offload_optimizer: {"device": "cpu"}``) also continue training after
the save (the uninterrupted reference), load at DP=3 offloaded and at DP=1 not offloaded (a third,
one-process launch), and the non-offloaded rows of ``BACK`` load offloaded at DP=3.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch
import torch.distributed as dist
from scenarios import _error, _save_result, run_phases

from zero_bnb.testing.consolidate import consolidated_state
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import LEARNING_RATE, build_engine, param_groups, train_steps

#: name -> optimizer class (with its required arguments); lr is the toy's.
OPTIMIZERS = {
    "Adam8bit": bnb.optim.Adam8bit,
    "AdamW8bit": bnb.optim.AdamW8bit,
    # On CPU bitsandbytes falls back to non-paged buffers (with a warning); on GPU they are paged.
    "PagedAdamW8bit": bnb.optim.PagedAdamW8bit,
    "Adam32bit": bnb.optim.Adam32bit,
    # Every group 8-bit (its stacked (2, n) codes); AdEMAMix32bit below has the fp32 (2, n) state.
    "AdEMAMix8bit": functools.partial(bnb.optim.AdEMAMix8bit, min_8bit_size=1),
    # bitsandbytes' own AdEMAMix32bit class allocates one moment instead of two (refused by zero_bnb, see
    # test_bitsandbytes_ademamix32bit_class_is_refused_naming_the_working_spelling); this is the working spelling.
    "AdEMAMix32bit": functools.partial(bnb.optim.AdEMAMix, optim_bits=32),
    "Lion8bit": bnb.optim.Lion8bit,
    "Lion32bit": bnb.optim.Lion32bit,
    "SGD8bit": functools.partial(bnb.optim.SGD8bit, momentum=0.9),
    "RMSprop8bit": bnb.optim.RMSprop8bit,
    "Adagrad8bit": bnb.optim.Adagrad8bit,
    "torch.AdamW": torch.optim.AdamW,
    "torch.Adam": torch.optim.Adam,
}
#: Learning rates other than the toy's 1e-2: RMSprop's first update is lr * g / sqrt((1 - alpha) * g^2), ten times lr
#: (alpha 0.99), so at 1e-2 the toy's loss went from 0.44 to 1602 in one step and the resumed-loss and drift bounds
#: measured how a blow-up amplifies the last bits. At 1e-3 its first update is the size of Adam's at 1e-2 and the toy
#: trains (docs/bounds.md).
LEARNING_RATES = {"RMSprop8bit": 1e-3}


def learning_rate(optimizer: str) -> float:
    """The toy's learning rate for the optimizer named ``optimizer`` (a key of :data:`OPTIMIZERS`)."""
    return LEARNING_RATES.get(optimizer, LEARNING_RATE)


#: bf16acc: bf16 weights, fp32 gradient accumulation (DeepSpeed's BF16_Optimizer at stage 1).
PRECISIONS = ("fp32", "bf16", "bf16acc", "fp16")
STAGES = (1, 2)
#: No bf16acc row at ZeRO-2: DeepSpeed selects BF16_Optimizer only at stage 1, so there it is plain bf16 ZeRO-2
#: (test_each_precision_runs_through_the_deepspeed_wrapper_it_selects shows the wrapper).
#: Classes whose rows would repeat another class's bit for bit: the toy gives every group its weight decay, so AdamW8bit
#: and PagedAdamW8bit run Adam8bit's update (bitsandbytes' "adam" kernel, the same arguments, zero_bnb's one Adam
#: declaration; paging is a no-op on the CPU and below 1e5 elements on a GPU) and torch Adam runs through the same
#: pass-through as torch AdamW. Each keeps the one row that names its class through the whole save and load (and its
#: offload rows); its other rows and stock references are left out.
TWINS = {"AdamW8bit": "AdamW8bit-bf16-zero2", "PagedAdamW8bit": "PagedAdamW8bit-fp32-zero1",
         "torch.Adam": "torch.Adam-fp32-zero1"}
CASES = [f"{o}-{p}-zero{s}" for o, p, s in itertools.product(OPTIMIZERS, PRECISIONS, STAGES)
         if (p, s) != ("bf16acc", 2) and TWINS.get(o, f"{o}-{p}-zero{s}") == f"{o}-{p}-zero{s}"]
#: the stock-vs-zero_bnb reference: every family (but the twins) and precision, ZeRO-1 (ZeRO-2 shares the partitioning).
REFERENCE_CASES = [f"{o}-{p}-zero1" for o, p in itertools.product(OPTIMIZERS, PRECISIONS) if o not in TWINS]
#: Optimizer offload: every family at ZeRO-2 in fp32 (classic ZeRO-Offload; of the twins AdamW8bit), and Adam8bit at
#: ZeRO-1 and in bf16.
#: bf16acc under offload is DeepSpeed's ZeRO optimizer (its BF16_Optimizer has no offload path). AdEMAMix32bit
#: (AdEMAMix with optim_bits=32, which replaced bitsandbytes' broken AdEMAMix32bit class) is not run offloaded yet.
OFFLOAD_CASES = [f"{o}-fp32-zero2-offload" for o in OPTIMIZERS if o not in ("AdEMAMix32bit", "PagedAdamW8bit",
                                                                             "torch.Adam")] + [
    "Adam8bit-fp32-zero1-offload", "Adam8bit-bf16-zero1-offload", "Adam8bit-bf16acc-zero1-offload",
    "AdamW8bit-bf16-zero2-offload",
]
#: Non-offloaded checkpoints loaded into offloaded engines at DP=3 ("and back").
BACK = ["Adam8bit-fp32-zero2", "Lion8bit-fp32-zero1", "AdamW8bit-bf16-zero2"]
OFFLOAD = {"device": "cpu", "pin_memory": False}
STEPS = 2  # trained before the checkpoint
#: Steps every row trains after saving (the uninterrupted run), and the resumed runs after loading.
STEPS_AFTER = 2


#: Offload settings zero_bnb refuses (DeepSpeed cannot honour them at stages 1 and 2), by name.
OFFLOAD_REFUSALS = {
    "nvme": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
    "ratio": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
    "offload_param": {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
    "forced": {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
               "zero_force_ds_cpu_optimizer": True},
}
#: zero_bnb-side config of the stock reference, so both sides run bitsandbytes' own update (zero_bnb's fused CPU
#: kernel has its own reference in tests/test_kernels.py).
ZERO_BNB_REFERENCE_CONFIG: dict = {"zero_cpu_update": "bitsandbytes"}
#: bitsandbytes' quantization block (0.44 and later); the independent view dequantizes with it.
BNB_BLOCK = 256


def runnable(case: str) -> bool:
    """fp16 needs CUDA (DeepSpeed's CPU accelerator refuses it); the matrix saves at DP=2 and loads at DP=3, so its
    fp16 rows need 3 devices, one per rank, and the stock reference's 2."""
    return "-fp16-" not in case or torch.cuda.device_count() >= 3


def _precision_config(case: str, offloaded: bool = False) -> dict:
    _, precision, stage = case.removesuffix("-offload").rsplit("-", 2)
    config: dict = {"zero_optimization": {"stage": int(stage.removeprefix("zero"))}}
    if offloaded:
        config["zero_optimization"]["offload_optimizer"] = OFFLOAD
    if precision == "bf16acc":
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    elif precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def _engine(world: int, case: str, offload: bool | None = None):
    """The toy engine of row ``case``; ``offload`` overrides the row's own ``-offload`` suffix."""
    offloaded = case.endswith("-offload") if offload is None else offload
    optimizer = case.removesuffix("-offload").rsplit("-", 2)[0]
    return build_engine(world, OPTIMIZERS[optimizer], lr=learning_rate(optimizer), **_precision_config(case, offloaded))


def hyper_parameters(engine) -> list[dict]:
    """The inner optimizer's param-group settings (lr, betas, eps, weight decay, ...), without the tensors."""
    return [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.optimizer.param_groups]


def _dequantized(state: dict, key: str) -> torch.Tensor:
    """``state[key]`` as the optimizer sees it: 8-bit codes through ``bnb.functional.dequantize_blockwise``."""
    codes = state[key]
    if codes.dtype != torch.uint8:
        return codes.float()
    absmax, qmap = state["absmax" + key[-1]], state["qmap" + key[-1]]
    rows = [F.dequantize_blockwise(row, absmax=scale, code=qmap, blocksize=BNB_BLOCK)  # AdEMAMix stacks 2 rows
            for row, scale in zip(codes.reshape(-1, codes.shape[-1]), absmax.reshape(-1, absmax.shape[-1]))]
    return torch.stack(rows).reshape(codes.shape)


def bnb_view(engine, groups) -> dict | None:
    """Every parameter's master weights and optimizer state read without zero_bnb's code (rank 0; None elsewhere).

    Each rank's flat partition and its state come straight from the inner optimizer (``param_groups`` /
    ``state``); 8-bit codes are dequantized by bitsandbytes with that rank's own ``absmax`` and map; the
    partitions are concatenated in rank order, cut at the group's length and split by the parameters' sizes in
    ``groups`` (the ``param_groups`` the model was given). Collective over the world group.
    """
    inner = engine.optimizer.optimizer
    local = []
    for group in inner.param_groups:
        (partition,) = group["params"]
        state = inner.state.get(partition, {})
        local.append({
            "master": partition.detach().float().cpu().clone(),
            "state": {k: _dequantized(state, k).cpu().clone() for k, v in state.items()
                      if torch.is_tensor(v) and v.shape[-1:] == partition.shape and not k.startswith(("absmax", "qmap"))},
            "counters": {k: float(v) for k, v in state.items() if not torch.is_tensor(v) or v.dim() == 0},
        })
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if gathered is None:
        return None
    names = {p: n for n, p in engine.module.named_parameters()}
    view: dict = {"params": {}, "counters": []}
    for index, group in enumerate(groups):
        parts = [ranks[index] for ranks in gathered]
        whole = {"fp32": torch.cat([part["master"] for part in parts])}
        whole.update({key: torch.cat([part["state"][key] for part in parts], dim=-1) for key in parts[0]["state"]})
        offset = 0
        for param in group["params"]:
            window = slice(offset, offset + param.numel())
            view["params"][names[param]] = {key: v[..., window].reshape(*v.shape[:-1], *param.shape)
                                            for key, v in whole.items()}
            offset += param.numel()
        # every rank's step counters, not rank 0's alone: a rank that skipped or repeated a step shows
        if any(part["counters"] and part["counters"] != parts[0]["counters"] for part in parts):
            raise ValueError(f"group {index}'s counters differ between ranks: {[part['counters'] for part in parts]}")
        view["counters"].append(parts[0]["counters"])
    return view


def views_differ(saved: dict, loaded: dict) -> list[str]:
    """Where two :func:`bnb_view` results differ, bit for bit (empty when identical)."""
    different = [f"parameters {sorted(saved['params'])} != {sorted(loaded['params'])}"] * (
        saved["params"].keys() != loaded["params"].keys())
    for name, tensors in saved["params"].items():
        other = loaded["params"].get(name, {})
        if other.keys() != tensors.keys():
            different.append(f"{name}: keys {sorted(tensors)} != {sorted(other)}")
        different += [f"{name}.{key}" for key, value in tensors.items()
                      if key in other and not torch.equal(value, other[key])]
    if saved["counters"] != loaded["counters"]:
        different.append(f"counters {saved['counters']} != {loaded['counters']}")
    return different


def _override_engine(world: int):
    """Adam8bit with a 32-bit override for the first layer's weight (9600 elements: 8-bit without it)."""
    import zero_bnb
    from zero_bnb.testing.toy import LEARNING_RATE, build_model

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
    from zero_bnb.kernels.update import installed

    update = installed(engine.optimizer.optimizer)  # inside zero_bnb.bnb.chunked.ChunkedUpdate
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


# -- stock DeepSpeed + bitsandbytes against zero_bnb, on a shared block grid ------------------------------------

#: Every group's length is a multiple of 2 x 256, so at DP=2 stock DeepSpeed's partitions (aligned to 2 x DP
#: elements) start on 256-element blocks exactly like zero_bnb's: the same 8-bit grids, as at DP=1.
ALIGNED_WIDTHS = (60, 128, 96, 16)  # 7680, 12288, 1536 weights: 8-bit, 8-bit and (768 per rank) fp32 state
REFERENCE_STEPS = 3


def _aligned_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(ALIGNED_WIDTHS)]
    return torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1], torch.nn.GELU(), layers[2])


def _aligned_groups(model) -> list[dict]:
    return [{"params": [model[0].weight], "weight_decay": 0.1}, {"params": [model[2].weight], "weight_decay": 0.0},
            {"params": [model[4].weight], "weight_decay": 0.01}]


def _reference_losses(engine, steps: int) -> list[float]:
    """``steps`` optimizer steps on 4 samples per rank (no accumulation); each step's global mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(2000 + step)
        inputs = torch.randn(4 * world, ALIGNED_WIDTHS[0], generator=generator)
        targets = torch.randn(4 * world, ALIGNED_WIDTHS[-1], generator=generator)
        rows = slice(4 * rank, 4 * rank + 4)
        output = engine(inputs[rows].to(engine.device, dtype))
        loss = torch.nn.functional.mse_loss(output.float(), targets[rows].to(engine.device))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().cpu()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _stock_reference(world: int, case: str) -> dict:
    """The same training through ``deepspeed.initialize`` and ``zero_bnb.initialize``: losses and bnb_view."""
    import deepspeed

    import zero_bnb

    config = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True, **_precision_config(case)}
    sides = {}
    for side, initialize, extra in (("stock", deepspeed.initialize, {}),
                                    ("zero_bnb", zero_bnb.initialize, ZERO_BNB_REFERENCE_CONFIG)):
        model = _aligned_model()
        optimizer = OPTIMIZERS[case.rsplit("-", 2)[0]](_aligned_groups(model), lr=1e-2)
        engine, *_ = initialize(model=model, optimizer=optimizer, config={**config, **extra})
        losses = _reference_losses(engine, REFERENCE_STEPS)
        sides[side] = {"losses": losses, "state": bnb_view(engine, _aligned_groups(engine.module)),
                       "hyper": hyper_parameters(engine)}
    return sides


def _unaligned_parameters_engine(world: int):
    """``parameter_alignment`` pads between parameters whose sizes are not multiples of 4 (a 90-element bias)."""
    import zero_bnb

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(60, 90), torch.nn.Linear(90, 90))
    config = RUN.ds_config(world, zero_optimization={"stage": 1, "parameter_alignment": True})
    return zero_bnb.initialize(model=model, optimizer=bnb.optim.Adam8bit(model.parameters()), config=config)


def _moe_engine(world: int):
    """A DeepSpeed MoE layer (experts in their own data-parallel groups)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import zero_bnb

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(60, 60), MoE(60, torch.nn.Linear(60, 60), num_experts=2, ep_size=1))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    return zero_bnb.initialize(model=model, optimizer=bnb.optim.Adam8bit(groups), config=RUN.ds_config(world))


# -- the launches -------------------------------------------------------------------------------------------------

def save_all(rank, world, workdir):
    out = {}
    plan_lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: plan_lines.append(record.getMessage())
    plan_logger = logging.getLogger("zero_bnb.ds.precision_plan")
    plan_logger.setLevel(logging.INFO)
    plan_logger.addHandler(handler)
    try:
        engine = _override_engine(world)
    finally:
        plan_logger.removeHandler(handler)
    out["override_plan"] = plan_lines
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
            out[case] = {"state": consolidated_state(engine), "bnb": bnb_view(engine, param_groups(engine.module)),
                         "hyper": hyper_parameters(engine),
                         "uninterrupted": train_steps(engine, RUN, STEPS, STEPS_AFTER)}
            out[f"{case}/fused_steps"] = _fused_steps(engine)
            out[f"{case}/eight_bit_groups"] = _state_dtypes(engine).count("torch.uint8")

        phase.__name__ = case
        return phase

    def reference(case):
        def phase(context, out):
            out["reference:" + case] = _stock_reference(world, case)

        phase.__name__ = "reference:" + case
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
    run_phases(out, {}, *map(reference, filter(runnable, REFERENCE_CASES)))
    out["wrappers"] = {case: type(_engine(world, case).optimizer).__name__
                       for case in ("Adam8bit-bf16acc-zero1", "Adam8bit-bf16acc-zero2", "Adam8bit-bf16-zero1")}
    out["offload_refusals"] = {name: _error(lambda: build_engine(world, bnb.optim.Adam8bit, **config))
                               for name, config in OFFLOAD_REFUSALS.items()}
    out["stage0"] = _error(lambda: build_engine(world, bnb.optim.Adam8bit, zero_optimization={"stage": 0}))
    out["parameter_alignment"] = _error(lambda: _unaligned_parameters_engine(world))
    out["moe"] = _error(lambda: _moe_engine(world))
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
            out[case] = {"state": state, "bnb": bnb_view(engine, param_groups(engine.module)),
                         "hyper": hyper_parameters(engine), "module_is_master": _module_is_master(engine, state),
                         "global_steps": engine.global_steps, "resumed": train_steps(engine, RUN, STEPS, STEPS_AFTER)}

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
