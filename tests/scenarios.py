"""Multi-process scenarios run by the tests; rank 0 writes results that pytest then checks.

Each function is one launch of ``world_size`` real processes (gloo on CPU), doing as many
checks as it can so the suite stays fast.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import bitsandbytes as bnb
import torch
import torch.distributed as dist

import zero_bnb

from zero_bnb.testing.consolidate import consolidated_state
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import LEARNING_RATE as LR
from zero_bnb.testing.toy import build_engine, build_model, param_groups, train_steps

OPTIMIZERS = {"Adam8bit": bnb.optim.Adam8bit, "AdamW8bit": bnb.optim.AdamW8bit, "AdamW": torch.optim.AdamW,
              "Lion8bit": bnb.optim.Lion8bit, "SGD8bit": functools.partial(bnb.optim.SGD8bit, momentum=0.9)}

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def make_engine(dp: int, optimizer_name: str = "Adam8bit", **config):
    return build_engine(dp, OPTIMIZERS[optimizer_name], **config)


def _save_result(path: str, obj) -> None:
    if dist.get_rank() == 0:
        torch.save(obj, path)


def train_save_continue(rank, world, workdir, optimizer_name, steps_before, steps_after):
    """Train, checkpoint, snapshot, then keep training: the uninterrupted reference run."""
    engine = make_engine(world, optimizer_name)
    losses = train_steps(engine, RUN, 0, steps_before)
    engine.save_checkpoint(os.path.join(workdir, "ckpt"), tag="mid")
    saved = consolidated_state(engine)
    from optimizer_scenarios import bnb_view

    saved_bnb = bnb_view(engine, param_groups(engine.module))
    after = train_steps(engine, RUN, steps_before, steps_after)
    final = consolidated_state(engine)
    final_bnb = bnb_view(engine, param_groups(engine.module))
    # Reload into the same (advanced) engine: it must return exactly to the saved state.
    engine.load_checkpoint(os.path.join(workdir, "ckpt"), tag="mid")
    reloaded = consolidated_state(engine)
    _save_result(os.path.join(workdir, f"reference_dp{world}.pt"),
                 {"saved": saved, "final": final, "reloaded": reloaded, "losses": losses + after,
                  "global_steps": engine.global_steps, "saved_bnb": saved_bnb, "final_bnb": final_bnb})


def resume(rank, world, workdir, optimizer_name, steps_before, steps_after):
    """Load the checkpoint at DP=``world``, snapshot, re-save, and keep training."""
    from optimizer_scenarios import bnb_view

    engine = make_engine(world, optimizer_name)
    engine.load_checkpoint(os.path.join(workdir, "ckpt"))
    loaded = consolidated_state(engine)
    global_steps = engine.global_steps
    after = train_steps(engine, RUN, steps_before, steps_after)
    final = consolidated_state(engine)
    _save_result(os.path.join(workdir, f"resumed_dp{world}.pt"),
                 {"loaded": loaded, "final": final, "final_bnb": bnb_view(engine, param_groups(engine.module)),
                  "losses": after, "global_steps": global_steps})


def round_trip_leg(rank, world, workdir, optimizer_name, source, target, steps_before, steps):
    """One leg of a DP=2 -> 3 -> 2 round trip: load checkpoint folder ``source``, train ``steps`` steps from step
    ``steps_before`` and (``target``) save into ``target``. Every view is bitsandbytes' (``optimizer_scenarios.bnb_view``:
    each rank's partitions and state read straight from the optimizer, 8-bit codes dequantized by bitsandbytes), not
    zero_bnb's consolidated one."""
    from optimizer_scenarios import bnb_view

    engine = make_engine(world, optimizer_name)
    groups = param_groups(engine.module)
    engine.load_checkpoint(os.path.join(workdir, source))
    loaded = bnb_view(engine, groups)
    global_steps = engine.global_steps
    losses = train_steps(engine, RUN, steps_before, steps)
    if target:
        engine.save_checkpoint(os.path.join(workdir, target), tag="back")
    _save_result(os.path.join(workdir, f"leg_{source}_dp{world}.pt"),
                 {"loaded": loaded, "global_steps": global_steps, "losses": losses, "saved": bnb_view(engine, groups)})


def _stock_engine(dp, optimizer_name="Adam8bit", **extra):
    import deepspeed

    model = build_model()
    optimizer = OPTIMIZERS[optimizer_name](param_groups(model), lr=LR)
    config = RUN.ds_config(dp, zero_allow_untested_optimizer=True, **extra)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _error(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return None


def _stock_baseline(context, out):
    """Stock DeepSpeed + Adam8bit: train and save (the checkpoint stock DeepSpeed can only reload at DP=2);
    zero_bnb loads it at the same DP size."""
    world, workdir = context["world"], context["workdir"]
    stock = _stock_engine(world)
    train_steps(stock, RUN, 0, 3)
    stock.save_checkpoint(os.path.join(workdir, "stock"), tag="s")
    stock_weights = {n: p.detach().clone() for n, p in stock.module.named_parameters()}
    engine = make_engine(world, zero_cpu_update="bitsandbytes")  # stock steps with bitsandbytes' CPU arithmetic
    engine.load_checkpoint(os.path.join(workdir, "stock"))
    out["stock_loaded"] = consolidated_state(engine)
    out["stock_weights"] = stock_weights
    out["stock_losses_after"] = train_steps(engine, RUN, 3, 2)
    out["stock_reference_after"] = train_steps(stock, RUN, 3, 2)


def _adamw_pass_through(context, out):
    """torch.optim.AdamW through zero_bnb trains exactly like stock DeepSpeed."""
    world, workdir = context["world"], context["workdir"]
    stock_adamw, ours_adamw = _stock_engine(world, "AdamW"), make_engine(world, "AdamW")
    out["adamw_losses"] = (train_steps(stock_adamw, RUN, 0, 3), train_steps(ours_adamw, RUN, 0, 3))
    out["adamw_weights"] = (
        {n: p.detach().clone() for n, p in stock_adamw.module.named_parameters()},
        {n: p.detach().clone() for n, p in ours_adamw.module.named_parameters()},
    )
    ours_adamw.save_checkpoint(os.path.join(workdir, "adamw"), tag="a")
    out["adamw_saved"] = consolidated_state(ours_adamw)
    stock_adamw.save_checkpoint(os.path.join(workdir, "stock_adamw"), tag="a")
    out["model_files:fp32"] = _model_files(workdir, "stock_adamw", "adamw", "a")


def _model_files(workdir, stock, ours, tag, stock_tag="a"):
    """Rank 0: the module weights in stock DeepSpeed's and zero_bnb's model files, and zero_bnb's master storage."""
    if dist.get_rank() != 0:
        return None
    read = lambda folder, tag: torch.load(os.path.join(workdir, folder, tag, "mp_rank_00_model_states.pt"),
                                          weights_only=False)["module"]
    with open(os.path.join(workdir, ours, tag, "zero_bnb", "manifest.json"), encoding="utf-8") as handle:
        storages = [group["masters"] for group in json.load(handle)["groups"]]
    return read(stock, stock_tag), read(ours, tag), storages


def _bf16_model_files(context, out):
    """bf16 ZeRO-2 with torch AdamW, stock DeepSpeed and zero_bnb side by side, then a module weight changed after
    the step (its group must store its masters whole)."""
    world, workdir = context["world"], context["workdir"]
    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    stock, ours = _stock_engine(world, "AdamW", **bf16), make_engine(world, "AdamW", **bf16)
    out["bf16_adamw_losses"] = (train_steps(stock, RUN, 0, 3), train_steps(ours, RUN, 0, 3))
    stock.save_checkpoint(os.path.join(workdir, "stock_bf16"), tag="a")
    ours.save_checkpoint(os.path.join(workdir, "ours_bf16"), tag="a")
    out["model_files:bf16"] = _model_files(workdir, "stock_bf16", "ours_bf16", "a")
    with torch.no_grad():
        ours.module[0].weight.add_(1.0)  # not the rounding of its master any more: stored whole
    ours.save_checkpoint(os.path.join(workdir, "ours_bf16"), tag="changed")
    state = consolidated_state(ours)
    out["model_files:bf16_changed"] = _model_files(workdir, "stock_bf16", "ours_bf16", "changed")
    if dist.get_rank() == 0:
        from zero_bnb.tools.recovery import fp32_state_dict

        out["bf16_changed_masters"] = {name: tensors["fp32"] for name, tensors in state["params"].items()}
        out["bf16_changed_offline"] = fp32_state_dict(os.path.join(workdir, "ours_bf16"), "changed")
        out["bf16_zero2_offline"] = fp32_state_dict(os.path.join(workdir, "bf16_zero2"), "b")


def _threshold_mismatch(context, out):
    """A size threshold that catches absmax (49 blocks per rank here) is refused before anything is written."""
    world, workdir = context["world"], context["workdir"]
    bad = make_engine(world, zero_unsharded_state_max_numel=256)
    train_steps(bad, RUN, 0, 1)
    out["mismatch_error"] = _error(lambda: bad.save_checkpoint(os.path.join(workdir, "bad"), tag="b"))
    folder = os.path.join(workdir, "bad")
    out["mismatch_listing"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else None


def _bf16_zero2_save(context, out):
    """A bf16 ZeRO-2 checkpoint, for an fp32 ZeRO-1 engine at DP=3 to load (``_bf16_zero2_into_fp32``)."""
    world, workdir = context["world"], context["workdir"]
    bf16 = make_engine(world, bf16={"enabled": True}, zero_optimization={"stage": 2})
    train_steps(bf16, RUN, 0, 2)
    bf16.save_checkpoint(os.path.join(workdir, "bf16_zero2"), tag="b")
    state = consolidated_state(bf16)
    if dist.get_rank() == 0:
        masters = {name: tensors["fp32"] for name, tensors in state["params"].items()}
        out["bf16_zero2_masters"] = masters
        out["bf16_zero2_rounding_differs"] = any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())
        with open(os.path.join(workdir, "bf16_zero2", "b", "zero_bnb", "manifest.json"), encoding="utf-8") as handle:
            out["bf16_zero2_storages"] = [group["masters"] for group in json.load(handle)["groups"]]


#: ``zero_update_max_numel`` of the piecewise-update check: 1000, rounded down to 768 (3 blocks), so the toy's 8-bit
#: partitions at DP=2 (12544 and 4352 elements) are updated in 17 and 6 pieces, the last one partial, while its
#: 256-element bias partition stays whole.
PIECE_NUMEL = 1000
#: name -> (optimizer, config): the fused CPU kernel for a 2-state and a 1-state family, bitsandbytes' own CPU path
#: under bf16 ZeRO-2, and 32-bit state (bitsandbytes' 32-bit update).
PIECEWISE = {
    "Adam8bit": (bnb.optim.Adam8bit, {}),
    "Lion8bit": (bnb.optim.Lion8bit, {}),
    "AdamW8bit-bitsandbytes-bf16-zero2": (bnb.optim.AdamW8bit, {"zero_cpu_update": "bitsandbytes",
                                                               "bf16": {"enabled": True},
                                                               "zero_optimization": {"stage": 2}}),
    "Adam32bit": (bnb.optim.Adam32bit, {}),
}


def _piecewise_update(context, out):
    """Partitions above ``zero_update_max_numel`` (the path of partitions above 2^31 elements, with a small limit):
    the same training with and without the limit, through real engines; each run's losses, state and the sizes
    the bitsandbytes update was called with in its first step."""
    world = context["world"]
    for name, (optimizer, config) in PIECEWISE.items():
        runs = {}
        for label, extra in (("whole", {}), ("pieces", {"zero_update_max_numel": PIECE_NUMEL})):
            engine = build_engine(world, optimizer, **config, **extra)
            update = engine.optimizer.optimizer.update_step  # zero_bnb.bnb.chunked.ChunkedUpdate
            calls: list[int] = []
            original = update.original
            update.original = lambda group, p, g, i, original=original: (calls.append(p.numel()),
                                                                         original(group, p, g, i))[1]
            losses = [train_steps(engine, RUN, 0, 1)[0]]
            first_step = list(calls)
            losses += train_steps(engine, RUN, 1, 2)
            runs[label] = {"losses": losses, "state": consolidated_state(engine), "calls": first_step,
                           "limit": update.limit,
                           "partitions": [engine.optimizer.master_partition(i).numel()
                                          for i in range(engine.optimizer.num_groups)]}
        out["piecewise:" + name] = runs


def misc_dp2(rank, world, workdir):
    """Stock DeepSpeed baseline, torch AdamW pass-through, replicated-key mismatch, stock rescue at DP=2, updates
    in pieces."""
    out: dict = {}
    run_phases(out, {"world": world, "workdir": workdir}, _stock_baseline, _adamw_pass_through, _threshold_mismatch,
               _bf16_zero2_save, _piecewise_update, _bf16_model_files)
    _save_result(os.path.join(workdir, "misc_dp2.pt"), out)


def _stock_at_another_dp(context, out):
    """At DP=3: stock DeepSpeed refuses its own checkpoint; zero_bnb explains."""
    world, workdir = context["world"], context["workdir"]
    stock = _stock_engine(world)
    out["stock_refuses"] = _error(lambda: stock.load_checkpoint(os.path.join(workdir, "stock")))
    engine = make_engine(world)
    out["zero_bnb_on_stock"] = _error(lambda: engine.load_checkpoint(os.path.join(workdir, "stock")))


def _adamw_loads(context, out):
    """The AdamW checkpoint resumes, whole or weights only; an Adam8bit engine refuses it."""
    world, workdir = context["world"], context["workdir"]
    adamw = make_engine(world, "AdamW")
    adamw.load_checkpoint(os.path.join(workdir, "adamw"))
    out["adamw_loaded"] = consolidated_state(adamw)
    module_only = make_engine(world, "AdamW")
    module_only.load_checkpoint(os.path.join(workdir, "adamw"), load_module_only=True)
    out["module_only"] = consolidated_state(module_only)
    no_optimizer = make_engine(world, "AdamW")
    no_optimizer.load_checkpoint(os.path.join(workdir, "adamw"), load_optimizer_states=False)
    out["no_optimizer_states"] = consolidated_state(no_optimizer)
    wrong_model = make_engine(world)  # Adam8bit engine, AdamW checkpoint
    out["wrong_optimizer"] = _error(lambda: wrong_model.load_checkpoint(os.path.join(workdir, "adamw")))


def _bf16_zero2_into_fp32(context, out):
    """The bf16 ZeRO-2 checkpoint loaded by an fp32 ZeRO-1 engine, whole and weights only: the module weights
    the next step runs with must be the loaded fp32 masters (a step between loads makes each one count)."""
    world, workdir = context["world"], context["workdir"]
    engine = make_engine(world)
    for kwargs in ({}, {"load_module_only": True}, {"load_optimizer_states": False}):
        train_steps(engine, RUN, 0, 1)
        label = "bf16_zero2_into_fp32:" + (",".join(kwargs) or "whole")
        out[label] = _error(lambda kwargs=kwargs: engine.load_checkpoint(os.path.join(workdir, "bf16_zero2"), **kwargs))
        state = consolidated_state(engine)
        if dist.get_rank() == 0:
            out[label + ":masters"] = {name: tensors["fp32"] for name, tensors in state["params"].items()}
            out[label + ":module"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _bf16_zero2_into_bf16(context, out):
    """The bf16 ZeRO-2 checkpoint (saved at DP=2) loaded at DP=3 by bf16 engines, through DeepSpeed's ZeRO optimizer
    and its BF16_Optimizer: the module weights are the masters cast to bf16, which every rank once read from all
    shards. The load copies them from the checkpoint (CPU); ``cast_masters_into_module`` (each rank casts its
    partition, the ranks all-gather: the accelerator path) must give the same bits."""
    world, workdir = context["world"], context["workdir"]
    for name, extra in (("zero1", {}), ("bf16_optimizer", {"data_types": {"grad_accum_dtype": "fp32"}})):
        engine = make_engine(world, bf16={"enabled": True}, **extra)
        train_steps(engine, RUN, 0, 1)
        label = f"bf16_zero2_into_bf16:{name}"
        out[label] = _error(lambda engine=engine: engine.load_checkpoint(os.path.join(workdir, "bf16_zero2")))
        out[label + ":class"] = type(engine.optimizer).__name__
        loaded = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        for param in engine.module.parameters():
            param.data.zero_()  # the all-gather must write every element of every rank's weights
        engine.optimizer.cast_masters_into_module()
        if dist.get_rank() == 0:
            out[label + ":module"] = loaded
            out[label + ":gathered"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        # bf16 at DP=3: a rank owns no element of the 346-element bias group; every group still derives its masters
        # from the module weights, and they reload bit for bit
        if name == "zero1":
            engine.save_checkpoint(os.path.join(workdir, "bf16_dp3"), tag="c")
            with open(os.path.join(workdir, "bf16_dp3", "c", "zero_bnb", "manifest.json"), encoding="utf-8") as handle:
                groups = json.load(handle)["groups"]
            out["bf16_dp3_storages"] = [(group["masters"], group["element_ranges"]) for group in groups]
        else:
            out["bf16_dp3_reload"] = _error(lambda engine=engine: engine.load_checkpoint(
                os.path.join(workdir, "bf16_dp3"), tag="c"))
            state = consolidated_state(engine)
            if dist.get_rank() == 0:
                out["bf16_dp3_reloaded"] = {n: tensors["fp32"] for n, tensors in state["params"].items()}


class _Reordered(torch.nn.Module):
    """The toy model with a tied alias ``head`` of its last layer registered first (so ``head.weight`` becomes the
    parameter's first name, as when a module's definition order changes) and a new layer ``newhead``."""

    def __init__(self, alias: bool):
        toy = build_model()
        super().__init__()
        if alias:
            self.add_module("head", toy[4])
        for index, layer in enumerate(toy):
            self.add_module(str(index), layer)
        torch.manual_seed(7)
        self.add_module("newhead", torch.nn.Linear(90, 8))

    def forward(self, x):
        for name, layer in self.named_children():
            x = layer(x) if name.isdigit() else x
        return x


def _module_only_into_a_changed_model(context, out):
    """Weights-only loads of the bf16 ZeRO-2 checkpoint (saved at DP=2) into a fine-tuning model at DP=3: a new layer
    (``newhead``) in two of the optimizer's groups, and the last layer's first name changed by a tied alias."""
    world, workdir = context["world"], context["workdir"]
    for strict, alias in ((False, True), (True, False)):
        model = _Reordered(alias)
        layers = [getattr(model, str(index)) for index in (0, 2, 4)]
        groups = [{"params": [layers[0].weight, layers[1].weight, model.newhead.weight], "weight_decay": 0.1},
                  {"params": [layer.bias for layer in layers] + [model.newhead.bias], "weight_decay": 0.0},
                  {"params": [layers[2].weight], "weight_decay": 0.01}]
        init = {f"newhead.{n}": p.detach().clone() for n, p in model.newhead.named_parameters()}
        engine, *_ = zero_bnb.initialize(model=model, optimizer=bnb.optim.Adam8bit(groups, lr=LR), config=RUN.ds_config(
            world, bf16={"enabled": True}, zero_optimization={"stage": 2}))
        label = f"module_only_changed:strict={strict}"
        out[label] = _error(lambda engine=engine, strict=strict: engine.load_checkpoint(
            os.path.join(workdir, "bf16_zero2"), load_module_only=True, load_module_strict=strict))
        state = consolidated_state(engine)
        if dist.get_rank() == 0 and not strict:
            out[label + ":masters"] = {name: tensors["fp32"] for name, tensors in state["params"].items()}
            out[label + ":module"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            out[label + ":init"] = init


def misc_dp3(rank, world, workdir):
    """At DP=3: stock DeepSpeed refuses its own checkpoint; zero_bnb explains; AdamW checkpoint resumes."""
    out: dict = {}
    run_phases(out, {"world": world, "workdir": workdir}, _stock_at_another_dp, _adamw_loads, _bf16_zero2_into_fp32,
               _bf16_zero2_into_bf16, _module_only_into_a_changed_model)
    _save_result(os.path.join(workdir, "misc_dp3.pt"), out)


class Recorded(dict):
    """One launch's results (rank 0's); a key a raising phase never wrote fails with that phase's error."""

    def __missing__(self, key):
        errors = {name: text for name, text in self.items() if str(name).startswith("phase!")}
        raise AssertionError(f"{key!r} was not recorded; phases that raised: {errors}")


def cli(*args) -> tuple[int, str, str]:
    """Run ``zero-bnb ARGS`` in this process; returns (exit code, stdout, stderr)."""
    import contextlib
    import io

    from zero_bnb.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([str(a) for a in args])
    return code, stdout.getvalue(), stderr.getvalue()


#: Where :func:`run_phases` appends each phase that raised (set by tests/conftest.py for the whole run).
FAILED_PHASES_ENV = "ZERO_BNB_FAILED_PHASES"


def run_phases(out: dict, context: dict, *phases) -> None:
    """Run each ``phase(context, out)`` in turn; one that raises is recorded under ``"phase!<name>"`` and the
    next one runs, so an unexpected error fails the tests of its own phase, not every test of the launch.
    ``ZERO_BNB_PHASE_TIMES=path`` appends each phase's wall and CPU seconds (rank 0) to ``path``: where a launch's
    time goes."""
    import time
    import traceback

    for phase in phases:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            phase(context, out)
        except Exception as error:  # noqa: BLE001 - recorded for the tests of this phase
            name = phase.__name__.lstrip("_")
            out[f"phase!{name}"] = traceback.format_exc(limit=8)
            if os.environ.get(FAILED_PHASES_ENV):  # the suite checks that some test expected it (tests/conftest.py)
                with open(os.environ[FAILED_PHASES_ENV], "a") as log:
                    rank = dist.get_rank() if dist.is_initialized() else 0
                    log.write(f"{name}\t{rank}\t{type(error).__name__}: {str(error)[:300]!r}\n")
        if os.environ.get("ZERO_BNB_PHASE_TIMES") and (not dist.is_initialized() or dist.get_rank() == 0):
            with open(os.environ["ZERO_BNB_PHASE_TIMES"], "a") as log:  # where a launch's time goes (rank 0's clock)
                log.write(f"{phase.__name__}\tdp{dist.get_world_size() if dist.is_initialized() else 1}\t"
                          f"wall {time.perf_counter() - wall:.2f}\tcpu {time.process_time() - cpu:.2f}\n")


def result(ranks: list[dict], key: str):
    """``key``'s value, the same on every rank; if a phase raised before writing it, fail with that error."""
    missing = [rank for rank, out in enumerate(ranks) if key not in out]
    if missing:
        errors = {name: text for out in ranks for name, text in out.items() if name.startswith("phase!")}
        raise AssertionError(f"{key!r} was not recorded on rank(s) {missing}; phases that raised: {errors}")
    values = [out[key] for out in ranks]
    assert all(value == values[0] for value in values), (key, values)
    return values[0]


def within(label: str, measured: float, bound: float) -> None:
    """Assert ``measured <= bound`` and print both (``pytest -rP`` lists every figure the README and docs/ cite; launches that
    share the capture file can hide it, so ``ZERO_BNB_BOUNDS_LOG=path`` also appends each line to ``path``)."""
    line = f"[bound] {label}: measured {measured:.3g}, bound {bound:.3g}"
    print(line)
    if os.environ.get("ZERO_BNB_BOUNDS_LOG"):
        with open(os.environ["ZERO_BNB_BOUNDS_LOG"], "a") as log:
            log.write(line + "\n")
    assert measured <= bound, f"{label}: {measured:.3g} exceeds the bound {bound:.3g}"


def worst_relative(reference, values) -> float:
    """Largest ``|value - reference| / |reference|`` over paired lists (of equal length)."""
    return max(abs(v - r) / abs(r) for r, v in zip(reference, values, strict=True))


def check_zero_to_fp32_habits(folder: str, masters: dict[str, torch.Tensor], out: str) -> None:
    """DeepSpeed's ``zero_to_fp32`` functions as users call them, on the toy model's zero_bnb checkpoint in save folder
    ``folder`` whose fp32 master weights are ``masters``: imported from the folder's ``zero_to_fp32.py`` (as
    ``from zero_to_fp32 import ...`` does), and from ``deepspeed.utils.zero_to_fp32`` under ``zero_bnb.enable()``.
    ``load_state_dict_from_zero_checkpoint`` puts the masters into a fresh model; ``convert_zero_checkpoint_to_fp32_
    state_dict`` writes them to ``pytorch_model.bin``; ``convert_zero_checkpoint_to_state_dict`` in bf16 writes them
    rounded to bf16 (``model.safetensors``). Outputs go under ``out``."""
    import importlib.util

    import deepspeed.utils.zero_to_fp32 as stock
    from safetensors.torch import load_file

    import zero_bnb

    spec = importlib.util.spec_from_file_location("zero_to_fp32", os.path.join(folder, "zero_to_fp32.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    zero_bnb.enable()
    try:
        for label, module in (("script", script), ("deepspeed", stock)):
            fresh = build_model(seed=1)
            assert not torch.equal(fresh[0].weight, masters["0.weight"])
            model = module.load_state_dict_from_zero_checkpoint(fresh, folder)
            weights = {name: value.detach() for name, value in model.named_parameters()}
            module.convert_zero_checkpoint_to_fp32_state_dict(folder, os.path.join(out, label))
            written = torch.load(os.path.join(out, label, "pytorch_model.bin"), weights_only=True)
            module.convert_zero_checkpoint_to_state_dict(folder, os.path.join(out, label + "-bf16"), dtype="bf16",
                                                         safe_serialization=True)
            rounded = load_file(os.path.join(out, label + "-bf16", "model.safetensors"))
            assert weights.keys() == written.keys() == rounded.keys() == masters.keys(), (label, sorted(written))
            for name, master in masters.items():
                assert torch.equal(weights[name], master) and torch.equal(written[name], master), (label, name)
                assert torch.equal(rounded[name], master.to(torch.bfloat16)), (label, name)
    finally:
        zero_bnb.disable()
