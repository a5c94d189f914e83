"""Block-wise 8-bit <-> fp32 conversion of optimizer state, on any device any rank holds.

Used only when a new partition size crosses bitsandbytes' ``min_8bit_size`` (or to rescue
unaligned stock checkpoints): dequantization is exact (``qmap[code] * absmax[block]``, the
same arithmetic as bitsandbytes' kernels), quantization goes through bitsandbytes itself.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize", "quantize", "zero_code"]


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 values of 8-bit ``codes`` whose block ``k`` (along the last axis) is scaled by ``absmax[..., k]``."""
    n = codes.shape[-1] if codes.dim() else 0
    blocks = -(-n // block_size)
    if absmax.shape[-1:] != (blocks,) or absmax.shape[:-1] != codes.shape[:-1]:
        raise ValueError(
            f"codes of shape {tuple(codes.shape)} in blocks of {block_size} need absmax of shape "
            f"{(*codes.shape[:-1], blocks)}, got {tuple(absmax.shape)}"
        )
    scale = absmax.to(torch.float32).repeat_interleave(block_size, dim=-1)[..., :n]
    return qmap.to(torch.float32)[codes.long()] * scale


def quantize(values: torch.Tensor, qmap: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes and per-block absmax of fp32 ``values`` (blocks along the last axis), as bitsandbytes quantizes them."""
    import bitsandbytes.functional as bnb_functional

    if values.dim() > 1:  # each leading row is its own stream of blocks (AdEMAMix's two moments)
        rows = [quantize(row, qmap, block_size) for row in values.reshape(-1, values.shape[-1])]
        lead = values.shape[:-1]
        return (torch.stack([c for c, _ in rows]).reshape(*lead, -1),
                torch.stack([a for _, a in rows]).reshape(*lead, -1))
    codes, state = bnb_functional.quantize_blockwise(
        values.to(torch.float32).contiguous(), code=qmap.to(values.device), blocksize=block_size
    )
    return codes, state.absmax.to(torch.float32)


def zero_code(qmap: torch.Tensor) -> int:
    """The code whose value is exactly 0 (what padding elements hold), for any block scale."""
    index = int(torch.argmin(qmap.abs()))
    if qmap[index].item() != 0.0:
        raise ValueError(
            f"quantization map has no exact zero (closest value {qmap[index].item()!r} at code {index}); "
            f"padding cannot be represented, so this map is not supported"
        )
    return index
