"""A small deterministic model, data stream and training loop for the demo and the tests.

The model has three parameter groups chosen to exercise the layout: a large one with 8-bit
state at every DP size up to 8, a tiny one (biases) that always has fp32 state, and one
that crosses bitsandbytes' ``min_8bit_size`` between DP=2 and DP=3. No group size is a
multiple of 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_RUN", "LEARNING_RATE", "ToyRun", "build_engine", "build_model", "global_batch", "param_groups", "train_steps"]

IN_FEATURES = 60


def build_model(seed: int = 0) -> torch.nn.Module:
    """The toy MLP, initialised identically on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 160),
        torch.nn.GELU(),
        torch.nn.Linear(160, 96),
        torch.nn.GELU(),
        torch.nn.Linear(96, 90),
    )


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Three groups with different weight decay (see the module docstring)."""
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    return [
        {"params": [layers[0].weight, layers[1].weight], "weight_decay": 0.1},
        {"params": [layer.bias for layer in layers], "weight_decay": 0.0},
        {"params": [layers[2].weight], "weight_decay": 0.01},
    ]


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch for ``step`` at every DP size: inputs and regression targets."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(size, IN_FEATURES, generator=generator)
    targets = torch.sin(inputs[:, :30].repeat(1, 3)) + 0.1 * torch.randn(size, 90, generator=generator)
    return inputs, targets


@dataclass(frozen=True, slots=True)
class ToyRun:
    """Batch geometry: ``global_batch_size = micro_batch * grad_accum * dp``."""

    global_batch_size: int
    micro_batch: int

    def grad_accum(self, dp: int) -> int:
        per_rank, remainder = divmod(self.global_batch_size, self.micro_batch * dp)
        if remainder or per_rank == 0:
            raise ValueError(
                f"global batch {self.global_batch_size} is not divisible by micro batch {self.micro_batch} x DP {dp}"
            )
        return per_rank

    def ds_config(self, dp: int, **extra) -> dict:
        """A DeepSpeed ZeRO-1 config keeping the global batch fixed at DP size ``dp``."""
        return {
            "train_batch_size": self.global_batch_size,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum(dp),
            "zero_optimization": {"stage": 1},
            "steps_per_print": 10**9,
            **extra,
        }


def train_steps(engine, run: ToyRun, first_step: int, count: int) -> list[float]:
    """Train ``count`` optimizer steps from global step ``first_step``; returns each step's global mean loss.

    Collective: every rank of the data-parallel group must call it.
    """
    dp, rank = dist.get_world_size(), dist.get_rank()
    accum = run.grad_accum(dp)
    dtype = next(engine.module.parameters()).dtype  # fp32, or bf16/fp16 under mixed precision
    # The sum crosses ranks where the process group can reduce it: on the CPU for gloo, on the device for nccl.
    where = "cpu" if dist.get_backend() == "gloo" else engine.device
    losses = []
    for step in range(first_step, first_step + count):
        inputs, targets = (t.to(dtype) for t in global_batch(step, run.global_batch_size))
        total = torch.zeros((), device=where)
        for micro in range(accum):
            start = (micro * dp + rank) * run.micro_batch
            rows = slice(start, start + run.micro_batch)
            loss = torch.nn.functional.mse_loss(engine(inputs[rows].to(engine.device)), targets[rows].to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().to(where)
        dist.all_reduce(total)
        losses.append(total.item() / (accum * dp))
    return losses


DEFAULT_RUN = ToyRun(global_batch_size=24, micro_batch=2)
LEARNING_RATE = 1e-2


def build_engine(dp: int, optimizer_cls: type, run: ToyRun = DEFAULT_RUN, *, lr: float = LEARNING_RATE, **config):
    """The toy model and ``optimizer_cls`` (learning rate ``lr``) under ``zero_bnb.initialize`` at DP size ``dp``.

    ``config`` adds top-level DeepSpeed config keys. Collective: every rank must call it.
    """
    import zero_bnb

    model = build_model()
    optimizer = optimizer_cls(param_groups(model), lr=lr)
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=run.ds_config(dp, **config))
    return engine
