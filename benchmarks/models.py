"""A GPT-style decoder of configurable size, and its synthetic next-token data, for the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["GPT", "PRESETS", "GPTConfig", "batch"]


@dataclass(frozen=True)
class GPTConfig:
    """Decoder shape; ``parameters`` estimates the count (embeddings tied to the output layer)."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    seq_len: int

    @property
    def parameters(self) -> int:
        per_layer = 12 * self.d_model**2 + 13 * self.d_model
        return self.vocab * self.d_model + self.seq_len * self.d_model + self.layers * per_layer + 2 * self.d_model


#: Named sizes: the CPU quick mode uses ``cpu-small``; the GPU mode runs 100M to 1.3B.
PRESETS = {
    "cpu-small": GPTConfig(vocab=8192, d_model=256, layers=4, heads=4, seq_len=128),
    "gpt-125m": GPTConfig(vocab=50304, d_model=768, layers=12, heads=12, seq_len=1024),
    "gpt-350m": GPTConfig(vocab=50304, d_model=1024, layers=24, heads=16, seq_len=1024),
    "gpt-1.3b": GPTConfig(vocab=50304, d_model=2048, layers=24, heads=16, seq_len=1024),
}


class _Block(torch.nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.ln1 = torch.nn.LayerNorm(config.d_model)
        self.qkv = torch.nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = torch.nn.Linear(config.d_model, config.d_model)
        self.ln2 = torch.nn.LayerNorm(config.d_model)
        self.fc = torch.nn.Linear(config.d_model, 4 * config.d_model)
        self.out = torch.nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """Token + position embeddings, pre-LayerNorm blocks, tied output layer; returns the LM loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(config.vocab, config.d_model)
        self.positions = torch.nn.Embedding(config.seq_len, config.d_model)
        self.blocks = torch.nn.ModuleList(_Block(config) for _ in range(config.layers))
        self.ln = torch.nn.LayerNorm(config.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tokens(inputs) + self.positions(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tokens.weight.t()
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(config: GPTConfig, size: int, step: int, rank: int, device: torch.device) -> torch.Tensor:
    """A deterministic batch of ``size`` random token sequences (``seq_len + 1`` tokens each)."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randint(0, config.vocab, (size, config.seq_len + 1), generator=generator).to(device)
