"""Calls the compiled kernel (:mod:`zero_bnb.kernels.build`) on one partition's tensors.

Local: no collectives.
"""

from __future__ import annotations

import ctypes

import torch

from zero_bnb.kernels.build import QUANTIZER_PATHS, load_library
from zero_bnb.kernels.hyper import BLOCK, StepScalars, UpdateHyper

__all__ = ["QUANTIZER_PATHS", "fused_quantize", "fused_update", "quantizer_path"]


class _Scalars(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float) for name in (
        "beta1", "beta2", "beta3", "alpha", "eps", "lr", "weight_decay", "one_minus_beta1", "one_minus_beta2",
        "one_minus_beta3", "correction1", "correction2", "step_size", "eps_hat", "decay")] + [
        ("step", ctypes.c_int32), ("skip_zeros", ctypes.c_int32)]


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, numel: int) -> int:
    if tensor.device.type != "cpu" or tensor.dtype != dtype or not tensor.is_contiguous() or tensor.numel() != numel:
        raise ValueError(
            f"fused 8-bit update: {name} must be a contiguous CPU {dtype} tensor of {numel} elements, got "
            f"{tensor.device} {tensor.dtype} shape {tuple(tensor.shape)} (contiguous: {tensor.is_contiguous()})"
        )
    return tensor.data_ptr()


@torch.no_grad()
def fused_update(
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
    threads: int | None = None,
    library: ctypes.CDLL | None = None,
) -> None:
    """The step :func:`~zero_bnb.kernels.reference.reference_update` specifies, in place, fused per block.

    Same arguments as the reference; ``threads`` defaults to ``torch.get_num_threads()``. The result does
    not depend on it. ``library``: a build other than :func:`~zero_bnb.kernels.build.load_library`'s
    (from :func:`~zero_bnb.kernels.build.bind`).

    Raises:
        ValueError: a tensor has the wrong device, dtype, size or layout.
        KernelBuildError: the kernel could not be built.
    """
    n = p.numel()
    blocks = -(-n // BLOCK)
    rows = hyper.family.rows
    pointers = [_check("p", p, torch.float32, n), _check("grad", g, torch.float32, n),
                _check("state1", state1, torch.uint8, rows * n)]
    two = hyper.family.two_state
    pointers.append(_check("state2", state2, torch.uint8, n) if two else None)
    pointers.append(_check("absmax1", absmax1, torch.float32, rows * blocks))
    pointers.append(_check("absmax2", absmax2, torch.float32, blocks) if two else None)
    pointers.append(_check("qmap1", qmap1, torch.float32, 256))
    pointers.append(_check("qmap2", qmap2, torch.float32, 256) if two else None)
    packed = _Scalars(**{name: getattr(scalars, name) for name, _ in _Scalars._fields_ if name != "skip_zeros"},
                      skip_zeros=int(hyper.skip_zeros))
    if n == 0:
        return
    status = (library or load_library()).zero_bnb_blockwise_update(
        hyper.family.kernel, ctypes.byref(packed), n, *pointers, threads or torch.get_num_threads()
    )
    if status != 0:
        raise ValueError(f"the fused kernel refused optimizer {hyper.name!r} (status {status})")


def fused_quantize(x: torch.Tensor, qmap: torch.Tensor, signed: bool, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """The kernel's codes for ``x`` (values already divided by their absmax), sign fix included when ``signed``.

    The same function the update applies to each moment; :func:`~zero_bnb.kernels.reference.quantize_codes`
    specifies it. ``library``: as in :func:`fused_update`.
    """
    x = x.detach().to(torch.float32).contiguous().view(-1)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    (library or load_library()).zero_bnb_quantize(_check("qmap", qmap, torch.float32, 256), int(signed), x.data_ptr(), x.numel(),
                                     out.data_ptr())
    return out


def quantizer_path(qmap: torch.Tensor, signed: bool, library: ctypes.CDLL | None = None) -> str:
    """How the kernel quantizes with ``qmap`` on this machine: ``"permute"`` (AVX512-VBMI byte permutes over
    tables small enough for registers), ``"gather"`` (AVX-512 gathers from the 16-bit table: a map the permute
    tables cannot hold, or no VBMI), ``"avx2"`` (AVX2 gathers from that table), ``"neon"`` (aarch64: the permute
    tables through NEON's ``vqtbl4q_u8``) or ``"scalar"``. The codes are the same."""
    lib = library or load_library()
    return QUANTIZER_PATHS[lib.zero_bnb_quantizer_path(_check("qmap", qmap, torch.float32, 256), int(signed))]
