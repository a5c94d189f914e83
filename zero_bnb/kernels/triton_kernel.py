"""The Triton source of the blockwise 8-bit update (:mod:`zero_bnb.kernels.triton_update` launches it).

Imported on first use, never at ``import zero_bnb``: Triton ships with PyTorch's CUDA builds and is absent from CPU
ones. Whether Triton's interpreter runs it (``TRITON_INTERPRET=1``) is decided when this module is first imported;
import ``triton`` itself before, without the variable (:mod:`zero_bnb.kernels.triton_update` says why).
Each function mirrors its counterpart in :mod:`zero_bnb.kernels.reference`, operation for operation.

Local: no collectives.
"""

from __future__ import annotations

import triton
import triton.language as tl

from zero_bnb.kernels.hyper import Family

__all__ = ["update"]

# The kernel's family numbers (Family.kernel), as the constants a jitted function may read.
ADAM = tl.constexpr(Family.ADAM.kernel)
ADEMAMIX = tl.constexpr(Family.ADEMAMIX.kernel)
MOMENTUM = tl.constexpr(Family.MOMENTUM.kernel)
LION = tl.constexpr(Family.LION.kernel)
RMSPROP = tl.constexpr(Family.RMSPROP.kernel)
#: FLT_MAX: a value is finite when its magnitude is at most this; -FLT_MAX is where fmaxf starts and what a NaN
#: counts as in a block's absmax.
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def larger(a, b):
    """The combine function of a block's absmax (no NaN reaches it)."""
    return tl.maximum(a, b)


# ``tl.max``'s own combine function where Triton has it: its interpreter reduces with it in numpy instead of one
# element at a time. Not ``tl.max`` itself, nor ``tl.zeros``: jitted functions of Triton's standard library stay
# compiled under the interpreter when Triton was imported before it was asked for (bitsandbytes imports it).
MAXIMUM = getattr(tl.standard, "_elementwise_max", larger)


@triton.jit
def quantize(x, qmap_ptr, SIGNED: tl.constexpr):
    """``quantize_2D``'s binary search over the sorted map (``reference.quantize_codes``), as int32 codes."""
    pivot = tl.full(x.shape, 127, tl.int32)
    lower_pivot = tl.full(x.shape, 0, tl.int32)  # not tl.zeros: see MAXIMUM
    upper_pivot = tl.full(x.shape, 255, tl.int32)
    lower = tl.full(x.shape, -1.0 if SIGNED else 0.0, tl.float32)
    upper = tl.full(x.shape, 1.0, tl.float32)
    val = tl.load(qmap_ptr + pivot)
    for shift in tl.static_range(7):
        step = 64 >> shift
        above = x > val
        lower_pivot = tl.where(above, pivot, lower_pivot)
        lower = tl.where(above, val, lower)
        upper_pivot = tl.where(above, upper_pivot, pivot)
        upper = tl.where(above, upper, val)
        pivot = pivot + tl.where(above, step, -step)
        val = tl.load(qmap_ptr + pivot)
    above = x > val
    towards_upper = tl.where(x > (upper + val) * 0.5, upper_pivot, pivot)
    towards_lower = tl.where(x < (lower + val) * 0.5, lower_pivot, pivot)
    return tl.where(above, towards_upper, towards_lower)


@triton.jit
def requantize(moment, qmap_ptr, codes_ptr, absmax_ptr, offsets, mask, blocks, block_mask,
               SIGNED: tl.constexpr):
    """Store ``moment``'s new per-block absmax (fmaxf over |moment|, NaN ignored) and its codes (state-1 sign
    fix included when ``SIGNED``)."""
    magnitude = tl.where(moment != moment, -FLT_MAX, tl.abs(moment))
    absmax = tl.reduce(magnitude, 1, MAXIMUM)
    codes = quantize(tl.math.div_rn(moment, absmax[:, None]), qmap_ptr, SIGNED)
    if SIGNED:
        negative = (moment.to(tl.int32, bitcast=True) < 0) & (moment == moment)
        flipped = (tl.load(qmap_ptr + codes).to(tl.int32, bitcast=True) < 0) != negative
        codes = tl.where(flipped, codes + tl.where(moment > 0, 1, -1), codes) & 255  # unsigned char arithmetic
    tl.store(codes_ptr + offsets, codes.to(tl.uint8), mask=mask)
    tl.store(absmax_ptr + blocks, absmax, mask=block_mask)


# The sizes and the step are not specialised on (Triton would compile again for every n divisible by 16 or not, and
# for step 1): one compilation per family and flags.
@triton.jit(do_not_specialize=["n", "n_blocks", "step"])
def update(p_ptr, g_ptr, state1_ptr, state2_ptr, absmax1_ptr, absmax2_ptr, qmap1_ptr, qmap2_ptr, n, n_blocks,
           beta1, beta2, beta3, alpha, eps, lr, weight_decay, one_minus_beta1, one_minus_beta2, one_minus_beta3,
           correction1, correction2, step_size, eps_hat, decay, step,
           FAMILY: tl.constexpr, DECAY: tl.constexpr, SKIP_ZEROS: tl.constexpr, ROWS: tl.constexpr,
           BLOCK: tl.constexpr):
    """One blockwise 8-bit step of ``ROWS`` quantization blocks of ``BLOCK`` elements (program ``i``: blocks
    ``i * ROWS`` onwards): the pointers are the reference's tensors (``state2``/``absmax2``/``qmap2`` unused for
    1-state families; AdEMAMix's slow moment at ``state1 + n`` and ``absmax1 + n_blocks``), the floats the fields of
    ``StepScalars``, ``FAMILY`` a ``Family``'s kernel number, ``DECAY`` whether weight decay is positive."""
    blocks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    block_mask = blocks < n_blocks
    offsets = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offsets < n
    # The partial last block is padded as bitsandbytes' loads pad it: gradient and parameter 0, state-1 code 128
    # and state-2 code 0; the padding takes part in the block's absmax.
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0)
    param = tl.load(p_ptr + offsets, mask=mask, other=0.0)
    codes1 = tl.load(state1_ptr + offsets, mask=mask, other=128).to(tl.int32)
    old1 = tl.load(qmap1_ptr + codes1) * tl.load(absmax1_ptr + blocks, mask=block_mask, other=0.0)[:, None]
    if FAMILY == ADAM or FAMILY == ADEMAMIX:  # kOptimizerStatic8bit2StateBlockwise
        finite = tl.abs(g) <= FLT_MAX  # neither NaN nor +-Inf
        codes2 = tl.load(state2_ptr + offsets, mask=mask, other=0).to(tl.int32)
        v = tl.load(qmap2_ptr + codes2) * tl.load(absmax2_ptr + blocks, mask=block_mask, other=0.0)[:, None]
        v = tl.where(finite, v * beta2 + (one_minus_beta2 * g) * g, 0.0)
        m = tl.where(finite, old1 * beta1 + one_minus_beta1 * g, 0.0)
        if FAMILY == ADEMAMIX:  # the slow moment: state1's second row, absmax1's second row, qmap1
            codes3 = tl.load(state1_ptr + n + offsets, mask=mask, other=128).to(tl.int32)
            slow = tl.load(qmap1_ptr + codes3) * tl.load(absmax1_ptr + n_blocks + blocks, mask=block_mask,
                                                         other=0.0)[:, None]
            slow = tl.where(finite, slow * beta3 + one_minus_beta3 * g, 0.0)
            moved = param - lr * tl.math.div_rn(tl.math.div_rn(m, correction1) + alpha * slow,
                                                tl.math.div_rn(tl.sqrt_rn(v), correction2) + eps)
        else:
            moved = param + step_size * tl.math.div_rn(m, tl.sqrt_rn(v) + eps_hat)
        if DECAY:
            moved = moved * decay
        tl.store(p_ptr + offsets, tl.where(finite, moved, param), mask=mask)
        requantize(m, qmap1_ptr, state1_ptr, absmax1_ptr, offsets, mask, blocks, block_mask, True)
        requantize(v, qmap2_ptr, state2_ptr, absmax2_ptr, offsets, mask, blocks, block_mask, False)
        if FAMILY == ADEMAMIX:
            requantize(slow, qmap1_ptr, state1_ptr + n, absmax1_ptr + n_blocks, offsets, mask, blocks,
                       block_mask, True)
    else:  # momentum, Lion, RMSprop, Adagrad: kOptimizerStatic8bit1StateBlockwise
        grad = g
        if SKIP_ZEROS:
            active = g != 0.0
        else:
            active = offsets >= 0
        if DECAY:
            if FAMILY == LION:
                param = tl.where(active, param * decay, param)
            else:
                grad = grad + param * weight_decay
        if FAMILY == MOMENTUM:
            m = tl.where(step == 1, grad, old1 * beta1 + grad)
            moved = param - lr * m
        elif FAMILY == LION:
            direction = old1 * beta1 + one_minus_beta1 * grad
            sign = (direction > 0.0).to(tl.float32) - (direction < 0.0).to(tl.float32)  # sgn(): 0 for NaN
            m = old1 * beta2 + one_minus_beta2 * grad
            moved = param - lr * sign
        else:
            if FAMILY == RMSPROP:
                m = old1 * beta1 + one_minus_beta1 * (grad * grad)
            else:
                m = old1 + grad * grad
            moved = param - lr * tl.math.div_rn(g, tl.sqrt_rn(m) + eps)  # the raw gradient moves the parameter
        m = tl.where(active, m, old1)
        tl.store(p_ptr + offsets, tl.where(active, moved, param), mask=mask)
        requantize(m, qmap1_ptr, state1_ptr, absmax1_ptr, offsets, mask, blocks, block_mask, True)

