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

import numpy
import torch

__all__ = ["CHUNK", "Residual", "join_bf16", "rounds_to", "split_bf16", "split_rounded_bf16"]

#: Elements processed at once (the temporaries stay in the cache).
CHUNK = 1 << 18
_HALF = 0x8000
#: ``0x8000`` as an int16: the bottom half of a tie, the one element whose carry :func:`join_bf16` cannot tell.
_TIE = _HALF - 0x10000


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


def _join_chunk(out: torch.Tensor, weight16: torch.Tensor, low16: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``out`` (int32) = the master bits that ``weight16`` and ``low16`` give when no tie carried (see
    :func:`join_bf16`); ``scratch`` is an int32 buffer of the same length. Returns ``out``."""
    out.copy_(weight16).bitwise_left_shift_(16)
    scratch.copy_(low16).add_(_HALF - 1).bitwise_and_(0xFFFF).sub_(_HALF - 1)
    return out.add_(scratch)


def _check(master: torch.Tensor, weight: torch.Tensor) -> None:
    if master.dtype != torch.float32 or weight.dtype != torch.bfloat16 or master.shape != weight.shape \
            or master.dim() != 1:
        raise ValueError(f"expected two 1-D tensors of one length, float32 and bfloat16; got {master.dtype} "
                         f"{tuple(master.shape)} and {weight.dtype} {tuple(weight.shape)}")


def split_bf16(master: torch.Tensor, weight: torch.Tensor) -> Residual:
    """The :class:`Residual` of fp32 ``master`` beside bf16 ``weight`` (1-D, same length, CPU).

    ``join_bf16(weight, split_bf16(master, weight))`` is ``master`` bit for bit for every pair: each
    chunk is joined as :func:`join_bf16` would join it, and the elements that differ from the master
    are the exceptions. Same-dtype operations on cache-sized chunks, like :func:`join_bf16`.
    """
    _check(master, weight)
    bits = master.contiguous().view(torch.int32)
    weight_bits = weight.contiguous().view(torch.int16)
    low = _halves(bits)[0].clone()
    joined = torch.empty(min(CHUNK, bits.numel()), dtype=torch.int32)
    low32 = torch.empty_like(joined)
    differs = torch.empty(joined.numel(), dtype=torch.bool)
    index_parts = [torch.empty(0, dtype=torch.int64)]
    for start in range(0, bits.numel(), CHUNK):
        chunk = bits[start : start + CHUNK]
        end = start + chunk.numel()
        join = _join_chunk(joined[: chunk.numel()], weight_bits[start:end], low[start:end], low32[: chunk.numel()])
        wrong = torch.ne(join, chunk, out=differs[: chunk.numel()])
        if wrong.any():
            index_parts.append(torch.nonzero(wrong).flatten().add_(start))
    index = torch.cat(index_parts)
    return Residual(low, index, bits[index].view(torch.float32))


def split_rounded_bf16(master: torch.Tensor, weight: torch.Tensor) -> Residual | None:
    """:func:`split_bf16` of a ``weight`` checked, in the same pass, to be ``master``'s rounding: ``None`` where it
    is not (:func:`rounds_to` false), else the same :class:`Residual` as :func:`split_bf16`, for about a third of
    the work of both.

    Where the weight is the master's rounding, ``join_bf16`` rebuilds every element exactly except a tie (bottom
    half ``0x8000``) that carried, and a NaN (the rounding makes it canonical). So per chunk one cast and one
    comparison check the rounding and a sum that is finite rules out NaN; then only the ties are joined and
    compared. A chunk whose sum is not finite (NaN, Inf, or finite values overflowing) is compared element by
    element, as :func:`split_bf16` does.
    """
    _check(master, weight)
    values = master.contiguous()
    bits = values.view(torch.int32)
    weight_bits = weight.contiguous().view(torch.int16)
    low = torch.from_numpy(bits.numpy().astype(numpy.int16))  # the bottom halves: int32 -> int16 wraps
    rounded = torch.empty(min(CHUNK, bits.numel()), dtype=torch.bfloat16)
    index_parts, irregular = [torch.empty(0, dtype=torch.int64)], []
    for start in range(0, bits.numel(), CHUNK):
        chunk = values[start : start + CHUNK]
        end = start + chunk.numel()
        if not torch.equal(rounded[: chunk.numel()].copy_(chunk).view(torch.int16), weight_bits[start:end]):
            return None
        if not bool(torch.isfinite(chunk.sum())):
            irregular.append(start // CHUNK)
            join = _join_chunk(torch.empty(chunk.numel(), dtype=torch.int32), weight_bits[start:end], low[start:end],
                               torch.empty(chunk.numel(), dtype=torch.int32))
            index_parts.append(torch.nonzero(join != bits[start:end]).flatten().add_(start))
    ties = torch.from_numpy(numpy.flatnonzero(low.numpy() == _TIE)).to(torch.int64)
    if irregular:  # those chunks were compared whole
        ties = ties[~torch.isin(ties // CHUNK, torch.tensor(irregular, dtype=torch.int64))]
    join = _join_chunk(torch.empty(ties.numel(), dtype=torch.int32), weight_bits[ties], low[ties],
                       torch.empty(ties.numel(), dtype=torch.int32))
    index_parts.append(ties[join != bits[ties]])
    index = torch.cat(index_parts).sort().values
    return Residual(low, index, bits[index].view(torch.float32))


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
    low32 = torch.empty(min(CHUNK, weight.numel()), dtype=torch.int32)
    for start in range(0, weight.numel(), CHUNK):
        master = bits[start : start + CHUNK]
        end = start + master.numel()
        _join_chunk(master, weight_bits[start:end], residual.low[start:end], low32[: master.numel()])
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
    rounded = torch.empty(min(CHUNK, master.numel()), dtype=weight.dtype)  # reused: no page faults per chunk
    for start in range(0, master.numel(), CHUNK):
        chunk = rounded[: master[start : start + CHUNK].numel()].copy_(master[start : start + CHUNK])
        if not torch.equal(chunk.view(view), weight[start : start + CHUNK].view(view)):
            return False
    return True


if sys.byteorder != "little":  # pragma: no cover - torch supports little-endian machines only
    raise ImportError("zero_bnb.core.residual assumes a little-endian machine")
