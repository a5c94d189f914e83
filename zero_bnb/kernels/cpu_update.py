"""Sends every blockwise 8-bit update of a parameter that lives on the CPU to the fused kernel.

:class:`CpuUpdate` replaces a bitsandbytes optimizer's ``update_step`` (as
:class:`zero_bnb.bnb.chunked.ChunkedUpdate` does, which may wrap it): an fp32 CPU parameter with a CPU
gradient whose ``state1`` is uint8 on the CPU and not paged is updated by
:func:`~zero_bnb.kernels.fused.fused_update`; anything else (a parameter on a GPU, paged state, fp32
state, fp16/bf16 parameters, an optimizer without a fused kernel) takes the optimizer's own path. The
decision is the *parameter's* device: bitsandbytes' paged state (``is_paged``, parameters of at least
1e5 elements on CUDA) is a CPU tensor over CUDA managed memory, which the CUDA kernel updates. The
configuration and step counting are bitsandbytes' (``get_config``, ``state["step"] += 1``, AdEMAMix's
alpha/beta3 schedule from ``bitsandbytes/optim/ademamix.py``), so per-parameter overrides keep working.
The ``zero_cpu_update`` setting chooses: ``"auto"`` (fused when it builds, else bitsandbytes' path with one
warning), ``"fused"`` (fail if it cannot build) or ``"bitsandbytes"``.

Local: no collectives.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from zero_bnb.core.config import CPU_UPDATE_MODES
from zero_bnb.kernels.build import KernelBuildError, KernelCacheError, load_library
from zero_bnb.kernels.fused import fused_update
from zero_bnb.kernels.hyper import FAMILIES, Family, UpdateHyper, step_scalars

__all__ = ["CpuUpdate", "hyper_for", "install_cpu_update", "uninstall_cpu_update"]

logger = logging.getLogger(__name__)

_warned = False


def _fused_available(mode: str, announce: bool = False) -> bool:
    """Whether the kernel can be used; in ``"auto"`` mode a failed build warns once per process. ``announce``: log
    which library was loaded (:func:`~zero_bnb.kernels.build.load_library`)."""
    global _warned
    try:
        load_library(announce=announce)
        return True
    except KernelBuildError as error:
        # A cache-folder problem names its own fix; otherwise the compiler is what is missing.
        fix = ("do as it says" if isinstance(error, KernelCacheError) else
               "install a C++ compiler with OpenMP (e.g. apt-get install g++)") + " and run `zero-bnb build-kernels`"
        if mode == "fused":
            raise type(error)(
                f"zero_cpu_update is \"fused\" but the fused CPU 8-bit update cannot be built: {error}. To fix it, "
                f"{fix}, or set zero_cpu_update to \"auto\" or \"bitsandbytes\""
            ) from error
        if not _warned:
            _warned = True
            logger.warning(
                "zero_bnb: the fused CPU 8-bit optimizer update could not be built (%s); using bitsandbytes' CPU path, "
                "which was 12-26x slower in benchmarks/results/cpu_optimizer_step.md. To get the fast one, %s", error,
                fix,
            )
        return False


def hyper_for(optimizer_name: str, config: dict[str, Any], step: int) -> UpdateHyper:
    """The arguments bitsandbytes' ``update_step`` would pass to ``optimizer_update_8bit_blockwise``."""
    betas = config["betas"]
    beta3, alpha = (betas[2] if len(betas) >= 3 else 0.0), config.get("alpha", 0.0)
    if optimizer_name == Family.ADEMAMIX.value:  # the schedule of bitsandbytes/optim/ademamix.py AdEMAMix.update_step
        t_alpha, t_beta3 = config.get("t_alpha"), config.get("t_beta3")
        if t_alpha:
            alpha = min(step * alpha / t_alpha, alpha)
        if t_beta3:
            ln_beta1, ln_beta3 = math.log(betas[0]), math.log(beta3)
            scale = step / t_beta3
            beta3 = min(math.exp((ln_beta1 * ln_beta3) / (((1 - scale) * ln_beta3) + (scale * ln_beta1))), beta3)
    return UpdateHyper(name=optimizer_name, lr=config["lr"], beta1=betas[0], beta2=betas[1], beta3=beta3,
                       alpha=alpha, eps=config["eps"], weight_decay=config["weight_decay"],
                       skip_zeros=bool(config.get("skip_zeros", False)))


class CpuUpdate:
    """A replacement for a bitsandbytes optimizer's ``update_step`` that fuses CPU 8-bit updates.

    Install with :func:`install_cpu_update`. ``fused_steps`` counts the updates the kernel made. ``announce``: log
    (once per process) which kernel library the first fused update loaded.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "auto", *, announce: bool = False) -> None:
        if mode not in CPU_UPDATE_MODES:
            raise ValueError(f"zero_cpu_update must be one of {list(CPU_UPDATE_MODES)}, got {mode!r}")
        self.optimizer = optimizer
        self.mode = mode
        self.announce = announce
        self.original = optimizer.update_step
        self.fused_steps = 0

    def _fusable(self, p: torch.Tensor) -> bool:
        """Whether the kernel takes ``p``: decided by the parameter's and gradient's device, never by the state's
        alone (paged state is a CPU tensor whatever the parameter's device); every state tensor must be a plain
        CPU tensor too."""
        if self.mode == "bitsandbytes" or getattr(self.optimizer, "optimizer_name", None) not in FAMILIES:
            return False
        state = self.optimizer.state[p]
        codes = state.get("state1")
        if not (isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8):
            return False
        if not (p.device.type == "cpu" and p.dtype == torch.float32 and p.grad is not None
                and p.grad.device.type == "cpu" and p.grad.dtype == torch.float32):
            return False
        tensors = [value for value in state.values() if isinstance(value, torch.Tensor)]
        if any(value.device.type != "cpu" or getattr(value, "is_paged", False) for value in tensors):
            return False
        return _fused_available(self.mode, self.announce)

    @torch.no_grad()
    def __call__(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> Any:
        if not self._fusable(p):
            return self.original(group, p, gindex, pindex)
        p.data = p.data.contiguous()
        p.grad = p.grad.contiguous()
        state = self.optimizer.state[p]
        config = self.optimizer.get_config(gindex, pindex, group)
        step = state["step"] + 1  # counted once the kernel has taken the step: a refusal leaves the count as it was
        hyper = hyper_for(self.optimizer.optimizer_name, config, step)
        fused_update(hyper, step_scalars(hyper, step), p.data, p.grad, state["state1"], state["absmax1"],
                     state["qmap1"], state.get("state2"), state.get("absmax2"), state.get("qmap2"))
        state["step"] = step
        self.fused_steps += 1
        return None


def install_cpu_update(optimizer: torch.optim.Optimizer, mode: str, *, announce: bool = False) -> None:
    """Replace ``optimizer.update_step`` by a :class:`CpuUpdate` (bitsandbytes optimizers only). ``announce``: log
    at INFO which kernel library the first fused update loads (pass it on one rank).

    Raises:
        KernelBuildError: ``mode`` is ``"fused"`` and the kernel cannot be built.
    """
    if mode == "fused":
        _fused_available(mode, announce)
    if not isinstance(optimizer.__dict__.get("update_step"), CpuUpdate):
        optimizer.update_step = CpuUpdate(optimizer, mode, announce=announce)


def uninstall_cpu_update(optimizer: Any) -> None:
    """Remove a :class:`CpuUpdate` installed directly on ``optimizer``."""
    if isinstance(optimizer.__dict__.get("update_step"), CpuUpdate):
        del optimizer.update_step
