"""ZeRO stage 3 scenarios: one launch per DP size, each running many phases (see ``scenarios.run_phases``).

``stage3_dp2`` trains and saves every case of :data:`CASES` (every declared 8-bit family, a 32-bit one and torch
AdamW, bf16, ``deepspeed.zero.Init``, optimizer offload, parameter offload, both) and keeps training
uninterrupted; ``stage3_resume`` loads those checkpoints at another DP size and keeps training: offloaded ones
offloaded at DP=3 and without offload at DP=1 (and one with both offloads at DP=1 too), and one saved without offload
into an offloaded engine at DP=3. Frozen (LoRA-style) parameters are saved with and without
``exclude_frozen_parameters`` and under ``deepspeed.zero.Init``. Rank 0 of each launch writes ``stage3_dp{world}.pt``
for the tests to read.
"""

from __future__ import annotations

import os

import deepspeed
import torch
import torch.distributed as dist
from optimizer_scenarios import OPTIMIZERS, learning_rate
from scenarios import _error, _save_result, make_engine, run_phases

import zero_bnb
from zero_bnb.testing.consolidate import consolidated_state
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import LEARNING_RATE as LR
from zero_bnb.testing.toy import build_model, param_groups, train_steps

STEPS_BEFORE, STEPS_AFTER = 3, 3

#: Optimizer offload as a user writes it (pinned memory is a no-op without CUDA).
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
#: Parameter offload alone, and with optimizer offload (ZeRO-Infinity without NVMe).
OFFLOAD_PARAM = {"offload_param": {"device": "cpu", "pin_memory": True}}
OFFLOAD_ALL = {**OFFLOAD, **OFFLOAD_PARAM}

#: name -> (optimizer, extra config, whether the model is built under deepspeed.zero.Init)
CASES = {
    "adam8bit": ("Adam8bit", {}, False),
    "lion8bit": ("Lion8bit", {}, False),
    "adamw8bit": ("AdamW8bit", {}, False),
    "bf16": ("Adam8bit", {"bf16": {"enabled": True}}, False),
    "zero_init": ("Adam8bit", {}, True),
    "adam32bit": ("Adam32bit", {}, False),
    "torch_adamw": ("torch.AdamW", {}, False),
    "offload": ("Adam8bit", {"zero_optimization": OFFLOAD}, False),
    "offload_param": ("Adam8bit", {"zero_optimization": OFFLOAD_PARAM}, False),
    "offload_all": ("AdamW8bit", {"bf16": {"enabled": True}, "zero_optimization": OFFLOAD_ALL}, True),
    # the other declared families; AdEMAMix (two moments stacked in state1, and state2) in fp32 and bf16, Lion (one
    # state) in bf16 offloaded. PagedAdamW8bit has no row: it is AdamW8bit's "adam" update and declaration, and on the
    # CPU (or below 1e5 elements on a GPU) bitsandbytes gives it ordinary buffers (tests/test_units.py checks that its
    # class resolves to the Adam declaration).
    "ademamix8bit": ("AdEMAMix8bit", {}, False),
    "ademamix8bit_bf16": ("AdEMAMix8bit", {"bf16": {"enabled": True}}, False),
    "sgd8bit": ("SGD8bit", {}, False),
    "rmsprop8bit": ("RMSprop8bit", {}, False),
    "adagrad8bit": ("Adagrad8bit", {}, False),
    "lion8bit_offload_bf16": ("Lion8bit", {"bf16": {"enabled": True}, "zero_optimization": OFFLOAD}, False),
}
#: Offloaded cases resume at DP=1 without offload (and at DP=3 offloaded): the files are the same either way.
OFFLOADED = tuple(case for case, (_, extra, _) in CASES.items() if extra.get("zero_optimization"))
#: The case that also resumes offloaded (both offloads) at DP=1, under ``<case>_offloaded``.
OFFLOADED_AT_DP1 = "offload_all"


def stage3_config(dp: int, **extra) -> dict:
    config = RUN.ds_config(dp, **extra)
    config["zero_optimization"] = {"stage": 3, **extra.get("zero_optimization", {})}
    return config


def stage3_engine(dp: int, case: str, offload: bool | str = True):
    """The toy model and optimizer under zero_bnb at ZeRO stage 3; ``offload=False`` drops the case's offload
    sections, ``offload="optimizer"`` puts the model of a case without one under optimizer offload. Collective."""
    optimizer_name, extra, zero_init = CASES[case]
    if offload is False:
        extra = {**extra, "zero_optimization": {key: value for key, value in extra.get("zero_optimization", {}).items()
                                                if not key.startswith("offload")}}
    elif offload == "optimizer":
        extra = {**extra, "zero_optimization": OFFLOAD}
    config = stage3_config(dp, **extra)
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_model()
    else:
        model = build_model()
    optimizer = OPTIMIZERS[optimizer_name](param_groups(model), lr=learning_rate(optimizer_name))
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _partition_sizes(engine) -> dict[str, int]:
    return {engine.param_names[p]: p.ds_tensor.ds_numel for p in engine.module.parameters()}


def _nonzero_padding(engine) -> list[str]:
    """Where a slice's padding (its elements past the parameter's end) is not zero, in the fp32 master or the
    module's slice, on any rank (DeepSpeed allocates slices uninitialised; with L2 weight decay garbage there became
    state and the absmax of the block it shares with real elements). Collective."""
    optimizer = engine.optimizer
    found = []
    for index in range(optimizer.num_groups):
        (param,) = optimizer.group_params(index)
        size = param.ds_tensor.numel()
        real = max(0, min(size, param.ds_numel - optimizer.dp_rank * size))
        for label, tensor in (("master", optimizer.master_partition(index)), ("slice", param.ds_tensor)):
            if tensor.detach()[real:].count_nonzero().item():  # NaN counts too
                found.append(f"{engine.param_names[param]} {label} on rank {optimizer.dp_rank}")
    everywhere: list = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, found)
    return sorted(entry for entries in everywhere for entry in entries)


def _train_save(case: str):
    def phase(context, out):
        world, workdir = context["world"], context["workdir"]
        engine = stage3_engine(world, case)
        out[f"{case}_partitions"] = _partition_sizes(engine)
        losses = train_steps(engine, RUN, 0, STEPS_BEFORE)
        nonzero_padding = _nonzero_padding(engine)
        engine.save_checkpoint(os.path.join(workdir, case), tag="mid")
        saved = consolidated_state(engine)
        saved_ds = ds_view(engine)
        after = train_steps(engine, RUN, STEPS_BEFORE, STEPS_AFTER)
        final = consolidated_state(engine)
        final_ds = ds_view(engine)
        engine.load_checkpoint(os.path.join(workdir, case), tag="mid")
        reloaded = consolidated_state(engine)
        global_steps = engine.global_steps
        # the control at the DP size of the save: the same steps again from the reloaded state
        replayed = {"losses": train_steps(engine, RUN, STEPS_BEFORE, STEPS_AFTER), "final_ds": ds_view(engine)}
        out[case] = {"saved": saved, "saved_ds": saved_ds, "final": final, "final_ds": final_ds, "reloaded": reloaded,
                     "replayed": replayed, "losses": losses + after, "global_steps": global_steps,
                     "offloaded": _offloaded(engine), "nonzero_padding": nonzero_padding}
    phase.__name__ = f"train_save_{case}"
    return phase


#: The element-wise optimizer state a stage-3 view reads through DeepSpeed's accessor (bitsandbytes' names, torch's).
ELEMENTWISE_KEYS = ("state1", "state2", "exp_avg", "exp_avg_sq")


def ds_view(engine) -> dict:
    """Every parameter's master weights and element-wise optimizer state read through DeepSpeed's own accessors
    (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), not zero_bnb's consolidation:
    the oracle shares no code with zero_bnb. 8-bit codes come as numbers (``"codes"`` names those keys) and, as
    ``"<key>:bnb"``, as bitsandbytes' ``dequantize_blockwise`` of each rank's partition with that rank's own ``absmax``
    and map (put beside the codes in the optimizer's state for the accessor to read, then removed), so an ``absmax``
    that differs shows. ``"counters"``: each rank's step counters (a rank that skipped or repeated a step shows). A key
    the optimizer does not hold, or holds stacked in rows, is left out.
    Collective: every rank calls it; every rank gets the view."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from optimizer_scenarios import _dequantized

    states = list(engine.optimizer.optimizer.state.values())
    # DeepSpeed's accessor narrows dimension 0: state stacked in rows (AdEMAMix's state1, shape (2, n)) is beyond it
    stacked = {key for state in states for key, value in state.items() if torch.is_tensor(value) and value.dim() > 1}
    # the accessor hands 8-bit codes back as fp32 numbers (exactly: 0..255); which keys are codes, per bitsandbytes
    codes = sorted({key for state in states for key, value in state.items()
                    if torch.is_tensor(value) and value.dtype == torch.uint8 and key in ELEMENTWISE_KEYS} - stacked)
    for state in states:
        state.update({f"{key}:bnb": _dequantized(state, key) for key in codes if key in state})
    view = {}
    try:
        for name, param in engine.module.named_parameters():
            if not param.requires_grad:
                continue
            entry = {"fp32": safe_get_full_fp32_param(param).detach().cpu().clone()}
            for key in (*ELEMENTWISE_KEYS, *(f"{key}:bnb" for key in codes)):
                if key.split(":")[0] in stacked:
                    continue
                try:
                    value = safe_get_full_optimizer_state(param, key)
                except KeyError:
                    continue
                entry[key] = value.detach().cpu().clone()
            view[name] = entry
    finally:
        for state in states:
            for key in codes:
                state.pop(f"{key}:bnb", None)
    counters = [{key: float(value) for key, value in state.items() if not torch.is_tensor(value) or value.dim() == 0}
                for state in states]
    everywhere: list = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, counters)
    return {"params": view, "codes": codes, "counters": everywhere}


def assert_same_ds_view(saved: dict, loaded: dict, label: str, *, eight_bit: bool) -> int:
    """Two :func:`ds_view` results equal bit for bit, the step counters equal on every rank of both; returns how many
    tensors were compared (for the tests)."""
    saved_ds, loaded_ds = saved["params"], loaded["params"]
    assert saved_ds.keys() == loaded_ds.keys() and saved_ds, (sorted(saved_ds), sorted(loaded_ds))
    codes = saved["codes"]
    assert loaded["codes"] == codes and bool(codes) == eight_bit, codes
    for name, tensors in saved_ds.items():
        assert tensors.keys() == loaded_ds[name].keys() and len(tensors) > 1, (name, sorted(tensors))
        assert {f"{key}:bnb" for key in codes} <= tensors.keys(), (name, sorted(tensors))
        for key, value in tensors.items():
            assert torch.equal(value, loaded_ds[name][key]), f"{label}: {name}.{key}"
    ranks = [counters for rank in (*saved["counters"], *loaded["counters"]) for counters in rank if counters]
    assert ranks and all(counters == ranks[0] for counters in ranks), (label, saved["counters"], loaded["counters"])
    return sum(map(len, saved_ds.values()))


def _offloaded(engine) -> dict:
    """Where DeepSpeed keeps this engine's masters and state: the offload flags and the devices."""
    optimizer = engine.optimizer
    states = [value for state in optimizer.optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor)]
    return {"offload_optimizer": bool(optimizer.offload_optimizer), "offload_param": bool(optimizer.offload_param),
            "devices": sorted({str(t.device) for t in [*optimizer.fp32_partitioned_groups_flat, *states]})}


def _fused_steps(optimizer) -> int | None:
    """How many updates the fused CPU 8-bit kernel made (``None``: not installed, e.g. torch AdamW)."""
    update = optimizer.__dict__.get("update_step")
    update = getattr(update, "original", update)  # ChunkedUpdate wraps the FusedUpdate
    return getattr(update, "fused_steps", None)


def _resume(case: str, offload: bool | str = True, name: str | None = None):
    """Load case ``case``'s checkpoint into its engine (``offload``: see :func:`stage3_engine`) and keep training;
    the results go under ``name`` (default: ``case``)."""
    def phase(context, out):
        world, workdir = context["world"], context["workdir"]
        engine = stage3_engine(world, case, offload=offload)
        engine.load_checkpoint(os.path.join(workdir, case))
        loaded = consolidated_state(engine)
        loaded_ds = ds_view(engine)
        global_steps = engine.global_steps
        after = train_steps(engine, RUN, STEPS_BEFORE, STEPS_AFTER)
        out[name or case] = {"loaded": loaded, "loaded_ds": loaded_ds, "final": consolidated_state(engine), "losses": after,
                             "global_steps": global_steps, "offloaded": _offloaded(engine),
                             "fused_steps": _fused_steps(engine.optimizer.optimizer),
                             "nonzero_padding": _nonzero_padding(engine)}
    phase.__name__ = f"resume_{name or case}"
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
    # fine-tuning: a new layer (never run here) beside the saved ones, loaded with load_module_strict=False
    model = build_model()
    torch.manual_seed(7)
    model.add_module("newhead", torch.nn.Linear(90, 8))
    init = {f"newhead.{n}": p.detach().clone() for n, p in model.newhead.named_parameters()}
    groups = param_groups(model[:5]) + [{"params": list(model.newhead.parameters()), "weight_decay": 0.0}]
    engine, *_ = zero_bnb.initialize(model=model, optimizer=OPTIMIZERS["Adam8bit"](groups, lr=LR),
                                     config=stage3_config(world))
    engine.load_checkpoint(os.path.join(workdir, "adam8bit"), load_module_only=True, load_module_strict=False)
    state = consolidated_state(engine)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {engine.param_names[p]: p.detach().clone() for p in engine.module.parameters()}
    out["module_only_changed"] = {"masters": state and {n: t["fp32"] for n, t in state["params"].items()},
                                  "weights": weights, "init": init}


def _reshaped(context, out):
    """A stage-3 checkpoint loaded into a model whose ``2.weight`` is (160, 96) instead of (96, 160): the same number
    of elements, so only the shapes tell; refused before the engine is touched."""
    world, workdir = context["world"], context["workdir"]
    model = build_model()
    model[2] = torch.nn.Linear(96, 160)
    engine, *_ = zero_bnb.initialize(model=model, optimizer=OPTIMIZERS["Adam8bit"](param_groups(model), lr=LR),
                                     config=stage3_config(world))
    before = consolidated_state(engine)
    error = _error(lambda: engine.load_checkpoint(os.path.join(workdir, "adam8bit")))
    out["reshaped"] = {"error": error, "before": before, "after": consolidated_state(engine)}


def _frozen_engine(world: int, stage: int, zero_init: bool = False):
    """Adam8bit on the toy model whose first layer is frozen (LoRA-style), at ``stage``; ``zero_init``: the model is
    built under ``deepspeed.zero.Init`` (stage 3), partitioned as each parameter is created. Collective."""
    config = stage3_config(world) if stage == 3 else RUN.ds_config(world, zero_optimization={"stage": stage})
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=zero_init):
        model = build_model()
    model[0].weight.requires_grad_(False)
    optimizer = OPTIMIZERS["Adam8bit"]([p for p in model.parameters() if p.requires_grad], lr=LR)
    return zero_bnb.initialize(model=model, optimizer=optimizer, config=config)[0]


def _frozen_weight(engine) -> torch.Tensor:
    """The frozen layer's whole weight (gathered at stage 3). Collective."""
    param = engine.module[0].weight
    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


def _fill_frozen(engine, value: float) -> None:
    """Set the frozen layer's weight to ``value`` everywhere (gathered, rank 0's write kept). Collective."""
    with deepspeed.zero.GatheredParameters([engine.module[0].weight], modifier_rank=0), torch.no_grad():
        engine.module[0].weight.fill_(value)


def _frozen_save(context, out):
    """DeepSpeed saves each rank's slice of a frozen parameter in that rank's stage-3 model file; a reload into
    the same engine (its frozen weight zeroed first) must restore every rank's own slice. One step later the engine
    saves again with ``exclude_frozen_parameters=True`` (``frozen_excluded``: trained state only, as HF Trainer saves a
    PEFT model)."""
    world, workdir = context["world"], context["workdir"]
    engine = _frozen_engine(world, 3)
    train_steps(engine, RUN, 0, STEPS_BEFORE)
    engine.save_checkpoint(os.path.join(workdir, "frozen"), tag="mid")
    saved = _frozen_weight(engine)
    _fill_frozen(engine, 0.0)
    engine.load_checkpoint(os.path.join(workdir, "frozen"), tag="mid")
    out["frozen"] = {"saved": saved, "reloaded": _frozen_weight(engine), "state": consolidated_state(engine)}
    train_steps(engine, RUN, STEPS_BEFORE, 1)
    engine.save_checkpoint(os.path.join(workdir, "frozen_excluded"), tag="mid", exclude_frozen_parameters=True)
    out["frozen_excluded"] = {"state": consolidated_state(engine)}


def _frozen_init_save(context, out):
    """The frozen model built under ``deepspeed.zero.Init`` (its parameters partitioned as they are created)."""
    world, workdir = context["world"], context["workdir"]
    engine = _frozen_engine(world, 3, zero_init=True)
    losses = train_steps(engine, RUN, 0, STEPS_BEFORE)
    engine.save_checkpoint(os.path.join(workdir, "frozen_init"), tag="mid")
    out["frozen_init"] = {"saved": _frozen_weight(engine), "state": consolidated_state(engine), "losses": losses}


def _frozen_resume(context, out):
    """The frozen layer's weight after loading the DP=2 stage-3 checkpoint at this DP size, at stages 3 and 2."""
    world, workdir = context["world"], context["workdir"]
    for stage in (3, 2):
        engine = _frozen_engine(world, stage)
        engine.load_checkpoint(os.path.join(workdir, "frozen"))
        if stage == 2:  # a stage-2 checkpoint of the frozen model, for _unfrozen_module_only
            engine.save_checkpoint(os.path.join(workdir, f"frozen_stage2_dp{world}"), tag="mid")
        out[f"frozen_stage{stage}"] = {"loaded": _frozen_weight(engine), "state": consolidated_state(engine),
                                       "loss": train_steps(engine, RUN, STEPS_BEFORE, 1)[0]}


def _unfrozen_module_only(context, out):
    """Full fine-tuning from a LoRA-style checkpoint: ``load_module_only`` into the toy with every layer trained. The
    stage-2 checkpoint's frozen weight becomes the first layer's weight and its master (else the next step would put
    the model's own weight back); the stage-3 one holds only slices of it per rank: refused, naming it."""
    world, workdir = context["world"], context["workdir"]
    for stage, folder in ((2, f"frozen_stage2_dp{world}"), (3, "frozen")):
        config = stage3_config(world) if stage == 3 else RUN.ds_config(world, zero_optimization={"stage": stage})
        model = build_model()
        with torch.no_grad():
            model[0].weight.fill_(0.5)  # not the saved weight (the toy's own, never trained while frozen)
        engine = zero_bnb.initialize(model=model, optimizer=OPTIMIZERS["Adam8bit"](list(model.parameters()), lr=LR),
                                     config=config)[0]
        error = _error(lambda engine=engine, folder=folder: engine.load_checkpoint(os.path.join(workdir, folder),
                                                                                   load_module_only=True))
        state = consolidated_state(engine)
        out[f"unfrozen_stage{stage}"] = {"error": error, "weight": _frozen_weight(engine),
                                         "master": state and state["params"]["0.weight"]["fp32"]}


def _frozen_init_resume(context, out):
    """Into a frozen model built under ``deepspeed.zero.Init`` at this DP size: the zero.Init checkpoint, then (the
    frozen weight set to 0.5 first, as a model built from other base weights) the ``exclude_frozen_parameters`` one:
    a strict load is refused naming ``load_module_strict=False`` and changes nothing; with it, the trained state is
    the saved one and the frozen weight keeps the model's value."""
    world, workdir = context["world"], context["workdir"]
    engine = _frozen_engine(world, 3, zero_init=True)
    engine.load_checkpoint(os.path.join(workdir, "frozen_init"))
    out["frozen_init"] = {"loaded": _frozen_weight(engine), "state": consolidated_state(engine)}
    _fill_frozen(engine, 0.5)
    excluded = os.path.join(workdir, "frozen_excluded")
    refused = _error(lambda: engine.load_checkpoint(excluded))
    unchanged = {"state": consolidated_state(engine), "frozen": _frozen_weight(engine)}
    engine.load_checkpoint(excluded, load_module_strict=False)
    out["frozen_excluded"] = {"refused": refused, "unchanged": unchanged, "state": consolidated_state(engine),
                              "frozen": _frozen_weight(engine), "steps": engine.global_steps,
                              "loss": train_steps(engine, RUN, STEPS_BEFORE + 1, 1)[0]}


def stage3_dp2(rank, world, workdir):
    out: dict = {}
    run_phases(out, {"world": world, "workdir": workdir}, *(_train_save(case) for case in CASES), _stage2_save,
               _frozen_save, _frozen_init_save)
    _save_result(os.path.join(workdir, f"stage3_dp{world}.pt"), out)
    dist.barrier()


def stage3_resume(rank, world, workdir):
    out: dict = {}
    # Offloaded checkpoints load offloaded at DP=3 and without offload at DP=1; one saved without offload loads
    # offloaded at DP=3.
    phases = [_resume(case, offload=world != 1 or case not in OFFLOADED) for case in CASES]
    phases += [_frozen_resume, _unfrozen_module_only, _frozen_init_resume]
    if world == 1:
        phases.append(_resume(OFFLOADED_AT_DP1, name=f"{OFFLOADED_AT_DP1}_offloaded"))
    if world == 3:
        phases += [_resume("adam8bit", offload="optimizer", name="adam8bit_offloaded"), _across_stages, _module_only,
                   _reshaped]
    run_phases(out, {"world": world, "workdir": workdir}, *phases)
    out["partitions"] = _partition_sizes(stage3_engine(world, "adam8bit"))
    _save_result(os.path.join(workdir, f"stage3_dp{world}.pt"), out)


__all__ = ["CASES", "stage3_dp2", "stage3_resume", "torch"]
