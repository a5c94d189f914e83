"""The bf16 residual split of a checkpoint's fp32 masters, compiled (``csrc/bf16_split.h``) where the kernel builds.

:func:`split_rounded_bf16` returns what :func:`zero_bnb.core.residual.split_rounded_bf16` returns, bit for bit, in
one pass over memory (the torch version costs several passes and temporaries per chunk): the bf16 rounding check and
the residual split of a bf16 save's masters were its largest CPU cost after hashing. Where the compiled kernel cannot
be built (no compiler), the torch version runs. Local: no collectives.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from zero_bnb.core.residual import Residual
from zero_bnb.core.residual import split_rounded_bf16 as split_rounded_bf16_torch
from zero_bnb.kernels.build import load_library
from zero_bnb.kernels.cache import KernelBuildError

__all__ = ["compiled_split", "split_rounded_bf16"]

logger = logging.getLogger(__name__)


def compiled_split() -> ctypes.CDLL | None:
    """The compiled kernel library when it loads (built on first use, :func:`~zero_bnb.kernels.build.load_library`),
    else ``None`` (why is logged once per process at DEBUG: the torch version is as exact, only slower)."""
    try:
        return load_library()
    except KernelBuildError as error:  # KernelCacheError is one
        if not getattr(compiled_split, "_told", False):
            compiled_split._told = True  # type: ignore[attr-defined]
            logger.debug("zero_bnb: the bf16 residual split runs in torch: %s", error)
        return None


def split_rounded_bf16(master: torch.Tensor, weight: torch.Tensor,
                       library: ctypes.CDLL | None = None) -> Residual | None:
    """:func:`zero_bnb.core.residual.split_rounded_bf16` (``None`` where ``weight`` is not ``master``'s rounding,
    else the :class:`~zero_bnb.core.residual.Residual`), through the compiled kernel when it loads.

    ``library``: a build other than :func:`compiled_split`'s (tests pass one per instruction set).
    """
    if master.dtype != torch.float32 or weight.dtype != torch.bfloat16 or master.shape != weight.shape \
            or master.dim() != 1 or master.device.type != "cpu" or weight.device.type != "cpu":
        return split_rounded_bf16_torch(master, weight)  # which raises on wrong arguments
    library = library or compiled_split()  # the first call may build the library (once per machine and cache)
    if library is None:
        return split_rounded_bf16_torch(master, weight)
    master, weight = master.contiguous(), weight.contiguous()
    n = master.numel()
    low = torch.empty(n, dtype=torch.int16)
    room = 64 + n // 4096  # exceptions are about one element in 2^17; a second call when more
    while True:
        index = torch.empty(room, dtype=torch.int64)
        count = library.zero_bnb_split_rounded_bf16(master.data_ptr(), weight.data_ptr(), n, low.data_ptr(),
                                                    index.data_ptr(), room)
        if count < 0:
            return None
        if count <= room:
            break
        room = count
    index = index[:count].clone()
    return Residual(low, index, master.view(torch.int32)[index].view(torch.float32))
