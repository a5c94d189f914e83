"""Multi-process scenarios for ``strategy="deepspeed_zero_bnb_stage_1"`` (real Lightning, gloo, CPU)."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from scenarios import _error, run_phases

from zero_bnb.testing.toy import DEFAULT_RUN, LEARNING_RATE, build_model, global_batch

MICRO, GLOBAL_BATCH, STEPS_PER_EPOCH = DEFAULT_RUN.micro_batch, 12, 4

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def _module(*, sharded: bool = False):
    """The toy model as a LightningModule; ``sharded`` builds it in ``configure_model`` (under ``deepspeed.zero.Init``
    at ZeRO stage 3, as Lightning documents for large models)."""
    import bitsandbytes as bnb
    import lightning.pytorch as pl

    class ToyModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None if sharded else build_model()
            self.micro_losses = []

        def configure_model(self):
            if self.model is None:
                self.model = build_model()
                self.built_under_zero_init = all(hasattr(p, "ds_id") for p in self.model.parameters())

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            loss = torch.nn.functional.mse_loss(self.model(inputs), targets)
            self.micro_losses.append(loss.detach().float())
            return loss

        def configure_optimizers(self):
            return bnb.optim.Adam8bit(self.parameters(), lr=LEARNING_RATE)

    return ToyModule()


def _loader():
    inputs, targets = global_batch(0, GLOBAL_BATCH * STEPS_PER_EPOCH)
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    return torch.utils.data.DataLoader(dataset, batch_size=MICRO, shuffle=False)


#: pl.Trainer arguments that keep a test run quiet and writing nothing of its own.
QUIET = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)


def _fit(world, epochs, *, ckpt_path=None, strategy="deepspeed_zero_bnb_stage_1", accum=None, max_steps=-1,
         sharded=False, callbacks=None):
    import lightning.pytorch as pl

    import zero_bnb.lightning  # noqa: F401 - registers the strategy names

    accum = accum or GLOBAL_BATCH // (MICRO * world)
    module = _module(sharded=sharded)
    trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_epochs=epochs,
                         max_steps=max_steps, accumulate_grad_batches=accum, callbacks=callbacks, **QUIET)
    trainer.fit(module, train_dataloaders=_loader(), ckpt_path=ckpt_path)
    return trainer, module, _step_losses(module.micro_losses, accum, world)


def _readme_fit(world, epochs, part, checkpoint):
    """The README's Lightning example (set-up + ``part``), extracted from README.md, on CPU with the toy module."""
    from readme_examples import adapt, block, run, segment, segments

    parts = segments(block("Lightning"))
    code = adapt(parts["setup"] + segment(parts, part), {
        'accelerator="gpu"': 'accelerator="cpu"',
        "WORLD_SIZE = 2   #": f"WORLD_SIZE = {world}   #",  # the README's first run has 2 processes, its resume 3
        "accumulate_grad_batches=12 // (2 * WORLD_SIZE))": "accumulate_grad_batches=12 // (2 * WORLD_SIZE), "
                                                          f"max_epochs={epochs}, **QUIET)",
        '"run.ckpt"': repr(checkpoint),
    })
    namespace = run(code, {"module": _module(), "loader": _loader(), "WORLD_SIZE": world, "QUIET": QUIET},
                    os.path.dirname(checkpoint))
    accum = GLOBAL_BATCH // (MICRO * world)
    return namespace["trainer"], _step_losses(namespace["module"].micro_losses, accum, world)


class _Warnings(logging.Handler):
    """zero_bnb's warnings while a block runs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("zero_bnb").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("zero_bnb").removeHandler(self)


def _step_losses(micro_losses, accum, world):
    """Global mean loss of each optimizer step from every rank's micro-batch losses."""
    local = torch.stack(micro_losses) if micro_losses else torch.zeros(0)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    per_rank = torch.stack(gathered).reshape(world, -1, accum)
    return per_rank.mean(dim=(0, 2)).tolist()


def _optimizer_facts(trainer) -> dict:
    """Which optimizer steps, where, and with what state (the user's bitsandbytes one, 8-bit, on the CPU)."""
    wrapper = trainer.strategy.model.optimizer
    base = wrapper.optimizer
    state = base.state.get(wrapper.master_partition(0), {})
    return {"optimizer": f"{type(base).__module__}.{type(base).__qualname__}", "cpu_offload": wrapper.cpu_offload,
            "state1": str(state["state1"].dtype) if "state1" in state else None}


def _stage3_state_callback(save_to: str | None = None):
    """At stage 3: the optimizer state (:func:`stage3_scenarios.ds_view`: DeepSpeed's accessors and bitsandbytes'
    dequantization, no zero_bnb code) when the first epoch ends, after ``trainer.save_checkpoint(save_to)``
    there (``save_to``), or when training starts (after a resume's load; ``None``). Collective: every rank runs it."""
    import lightning.pytorch as pl

    from stage3_scenarios import ds_view

    class StateAt(pl.Callback):
        state = None

        def on_train_epoch_end(self, trainer, module):
            if save_to is not None and trainer.current_epoch == 0:
                trainer.save_checkpoint(save_to)
                self.state = ds_view(trainer.strategy.model)

        def on_train_start(self, trainer, module):
            if save_to is None:
                self.state = ds_view(trainer.strategy.model)

    return StateAt()


def _stage3_facts(trainer) -> dict:
    engine = trainer.strategy.model
    wrapper = engine.optimizer
    base = wrapper.optimizer
    states = [base.state.get(wrapper.master_partition(index), {}) for index in range(wrapper.num_groups)]
    return {"engine": type(engine).__name__, "stage": engine.zero_optimization_stage(),
            "offload": {"optimizer": bool(wrapper.offload_optimizer), "param": bool(wrapper.offload_param)},
            "wrapper": type(wrapper).__name__, "optimizer": f"{type(base).__module__}.{type(base).__qualname__}",
            "state1": sorted({str(state["state1"].dtype) for state in states if "state1" in state})}


def _stage3_fit(context, out, *, resume: bool, offload: bool = True, key: str = "stage3"):
    """``"deepspeed_zero_bnb_stage_3"``, the model built in configure_model: 2 epochs at DP=2, saved when the first
    ends; at DP=3 (accumulation 3 -> 2) the second epoch from that checkpoint, with ``"deepspeed_zero_bnb_stage_3_offload"``
    (optimizer and parameters offloaded to the CPU), or without offload (``offload=False``)."""
    world, path = context["world"], os.path.join(context["workdir"], "stage3.ckpt")
    callback = _stage3_state_callback(None if resume else path)
    strategy = "deepspeed_zero_bnb_stage_3_offload" if resume and offload else "deepspeed_zero_bnb_stage_3"
    trainer, module, losses = _fit(world, 2, strategy=strategy, sharded=True, callbacks=[callback],
                                   ckpt_path=path if resume else None)
    out[key] = {"losses": losses, "state": callback.state, "global_step": trainer.global_step,
                "built_under_zero_init": getattr(module, "built_under_zero_init", False), **_stage3_facts(trainer)}


def stage3_save(context, out):
    _stage3_fit(context, out, resume=False)


def stage3_resume(context, out):
    _stage3_fit(context, out, resume=True)


def stage3_resume_without_offload(context, out):
    """The same resume as ``stage3_resume`` with nothing offloaded: docs/front-doors.md says their losses are equal."""
    _stage3_fit(context, out, resume=True, offload=False, key="stage3_no_offload")


def stage3_refusals(context, out):
    """A Lightning DeepSpeed option zero_bnb does not support at stage 3, refused by name when the engine is built."""
    from zero_bnb.integrations.lightning import ZeroBnbStrategy

    out["stage3_refused_reduce_scatter"] = _error(lambda: _fit(
        context["world"], 1, strategy=ZeroBnbStrategy(stage=3, reduce_scatter=False), sharded=True, max_steps=1))


def lightning_dp2(rank, world, workdir):
    """The README's example for 2 epochs (the uninterrupted run); a fresh run of 1 epoch with the optimizer offloaded
    to the CPU, saved with trainer.save_checkpoint (resumed by the README's example, without offload, at DP=3); 1 epoch
    with the stage-2 strategy; a run stopped after 1 optimizer step (mid-epoch: 3 micro-batches per process), saved."""
    out = {}
    trainer, out["uninterrupted"] = _readme_fit(world, 2, "# first run", os.path.join(workdir, "readme_run.ckpt"))
    out["strategy"] = type(trainer.strategy).__name__
    out["engine"] = type(trainer.strategy.model).__name__
    out["optimizer"] = _optimizer_facts(trainer)
    trainer, _, out["first_epoch"] = _fit(world, 1, strategy="deepspeed_zero_bnb_stage_1_offload")
    out["offloaded_optimizer"] = _optimizer_facts(trainer)
    trainer.save_checkpoint(os.path.join(workdir, "lightning.ckpt"))
    trainer, _, out["stage2_first_epoch"] = _fit(world, 1, strategy="deepspeed_zero_bnb_stage_2")
    out["stage2"] = (type(trainer.strategy.model).__name__, trainer.strategy.model.zero_optimization_stage(),
                     type(trainer.strategy.model.optimizer).__name__)
    trainer, _, _ = _fit(world, 1, max_steps=1)
    trainer.save_checkpoint(os.path.join(workdir, "mid_epoch.ckpt"))
    run_phases(out, {"world": world, "workdir": workdir}, stage3_save, stage3_refusals)
    if rank == 0:
        torch.save(out, os.path.join(workdir, "lightning_dp2.pt"))


def lightning_dp3(rank, world, workdir):
    """The README's resume of the 1-epoch checkpoint for the second epoch, accumulation 3 -> 2 (global batch
    kept); the mid-epoch checkpoint resumed for one step with accumulation 3 (global batch 12 -> 18)."""
    out = {}
    trainer, out["resumed"] = _readme_fit(world, 2, "# later", os.path.join(workdir, "lightning.ckpt"))
    out["global_step"] = trainer.global_step
    with _Warnings() as warnings:
        _fit(world, 1, ckpt_path=os.path.join(workdir, "mid_epoch.ckpt"), accum=3, max_steps=2)
    out["mid_epoch_warnings"] = warnings.messages
    run_phases(out, {"world": world, "workdir": workdir}, stage3_resume, stage3_resume_without_offload)
    if rank == 0:
        torch.save(out, os.path.join(workdir, "lightning_dp3.pt"))
