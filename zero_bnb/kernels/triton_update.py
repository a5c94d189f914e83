"""The blockwise 8-bit update of bitsandbytes' state, fused in one Triton kernel for parameters on a GPU.

The arithmetic is :mod:`zero_bnb.kernels.reference`'s (bitsandbytes' CUDA kernel, with IEEE division and square
root and no contracted multiply-adds), so the state it writes is bitsandbytes' own format (``qmap``, per-block
``absmax``, uint8 codes) and a checkpoint written with one kernel resumes with the other. One program updates
``blocks_per_program`` 256-element quantization blocks of one partition: it reads the parameter, the gradient, the
codes and ``absmax`` once, and writes the parameter, the codes and ``absmax`` once (16 bytes per element for Adam,
against fused AdamW's 28; DESIGN.md's 18 counts the bf16 copy of the parameter DeepSpeed writes after the step).

Triton is imported on first use: it ships with PyTorch's CUDA builds and is absent from CPU ones. Under Triton's
interpreter the same kernel runs on CPU tensors, which is how the suite checks it without a GPU: import ``triton``
first, then import :mod:`zero_bnb.kernels.triton_kernel` with ``TRITON_INTERPRET=1`` set (Triton's own library
functions must be imported without it, else some stay half-interpreted: tests/test_triton_update.py's fixture).

Local: no collectives.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any

import torch

from zero_bnb.kernels.hyper import BLOCK, Family, StepScalars, UpdateHyper

__all__ = ["BLOCKS_PER_PROGRAM", "COMPILE_OPTIONS", "TRITON_FAMILIES", "interpreting", "triton_missing",
           "triton_update"]

#: The families the Triton kernel updates: every family of :class:`~zero_bnb.kernels.hyper.Family`.
TRITON_FAMILIES = tuple(Family)
#: 256-element blocks one program updates: compiled, and under the interpreter (where fewer, larger programs are
#: faster). The result does not depend on it.
BLOCKS_PER_PROGRAM, BLOCKS_PER_PROGRAM_INTERPRETED = 4, 64
#: How the kernel is compiled: no contracted multiply-adds (the reference rounds every product and sum on its own).
COMPILE_OPTIONS = {"enable_fp_fusion": False, "num_warps": 4}


@functools.cache
def triton_missing() -> str | None:
    """Why the kernel cannot run in this process (Triton not installed, or too old), or ``None``."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (it ships with PyTorch's CUDA builds: pip install triton)"
    try:
        import triton
    except Exception as error:  # noqa: BLE001 - an installed Triton that cannot be imported: named, not raised
        return f"Triton cannot be imported ({type(error).__name__}: {error})"
    try:
        import triton.language as tl

        tl.math.div_rn, tl.sqrt_rn  # noqa: B018 (IEEE division and square root: Triton 3.0 and newer)
    except (ImportError, AttributeError) as error:
        return f"Triton {triton.__version__} lacks what the kernel needs ({error}); Triton 3.0 or newer has it"
    return None


@functools.cache
def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernel in this process (``TRITON_INTERPRET=1`` when it was first
    imported)."""
    from triton.runtime.jit import JITFunction

    return not isinstance(_kernel(), JITFunction)


@functools.cache
def _kernel() -> Any:
    """The jitted kernel (:mod:`zero_bnb.kernels.triton_kernel`, imported once)."""
    from zero_bnb.kernels.triton_kernel import update

    return update


def _check(name: str, tensor: torch.Tensor | None, dtype: torch.dtype, numel: int, device: torch.device) -> None:
    if tensor is None or tensor.device != device or tensor.dtype != dtype or not tensor.is_contiguous() \
            or tensor.numel() != numel:
        got = "None" if tensor is None else (f"{tensor.device} {tensor.dtype} shape {tuple(tensor.shape)} "
                                             f"(contiguous: {tensor.is_contiguous()})")
        raise ValueError(f"Triton 8-bit update: {name} must be a contiguous {dtype} tensor of {numel} elements on "
                         f"{device}, got {got}")


@torch.no_grad()
def triton_update(
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
    blocks_per_program: int | None = None,
) -> None:
    """The step :func:`~zero_bnb.kernels.reference.reference_update` specifies, in place, in one Triton kernel.

    Same arguments as the reference, every tensor on ``p``'s device (a GPU; the CPU under Triton's interpreter).
    ``blocks_per_program``: blocks one program updates (a power of two; the default suits the mode). The result does
    not depend on it.

    Raises:
        ValueError: a tensor has the wrong device, dtype, size or layout, or CPU tensors without the interpreter.
        RuntimeError: Triton cannot be used (:func:`triton_missing` says why).
    """
    missing = triton_missing()
    if missing:
        raise RuntimeError(f"the Triton 8-bit update cannot run: {missing}")
    interpreted = interpreting()
    device = p.device
    if device.type == "cpu" and not interpreted:
        raise ValueError("Triton 8-bit update: CPU tensors run only under Triton's interpreter (TRITON_INTERPRET=1, "
                         "for tests); the fused CPU kernel (zero_bnb.kernels.fused) is the CPU's update")
    n = p.numel()
    blocks = -(-n // BLOCK)
    family = hyper.family
    rows = family.rows
    _check("p", p, torch.float32, n, device)
    _check("grad", g, torch.float32, n, device)
    _check("state1", state1, torch.uint8, rows * n, device)
    _check("absmax1", absmax1, torch.float32, rows * blocks, device)
    _check("qmap1", qmap1, torch.float32, 256, device)
    if family.two_state:
        _check("state2", state2, torch.uint8, n, device)
        _check("absmax2", absmax2, torch.float32, blocks, device)
        _check("qmap2", qmap2, torch.float32, 256, device)
    else:  # the kernel's unused pointers
        state2, absmax2, qmap2 = state1, absmax1, qmap1
    if n == 0:
        return
    per_program = blocks_per_program or (BLOCKS_PER_PROGRAM_INTERPRETED if interpreted else BLOCKS_PER_PROGRAM)
    if per_program < 1 or per_program & (per_program - 1):
        raise ValueError(f"blocks_per_program must be a power of two, got {per_program}")
    launch = {} if interpreted else COMPILE_OPTIONS
    s = scalars
    # Triton launches on the current device and its stream: the parameter's device, as bitsandbytes' own launch does
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _kernel()[(-(-blocks // per_program),)](
            p, g, state1, state2, absmax1, absmax2, qmap1, qmap2, n, blocks,
            s.beta1, s.beta2, s.beta3, s.alpha, s.eps, s.lr, s.weight_decay, s.one_minus_beta1, s.one_minus_beta2,
            s.one_minus_beta3, s.correction1, s.correction2, s.step_size, s.eps_hat, s.decay, s.step,
            FAMILY=family.kernel, DECAY=s.weight_decay > 0.0,
            SKIP_ZEROS=bool(hyper.skip_zeros) and not family.two_state, ROWS=per_program, BLOCK=BLOCK, **launch,
        )
