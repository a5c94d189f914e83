"""ZeRO stage 3 through the Hugging Face front doors: phases of the ``hf_dp2`` / ``hf_dp3`` launches
(``hf_scenarios``), run by ``scenarios.run_phases`` after everything at stages 1/2.

* Trainer under ``zero_bnb.enable()`` with a stage-3 JSON of ``"auto"`` values, the model built under
  ``deepspeed.zero.Init`` (after ``TrainingArguments``, as ``from_pretrained`` would), ``optim="adamw_bnb_8bit"``:
  8 steps at DP=2 saving at 4 with ``stage3_gather_16bit_weights_on_model_save: true`` (Trainer's
  ``model.safetensors`` is the gathered 16-bit model); resumed at DP=3 from step 4 with the optimizer and the
  parameters offloaded to the CPU (Accelerate would swap the optimizer for DeepSpeedCPUAdam without zero_bnb) and the
  gather left ``"auto"`` (Accelerate fills false: Trainer then saves the full checkpoint only).
* Accelerate (``DeepSpeedPlugin`` at stage 3, ``"auto"`` bucket sizes, ``zero.Init``): ``save_state`` at DP=2,
  ``load_state`` at DP=3.
* Settings zero_bnb does not support at stage 3, set through Trainer's JSON: refused by name.
* ``engine.save_16bit_model`` of a bf16 stage-3 engine: the masters cast to bf16; with the gather off it
  writes nothing and returns False, as DeepSpeed does.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from hf_scenarios import (GLOBAL_BATCH, MICRO, Z3_EMBD, Captured, _accelerate_steps, _losses, _trainer, ds_config,
                          tiny_gpt2)

from scenarios import _error
from stage3_scenarios import ds_view

import zero_bnb

#: The keys Trainer and Accelerate fill from the model's hidden size at stage 3, left "auto".
AUTO_BUCKETS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


#: Optimizer and parameter offload to the CPU at stage 3.
OFFLOAD_ALL = {"offload_optimizer": {"device": "cpu", "pin_memory": True}, "offload_param": {"device": "cpu"}}


def z3_config(gather="auto", *, offload: bool = False, **extra) -> dict:
    """A stage-3 DeepSpeed JSON with Trainer's ``"auto"`` values (``stage3_gather_16bit_weights_on_model_save``:
    ``gather``), with :data:`OFFLOAD_ALL` when ``offload``."""
    zero = {"stage": 3, **dict.fromkeys(AUTO_BUCKETS, "auto"), "stage3_gather_16bit_weights_on_model_save": gather,
            **(OFFLOAD_ALL if offload else {})}
    return ds_config(zero_optimization=zero, **extra)


def _against_masters(weights: dict, masters: dict, dtype: torch.dtype) -> dict:
    """Which of the gathered ``weights`` differ from the masters (:func:`stage3_scenarios.ds_view`: DeepSpeed's
    accessor) cast to ``dtype`` (rank 0)."""
    cast = {name: entry["fp32"].to(dtype) for name, entry in masters["params"].items()}
    return {"missing": sorted(set(cast) - set(weights)), "dtypes": sorted({str(t.dtype) for t in weights.values()}),
            "different": [n for n in cast if n in weights and not torch.equal(weights[n], cast[n])],
            "checked": len(cast)}


def describe_stage3(engine) -> dict:
    """Which engine, wrapper and optimizer train, each parameter's state dtype, and the config DeepSpeed got."""
    wrapper = engine.optimizer
    base = wrapper.optimizer
    dtypes = {}
    for index in range(wrapper.num_groups):
        [param] = wrapper.group_params(index)
        state = base.state.get(wrapper.master_partition(index), {})
        dtypes[engine.param_names[param]] = str(state["state1"].dtype) if "state1" in state else None
    return {"engine": type(engine).__name__, "wrapper": type(wrapper).__name__,
            "offload": {"optimizer": bool(wrapper.offload_optimizer), "param": bool(wrapper.offload_param)},
            "stage": engine.zero_optimization_stage(), "optimizer": f"{type(base).__module__}.{type(base).__qualname__}",
            "state1_dtypes": dtypes, "zero_config": {k: engine.config["zero_optimization"].get(k) for k in
                                                     (*AUTO_BUCKETS, "stage3_gather_16bit_weights_on_model_save")}}


def _state_callback(save_step: int | None):
    """A Trainer callback keeping the optimizer state (:func:`stage3_scenarios.ds_view`: DeepSpeed's accessors and
    bitsandbytes' dequantization, no zero_bnb code) at the save of ``save_step`` (``None``: at ``on_train_begin``,
    which Trainer calls after a resume's load). Every rank runs callbacks: collective is fine."""
    from transformers import TrainerCallback

    class StateAt(TrainerCallback):
        trainer = None
        state = None

        def on_save(self, args, state, control, **kwargs):
            if save_step is not None and state.global_step == save_step:
                self.state = ds_view(self.trainer.model_wrapped)

        def on_train_begin(self, args, state, control, **kwargs):
            if save_step is None:
                self.state = ds_view(self.trainer.model_wrapped)

    return StateAt()


def _trainer_z3(workdir, world, *, name, gather, save_step=None, resume_from=None, offload=False) -> dict:
    callback = _state_callback(save_step)
    with zero_bnb.enabled(), Captured("transformers") as log:
        trainer = _trainer(workdir, world, name=name, config=z3_config(gather, offload=offload), stage3=True,
                           callbacks=[callback])
        callback.trainer = trainer
        built_partitioned = all(hasattr(p, "ds_id") for p in trainer.model.parameters())
        trainer.train(resume_from_checkpoint=resume_from)
    engine = trainer.model_wrapped
    out = {"losses": _losses(trainer), "state": callback.state, "built_under_zero_init": built_partitioned,
           "trainer_log": [m for m in log.messages if "stage3_gather_16bit_weights_on_model_save" in m],
           **describe_stage3(engine)}
    folder = os.path.join(workdir, "z3_16bit_" + name)
    out["save_16bit_model"] = engine.save_16bit_model(folder)
    out["save_16bit_model_wrote"] = os.path.exists(os.path.join(folder, "pytorch_model.bin"))
    return out


def trainer_z3_save(context, out):
    """Trainer at stage 3, DP=2: 8 steps, saving at 4 and 8, the gathered 16-bit model saved by Trainer."""
    out["z3_trainer"] = _trainer_z3(context["workdir"], context["world"], name="z3", gather=True, save_step=4)
    gc.collect()  # the Trainer's DeepSpeed config (a process-wide weak reference) goes with it


def trainer_z3_resume(context, out):
    """The DP=2 Trainer checkpoint resumed at DP=3, accumulation 3 -> 2, offloaded, the gather left "auto"."""
    workdir, world = context["workdir"], context["world"]
    out["z3_trainer"] = _trainer_z3(workdir, world, name="z3_resumed", gather="auto", offload=True,
                                    resume_from=os.path.join(workdir, "z3", "checkpoint-4"))
    gc.collect()


def _accelerate_z3(context, out, *, resume: bool):
    """Accelerate's DeepSpeed plugin at stage 3 ("auto" bucket sizes), the model built under zero.Init:
    save_state after 4 steps at DP=2 (then 4 more), load_state at DP=3 and the same 4 steps."""
    import bitsandbytes as bnb
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    workdir, world = context["workdir"], context["world"]
    AcceleratorState._reset_state(reset_partial_state=False)
    config = z3_config(True, train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * world), gradient_clipping=1.0)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = tiny_gpt2(n_embd=Z3_EMBD, from_config=True)  # under zero.Init: the plugin's config is alive
    built_partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=3e-3)
    with zero_bnb.enabled():
        model, optimizer = accelerator.prepare(model, optimizer)
    folder = os.path.join(workdir, "accelerate_z3_state")
    result = {"built_under_zero_init": built_partitioned}
    if resume:
        accelerator.load_state(folder)
        result["state"] = ds_view(model)
        result["global_steps"] = model.global_steps
        result["losses"] = _accelerate_steps(accelerator, model, optimizer, 4, 4)
    else:
        result["losses"] = _accelerate_steps(accelerator, model, optimizer, 0, 4)
        accelerator.save_state(folder)
        result["state"] = ds_view(model)
        result["losses"] += _accelerate_steps(accelerator, model, optimizer, 4, 4)
    # Accelerate's own way to the whole model (the 16-bit gather), at this DP size, against the masters
    gathered, masters = accelerator.get_state_dict(model), ds_view(model)
    if dist.get_rank() == 0:
        result["gathered"] = _against_masters(gathered, masters, torch.float32)
    out["z3_accelerate"] = {**result, **describe_stage3(model)}
    del accelerator, model, optimizer
    AcceleratorState._reset_state(reset_partial_state=False)
    gc.collect()


def refusals_z3(context, out):
    """Stage-3 settings zero_bnb does not support, set through Trainer's JSON: refused by name before DeepSpeed
    starts (after the model was built under zero.Init)."""
    zero = {"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "zero_hpz_partition_size": 2}
    config = z3_config(True)
    config["zero_optimization"].update(zero)
    with zero_bnb.enabled():
        out["z3_trainer_refused"] = _error(lambda: _trainer(context["workdir"], context["world"], name="z3_refused",
                                                            config=config, stage3=True).train())
    gc.collect()


def accelerate_z3_save(context, out):
    _accelerate_z3(context, out, resume=False)


def accelerate_z3_resume(context, out):
    _accelerate_z3(context, out, resume=True)


def save_16bit_model_bf16(context, out):
    """``engine.save_16bit_model`` of a bf16 toy engine at stage 3 (after 2 steps) against its masters cast to
    bf16; the same engine's config with the gather off writes nothing and returns False."""
    import bitsandbytes as bnb
    from stage3_scenarios import stage3_config

    from zero_bnb.testing.toy import DEFAULT_RUN, LEARNING_RATE, build_model, param_groups, train_steps

    workdir, world = context["workdir"], context["world"]
    result = {}
    for gather in (True, False):
        config = stage3_config(world, bf16={"enabled": True},
                               zero_optimization={"stage3_gather_16bit_weights_on_model_save": gather})
        model = build_model()
        engine, *_ = zero_bnb.initialize(model=model, optimizer=bnb.optim.Adam8bit(param_groups(model),
                                                                                   lr=LEARNING_RATE), config=config)
        train_steps(engine, DEFAULT_RUN, 0, 2)
        folder = os.path.join(workdir, f"z3_16bit_bf16_{gather}")
        saved = engine.save_16bit_model(folder, "weights.bin")
        masters = ds_view(engine)
        dist.barrier()
        path = os.path.join(folder, "weights.bin")
        entry = {"returned": saved, "exists": os.path.exists(path)}
        if dist.get_rank() == 0 and entry["exists"]:
            entry.update(_against_masters(torch.load(path, weights_only=True), masters, torch.bfloat16))
        result[gather] = entry
    out["z3_16bit_bf16"] = result


__all__ = ["OFFLOAD_ALL", "accelerate_z3_resume", "accelerate_z3_save", "describe_stage3", "refusals_z3", "save_16bit_model_bf16", "trainer_z3_resume",
           "trainer_z3_save", "z3_config"]
