"""Multi-process scenarios for the Hugging Face front doors (Trainer, Accelerate): real packages, gloo, CPU.

Each function is one launch; rank 0 writes what pytest checks.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
import torch.distributed as dist

import zero_bnb

VOCAB, SEQ, SAMPLES = 96, 16, 240
MICRO = 2
GLOBAL_BATCH = 12


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    """Deterministic token sequences (a noisy counting pattern), the same in every process."""

    def __init__(self, count: int = SAMPLES):
        generator = torch.Generator().manual_seed(7)
        starts = torch.randint(0, VOCAB, (count, 1), generator=generator)
        steps = torch.randint(1, 4, (count, 1), generator=generator)
        self.ids = (starts + steps * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def ds_config(**extra) -> dict:
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        **extra,
    }


def _trainer(workdir, world, *, optim="adamw_bnb_8bit", max_steps=8, config=None, accum=None):
    from transformers import Trainer, TrainingArguments

    accum = accum or GLOBAL_BATCH // (MICRO * world)
    args = TrainingArguments(
        output_dir=os.path.join(workdir, "out"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=accum,
        max_steps=max_steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        optim=optim,
        deepspeed=config or ds_config(),
        use_cpu=True,
        logging_steps=1,
        save_steps=4,
        save_strategy="steps",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData())


def _losses(trainer):
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def trainer_train(rank, world, workdir, resume):
    """Trainer + adamw_bnb_8bit under zero_bnb.enable(): train 8 steps (saving at 4), or resume from step 4."""
    zero_bnb.enable()
    try:
        trainer = _trainer(workdir, world)
        checkpoint = os.path.join(workdir, "out", "checkpoint-4") if resume else None
        trainer.train(resume_from_checkpoint=checkpoint)
        engine = trainer.model_wrapped
        out = {"losses": _losses(trainer), "engine": type(engine).__name__,
               "groups": [[engine.param_names[p] for p in group] for group in engine.optimizer.bit16_groups],
               "state_dtypes": [str(v.get("state1", torch.empty(0)).dtype) for v in engine.optimizer.optimizer.state.values()]}
    finally:
        zero_bnb.disable()
    if rank == 0:
        torch.save(out, os.path.join(workdir, f"trainer_{'resume' if resume else 'train'}_dp{world}.pt"))


def _global_batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return TokenData().ids[torch.randperm(SAMPLES, generator=generator)[:GLOBAL_BATCH]]


def _accelerate_steps(accelerator, model, optimizer, first: int, count: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = GLOBAL_BATCH // (MICRO * world)
    losses = []
    for step in range(first, first + count):
        ids = _global_batch(step)
        total = torch.zeros(())
        for micro in range(accum):
            rows = ids[(micro * world + rank) * MICRO:(micro * world + rank + 1) * MICRO]
            with accelerator.accumulate(model):  # DeepSpeed steps only where Accelerate syncs gradients
                loss = model(input_ids=rows, labels=rows).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (accum * world))
    return losses


def accelerate_run(rank, world, workdir, resume):
    """Accelerate without Trainer: prepare inside ``with zero_bnb.enabled()``, save_state / load_state."""
    import bitsandbytes as bnb
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(reset_partial_state=False)  # a Trainer may have run in this process
    config = ds_config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * world), gradient_clipping=1.0)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = tiny_gpt2()
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=3e-3)
    with zero_bnb.enabled():
        model, optimizer = accelerator.prepare(model, optimizer)
    out = {"engine": type(model).__name__, "enabled_after": zero_bnb.is_enabled()}
    folder = os.path.join(workdir, "accelerate_state")
    if resume:
        accelerator.load_state(folder)
        out["losses"] = _accelerate_steps(accelerator, model, optimizer, 4, 4)
        out["global_steps"] = model.global_steps
    else:
        out["losses"] = _accelerate_steps(accelerator, model, optimizer, 0, 4)
        accelerator.save_state(folder)
        out["losses"] += _accelerate_steps(accelerator, model, optimizer, 4, 4)
    if rank == 0:
        torch.save(out, os.path.join(workdir, f"accelerate_{'resume' if resume else 'train'}_dp{world}.pt"))
