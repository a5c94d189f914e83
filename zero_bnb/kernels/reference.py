"""Plain-torch reference of bitsandbytes' CUDA blockwise 8-bit optimizer update: what users get on a GPU.

Written once, from bitsandbytes ``csrc/kernels.cu`` (commit 95f9af309d4d5793847169c39288dcd3fcbdf564;
line numbers below refer to it):

- ``quantize_2D`` (lines 221-266): the code is found by a 7-step binary search over the sorted 256-entry
  map starting at pivot 127, with the search bounds starting at ``-1``/``0`` (signed/unsigned) and ``1`` (not
  at ``qmap[0]``/``qmap[255]``); the result is the pivot, or its lower/upper neighbour when ``x`` lies
  strictly beyond the midpoint towards it. **Ties** (``x`` exactly on a midpoint) keep the pivot reached by
  the search, which is the upper code of the pair on the "below" side and the lower one on the "above" side.
- ``kOptimizerStatic8bit2StateBlockwise`` (lines 914-1148, Adam and AdEMAMix): a gradient that is NaN or
  Inf zeroes all moments of its element and leaves its parameter untouched (lines 1017, 1092); the new
  ``absmax`` of a block is the ``fmaxf`` of the ``|moments|`` (NaN ignored, ``-FLT_MAX`` when a block holds
  only NaN, line 1043); the parameter moves by ``step_size * m / (sqrt(v) + correction2 * eps)`` (``eps``
  scaled by the bias correction, line 1100) and *then* decays by ``1 - lr * weight_decay`` (line 1103);
  AdEMAMix moves by ``lr * (m1 / c1 + alpha * m2) / (sqrt(v) / c2 + eps)`` (line 1096), its slow moment
  (``state1[1]``) quantized with ``qmap1``. Moments are divided by the new ``absmax`` and quantized; a
  signed code whose map value has the other sign than the moment is moved one step towards the moment
  (the state-1 sign fix, lines 1120, 1131). A NaN moment ends the search at code 0 and, its sign bit being
  clear (the GPU's canonical NaN), the sign fix moves it to code 255 (unsigned char arithmetic): next step
  it dequantizes to ``+absmax``.
- ``kOptimizerStatic8bit1StateBlockwise`` (lines 1153-1322: momentum, Lion, RMSprop, Adagrad): weight
  decay is added to the gradient (momentum, RMSprop, Adagrad) or multiplies the parameter first (Lion,
  line 1233); momentum takes the gradient itself at step 1 (line 1243); RMSprop and Adagrad move the
  parameter with the *raw* gradient (lines 1291, 1295: the decayed one only feeds the state); a NaN/Inf
  gradient is not special-cased: a NaN poisons its element (parameter NaN except for Lion, whose ``sgn`` of
  NaN is 0; ``fmaxf`` keeps it out of ``absmax``); an Inf makes its block's ``absmax`` Inf, so every other
  moment of the block quantizes to a code next to 0 and dequantizes to NaN or -Inf (``qmap * inf``) at the
  next step: the whole block is poisoned.
- Padding: the last, partial block is loaded with gradient 0, parameter 0, state-1 code 128 and state-2
  code 0 (lines 998-1005, 1212-1216), which take part in the block's ``absmax``.

Deliberate differences from the CUDA kernel, all below float32 rounding of its own arithmetic: divisions
are IEEE (CUDA uses ``__fdividef``, within 2 ulp) and the per-step scalars come from
:func:`~zero_bnb.kernels.hyper.step_scalars` (CUDA: ``__powf``); every product and sum is rounded on its
own (no fused multiply-add, which nvcc may contract); NaN sign bits are ignored, as if every NaN were the
GPU's canonical one (but the CUDA kernel copies the gradient's own bits into the momentum at step 1 without
weight decay, so there a NaN gradient with its sign bit set keeps it: code 0, not 255). With ``skip_zeros``
the 1-state CUDA kernel leaves the moment of a skipped element uninitialised (line 1227); here it keeps its
dequantized value.
AdEMAMix's CUDA kernel reads the slow moment's ``absmax`` at ``(n + i) / 256``, which is its own row only
when ``n`` is a multiple of 256 (always so in zero_bnb's block-aligned partitions); here it is row 1.

Local: no collectives.
"""

from __future__ import annotations

import torch

from zero_bnb.kernels.hyper import BLOCK, Family, StepScalars, UpdateHyper

__all__ = ["quantize_codes", "reference_update", "sign_fix"]

_FLT_MAX = torch.finfo(torch.float32).max


def quantize_codes(x: torch.Tensor, qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    """``quantize_2D`` of every value of ``x`` (already divided by its block's absmax), as int64 codes."""
    pivot = torch.full_like(x, 127, dtype=torch.int64)
    lower_pivot = torch.zeros_like(pivot)
    upper_pivot = torch.full_like(pivot, 255)
    lower = torch.full_like(x, -1.0 if signed else 0.0)
    upper = torch.ones_like(x)
    val = qmap[pivot]
    step = 64
    while step:
        above = x > val
        lower_pivot = torch.where(above, pivot, lower_pivot)
        lower = torch.where(above, val, lower)
        upper_pivot = torch.where(above, upper_pivot, pivot)
        upper = torch.where(above, upper, val)
        pivot = pivot + torch.where(above, step, -step)
        val = qmap[pivot]
        step //= 2
    above = x > val
    towards_upper = torch.where(x > (upper + val) * 0.5, upper_pivot, pivot)
    towards_lower = torch.where(x < (lower + val) * 0.5, lower_pivot, pivot)
    return torch.where(above, towards_upper, towards_lower)


def sign_fix(codes: torch.Tensor, moment: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The state-1 sign fix: a code whose map value's sign bit differs from the moment's moves one step toward it.

    A NaN moment counts as positive: NVIDIA GPUs produce one canonical single-precision NaN, ``0x7fffffff``,
    whose sign bit is clear, whereas x86 propagates NaN sign bits and makes ``0 * inf`` negative.
    """
    negative = torch.signbit(moment) & ~moment.isnan()
    flipped = torch.signbit(qmap[codes]) != negative
    moved = codes + torch.where(moment > 0, 1, -1)
    return torch.where(flipped, moved, codes) % 256  # unsigned char arithmetic: 0 - 1 == 255


def _absmax(moment: torch.Tensor) -> torch.Tensor:
    """Per block (rows of ``moment``): fmaxf over ``|moment|`` starting at ``-FLT_MAX`` (NaN ignored)."""
    magnitude = moment.abs()
    return torch.where(magnitude.isnan(), -_FLT_MAX, magnitude).amax(dim=1).clamp_min(-_FLT_MAX)


def _requantize(moment: torch.Tensor, qmap: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = _absmax(moment)
    codes = quantize_codes(moment / absmax[:, None], qmap, signed)
    if signed:
        codes = sign_fix(codes, moment, qmap)
    return codes.to(torch.uint8), absmax


def _blocks(values: torch.Tensor, fill: float) -> torch.Tensor:
    """``values`` padded to whole blocks with ``fill`` as the CUDA loads do, shaped (blocks, 256)."""
    padded = torch.full((-(-values.numel() // BLOCK) * BLOCK,), fill, dtype=values.dtype)
    padded[: values.numel()] = values
    return padded.view(-1, BLOCK)


def _dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, fill: int) -> torch.Tensor:
    return qmap[_blocks(codes, fill).long()] * absmax[:, None]


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (``sqrtf``); ``torch.sqrt`` on CPU may be 1 ulp off. A float64
    square root rounded to float32 is exact (53 >= 2 * 24 + 2 bits)."""
    return torch.sqrt(x.double()).float()


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _two_state(hyper: UpdateHyper, s: StepScalars, p, g, state1, state2, absmax1, absmax2, qmap1, qmap2) -> None:
    n = p.numel()
    grad = _blocks(g, 0.0)
    finite = grad.isfinite()
    v = _dequantize(state2, absmax2, qmap2, 0)
    v = v * _f32(s.beta2) + (_f32(s.one_minus_beta2) * grad) * grad
    m = _dequantize(state1[0], absmax1[0], qmap1, 128)
    m = m * _f32(s.beta1) + _f32(s.one_minus_beta1) * grad
    zero = torch.zeros(())
    v, m = torch.where(finite, v, zero), torch.where(finite, m, zero)
    param = _blocks(p, 0.0)
    if hyper.family is Family.ADEMAMIX:
        slow = _dequantize(state1[1], absmax1[1], qmap1, 128)
        slow = torch.where(finite, slow * _f32(s.beta3) + _f32(s.one_minus_beta3) * grad, zero)
        moved = param - _f32(s.lr) * ((m / _f32(s.correction1) + _f32(s.alpha) * slow)
                                      / (_sqrt(v) / _f32(s.correction2) + _f32(s.eps)))
    else:
        moved = param + _f32(s.step_size) * (m / (_sqrt(v) + _f32(s.eps_hat)))
    if s.weight_decay > 0.0:
        moved = moved * _f32(s.decay)
    p.copy_(torch.where(finite, moved, param).flatten()[:n])
    for row, (moment, qmap, codes, absmax, signed) in enumerate(
        ((m, qmap1, state1[0], absmax1[0], True), (v, qmap2, state2, absmax2, False))
    ):
        new_codes, new_absmax = _requantize(moment, qmap, signed)
        codes.copy_(new_codes.flatten()[:n])
        absmax.copy_(new_absmax)
    if hyper.family is Family.ADEMAMIX:
        new_codes, new_absmax = _requantize(slow, qmap1, True)
        state1[1].copy_(new_codes.flatten()[:n])
        absmax1[1].copy_(new_absmax)


def _one_state(hyper: UpdateHyper, s: StepScalars, p, g, state1, absmax1, qmap1) -> None:
    n = p.numel()
    raw = _blocks(g, 0.0)
    grad = raw
    param = _blocks(p, 0.0)
    active = raw != 0 if hyper.skip_zeros else torch.ones_like(raw, dtype=torch.bool)
    if s.weight_decay > 0.0:
        if hyper.family is Family.LION:
            param = torch.where(active, param * _f32(s.decay), param)
        else:
            grad = grad + param * _f32(s.weight_decay)
    old = _dequantize(state1, absmax1, qmap1, 128)
    if hyper.family is Family.MOMENTUM:
        m = grad if s.step == 1 else old * _f32(s.beta1) + grad
        moved = param - _f32(s.lr) * m
    elif hyper.family is Family.LION:
        direction = old * _f32(s.beta1) + _f32(s.one_minus_beta1) * grad
        sign = (direction > 0).float() - (direction < 0).float()  # sgn(): 0 for NaN, unlike torch.sign
        m = old * _f32(s.beta2) + _f32(s.one_minus_beta2) * grad
        moved = param - _f32(s.lr) * sign
    else:
        m = old * _f32(s.beta1) + _f32(s.one_minus_beta1) * (grad * grad) if hyper.family is Family.RMSPROP \
            else old + grad * grad
        moved = param - _f32(s.lr) * (raw / (_sqrt(m) + _f32(s.eps)))
    m = torch.where(active, m, old)
    p.copy_(torch.where(active, moved, param).flatten()[:n])
    new_codes, new_absmax = _requantize(m, qmap1, True)
    state1.copy_(new_codes.flatten()[:n])
    absmax1.copy_(new_absmax)


@torch.no_grad()
def reference_update(
    hyper: UpdateHyper,
    scalars: StepScalars,
    p: torch.Tensor,
    g: torch.Tensor,
    state1: torch.Tensor,
    absmax1: torch.Tensor,
    qmap1: torch.Tensor,
    state2: torch.Tensor | None = None,
    absmax2: torch.Tensor | None = None,
    qmap2: torch.Tensor | None = None,
) -> None:
    """One blockwise 8-bit step of ``hyper.name``, in place, exactly as the CUDA kernel defines it.

    ``p``, ``g``: float32, ``n`` elements; ``state1``/``state2``: uint8 codes (AdEMAMix: ``state1`` is
    ``(2, n)``); ``absmax1``/``absmax2``: float32, one per 256 elements (AdEMAMix: ``(2, blocks)``).
    Allocates several float32 copies of the partition: a specification, not a fast path.
    """
    p, g = p.view(-1), g.view(-1)
    if hyper.family.two_state:
        rows = state1.view(-1, p.numel())
        _two_state(hyper, scalars, p, g, rows, state2.view(-1), absmax1.view(rows.shape[0], -1), absmax2.view(-1),
                   qmap1, qmap2)
    else:
        _one_state(hyper, scalars, p, g, state1.view(-1), absmax1.view(-1), qmap1)
