"""fp32 master weights rebuilt exactly from the 16-bit module weights DeepSpeed rounds them to.

DeepSpeed makes a bf16 module weight by rounding its fp32 master to nearest, ties to even
(``bit16.copy_(fp32)``). In bits: ``bf16 = hi + carry``, where ``hi`` and ``lo`` are the top and
bottom 16 bits of the master and ``carry`` is 1 when ``lo > 0x8000``, 0 when ``lo < 0x8000``, and
for the tie ``lo == 0x8000`` 1 exactly when ``hi`` is odd. So the master is the bf16 weight and
its 16-bit ``lo``: ``hi = bf16 - carry``. Only the tie is ambiguous (``hi`` even with no carry and
``hi`` odd with a carry both give an even bf16): :func:`join_bf16` assumes no carry, and
:func:`split_bf16` lists every element it would rebuild wrongly (ties of odd ``hi``, about one
element in 2^17 of trained weights; NaN, which the rounding makes canonical) with its fp32 value.
The encoding round-trips every fp32 bit pattern exactly, whatever the weight: elements whose weight
is not the master's rounding are simply exceptions (:func:`rounds_to` tells the caller beforehand).

Pure functions on CPU tensors; long tensors are processed in chunks of :data:`CHUNK` elements.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

__all__ = ["CHUNK", "Residual", "join_bf16", "rounds_to", "split_bf16"]

#: Elements processed at once (bounds the temporaries).
CHUNK = 1 << 24
#: Elements :func:`join_bf16` processes at once (its temporaries stay in the cache).
_JOIN_CHUNK = 1 << 18
_HALF = 0x8000


@dataclass(frozen=True, slots=True)
class Residual:
    """What a bf16 weight needs beside it to give back its fp32 master.

    ``low`` holds the master's bottom 16 bits (int16, bit for bit); ``index`` (int64, increasing)
    and ``value`` (float32) the elements :func:`join_bf16` would otherwise rebuild wrongly.
    """

    low: torch.Tensor
    index: torch.Tensor
    value: torch.Tensor

    def part(self, start: int, end: int) -> Residual:
        """The residual of elements ``[start, end)`` (exception indices shifted to the part; ``index`` is increasing)."""
        lo, hi = torch.searchsorted(self.index, torch.tensor([start, end], dtype=self.index.dtype)).tolist()
        return Residual(self.low[start:end], self.index[lo:hi] - start, self.value[lo:hi])


def _halves(bits32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bottom and top 16 bits of each element of an int32 (or float32) tensor, as int16 views."""
    pairs = bits32.view(torch.int16)
    return pairs[0::2], pairs[1::2]  # little-endian (checked at import)


def _hi(weight16: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The master's top 16 bits that ``weight16`` and ``low`` give when no tie carried (int16, wrapping)."""
    carry = (low < 0) & (low != -_HALF)  # lo > 0x8000 as unsigned
    return weight16 - carry.to(torch.int16)


def _check(master: torch.Tensor, weight: torch.Tensor) -> None:
    if master.dtype != torch.float32 or weight.dtype != torch.bfloat16 or master.shape != weight.shape \
            or master.dim() != 1:
        raise ValueError(f"expected two 1-D tensors of one length, float32 and bfloat16; got {master.dtype} "
                         f"{tuple(master.shape)} and {weight.dtype} {tuple(weight.shape)}")


def split_bf16(master: torch.Tensor, weight: torch.Tensor) -> Residual:
    """The :class:`Residual` of fp32 ``master`` beside bf16 ``weight`` (1-D, same length, CPU).

    ``join_bf16(weight, split_bf16(master, weight))`` is ``master`` bit for bit for every pair.
    """
    _check(master, weight)
    low_all, hi_all = _halves(master.contiguous())
    weight_bits = weight.contiguous().view(torch.int16)
    low_parts, index_parts, value_parts = [], [], []
    for start in range(0, master.numel(), CHUNK):
        low, hi = low_all[start : start + CHUNK], hi_all[start : start + CHUNK]
        wrong = torch.nonzero(_hi(weight_bits[start : start + CHUNK], low) != hi).flatten()
        low_parts.append(low.clone())
        index_parts.append(wrong + start)
        value_parts.append(master[start : start + CHUNK].view(torch.int32)[wrong].view(torch.float32))
    if not low_parts:
        return Residual(torch.empty(0, dtype=torch.int16), torch.empty(0, dtype=torch.int64),
                        torch.empty(0, dtype=torch.float32))
    return Residual(torch.cat(low_parts), torch.cat(index_parts), torch.cat(value_parts))


def join_bf16(weight: torch.Tensor, residual: Residual, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 master of bf16 ``weight`` (1-D, CPU) and its :class:`Residual`, in a new tensor or into ``out``
    (1-D contiguous float32 of the same length), which is returned.

    The caller checks ``residual``'s shapes and that ``index`` lies in range (``format.masters``).
    In 32-bit integers (wrapping): ``master = (bf16 << 16) + lo - (carry << 16)``, and ``lo - (carry << 16)``
    is ``lo`` read as a signed 16-bit number, except for the tie ``lo == 0x8000`` (no carry), which
    ``((lo + 0x7FFF) & 0xFFFF) - 0x7FFF`` maps back to ``0x8000``. Same-dtype, in-place operations on
    cache-sized chunks: no mixed-dtype kernels, no temporaries beyond one chunk.
    """
    out = torch.empty(weight.numel(), dtype=torch.float32) if out is None else out
    bits = out.view(torch.int32)
    weight_bits = weight.contiguous().view(torch.int16)
    low32 = torch.empty(min(_JOIN_CHUNK, weight.numel()), dtype=torch.int32)
    for start in range(0, weight.numel(), _JOIN_CHUNK):
        master = bits[start : start + _JOIN_CHUNK]
        low = low32[: master.numel()]
        master.copy_(weight_bits[start : start + _JOIN_CHUNK]).bitwise_left_shift_(16)
        low.copy_(residual.low[start : start + _JOIN_CHUNK]).add_(_HALF - 1).bitwise_and_(0xFFFF).sub_(_HALF - 1)
        master.add_(low)
    bits[residual.index] = residual.value.view(torch.int32)
    return out


def rounds_to(master: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``weight`` is, bit for bit, ``master`` cast to ``weight``'s dtype (round to nearest even, as
    DeepSpeed's ``copy_`` makes its 16-bit weights; for fp32 weights: the same bits)."""
    if master.shape != weight.shape:
        return False
    if weight.dtype == torch.float32:
        return torch.equal(master.view(torch.int32), weight.view(torch.int32))
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[weight.element_size()]
    return all(torch.equal(master[s : s + CHUNK].to(weight.dtype).view(view), weight[s : s + CHUNK].view(view))
               for s in range(0, master.numel(), CHUNK))


if sys.byteorder != "little":  # pragma: no cover - torch supports little-endian machines only
    raise ImportError("zero_bnb.core.residual assumes a little-endian machine")
