"""Block-wise 8-bit <-> fp32 conversion of optimizer state, on any device any rank holds.

Used where 8-bit state must be seen as values: a new partition size crossing bitsandbytes'
``min_8bit_size``, rescuing unaligned stock checkpoints, regrouping state by parameter name,
exporting moments and universal checkpoints, quantizing a universal checkpoint, and the
consolidated view in :mod:`zero_bnb.testing`. Dequantization is exact (``qmap[code] *
absmax[block]``, the same arithmetic as bitsandbytes' kernels) and needs torch only;
:func:`quantize` calls bitsandbytes' own ``quantize_blockwise``, imported on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zero_bnb.core.layout import ceil_div
from zero_bnb.core.state_spec import QuantizedTriple

__all__ = ["dequantize", "quantize", "state_values", "zero_code"]


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


def state_values(state: Mapping[str, Any], key: str, triple: QuantizedTriple | None, block_size: int,
                 length: int | None = None) -> torch.Tensor:
    """The fp32 values of state ``key``: 8-bit codes dequantized with their triple's absmax and map, else as float.

    ``length`` keeps only the first ``length`` entries of the last axis (and the blocks they touch).
    The one place where the 8-bit triple (codes, absmax, qmap) of a state dict is turned into values.
    """
    value = state[key]
    if length is not None:
        value = value[..., :length]
    if triple is None or key != triple.codes or value.dtype != torch.uint8:
        return value.float()
    absmax = state[triple.absmax]
    if length is not None:
        absmax = absmax[..., : ceil_div(length, block_size)]
    return dequantize(value, absmax, state[triple.qmap], block_size)
