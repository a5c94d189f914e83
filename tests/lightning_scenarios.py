"""Multi-process scenarios for ``strategy="deepspeed_zero_bnb_stage_1"`` (real Lightning, gloo, CPU)."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from zero_bnb.testing.toy import DEFAULT_RUN, LEARNING_RATE, build_model, global_batch

MICRO, GLOBAL_BATCH, STEPS_PER_EPOCH = DEFAULT_RUN.micro_batch, 12, 4

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def _module(strategy_accum_holder=None):
    import bitsandbytes as bnb
    import lightning.pytorch as pl

    class ToyModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model()
            self.micro_losses = []

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


def _fit(world, epochs, *, ckpt_path=None, strategy="deepspeed_zero_bnb_stage_1"):
    import lightning.pytorch as pl

    import zero_bnb.lightning  # noqa: F401 - registers the strategy names

    accum = GLOBAL_BATCH // (MICRO * world)
    module = _module()
    trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_epochs=epochs,
                         accumulate_grad_batches=accum, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=_loader(), ckpt_path=ckpt_path)
    return trainer, module, _step_losses(module.micro_losses, accum, world)


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


def lightning_dp2(rank, world, workdir):
    """Uninterrupted 2 epochs; then a fresh run of 1 epoch with the optimizer offloaded to the CPU, saved with
    trainer.save_checkpoint (resumed without offload at DP=3)."""
    out = {}
    trainer, _, out["uninterrupted"] = _fit(world, 2)
    out["strategy"] = type(trainer.strategy).__name__
    out["engine"] = type(trainer.strategy.model).__name__
    out["optimizer"] = _optimizer_facts(trainer)
    trainer, _, out["first_epoch"] = _fit(world, 1, strategy="deepspeed_zero_bnb_stage_1_offload")
    out["offloaded_optimizer"] = _optimizer_facts(trainer)
    trainer.save_checkpoint(os.path.join(workdir, "lightning.ckpt"))
    if rank == 0:
        torch.save(out, os.path.join(workdir, "lightning_dp2.pt"))


def lightning_dp3(rank, world, workdir):
    """Resume the 1-epoch checkpoint for the second epoch, accumulation 3 -> 2 (global batch kept)."""
    out = {}
    trainer, _, out["resumed"] = _fit(world, 2, ckpt_path=os.path.join(workdir, "lightning.ckpt"))
    out["global_step"] = trainer.global_step
    if rank == 0:
        torch.save(out, os.path.join(workdir, "lightning_dp3.pt"))
