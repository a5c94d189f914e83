"""Sends every blockwise 8-bit update that one of zero_bnb's kernels can make to it, by the parameter's device.

:class:`FusedUpdate` replaces a bitsandbytes optimizer's ``update_step`` (as
:class:`zero_bnb.bnb.chunked.ChunkedUpdate` does, which may wrap it). The decision is the *parameter's* device:
bitsandbytes' paged state (``is_paged``, parameters of at least 1e5 elements on CUDA) is a CPU tensor over CUDA
managed memory, which bitsandbytes' CUDA kernel updates.

- An fp32 CPU parameter with a CPU gradient whose ``state1`` is uint8 on the CPU and not paged is updated by the
  fused CPU kernel (:func:`~zero_bnb.kernels.fused.fused_update`), as ``zero_cpu_update`` says: ``"auto"`` (fused
  when it builds, else bitsandbytes' path with one warning), ``"fused"`` (fail if it cannot build) or
  ``"bitsandbytes"``.
- An fp32 parameter on a GPU with its gradient and every state tensor on that GPU (not paged) may be updated by the
  Triton kernel (:func:`~zero_bnb.kernels.triton_update.triton_update`), as ``zero_gpu_update`` says: ``"auto"``
  (the Triton kernel only for the families and GPU generations in :data:`GPU_FUSED_FASTER`, where a GPU measurement
  showed it faster than bitsandbytes' kernel: none yet), ``"fused"`` (every family; fail if Triton is missing) or
  ``"bitsandbytes"``.
- Anything else (paged state, fp32 state, fp16/bf16 parameters, an optimizer without a fused kernel) takes the
  optimizer's own path.

The configuration and step counting are bitsandbytes' (``get_config``, ``state["step"] += 1``, AdEMAMix's
alpha/beta3 schedule from ``bitsandbytes/optim/ademamix.py``), so per-parameter overrides keep working; both
kernels write bitsandbytes' state format, so a checkpoint resumes with either kernel.

Local: no collectives.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch

from zero_bnb.core.config import CPU_UPDATE_MODES, GPU_UPDATE_MODES
from zero_bnb.kernels.build import KernelBuildError, KernelCacheError, load_library
from zero_bnb.kernels.fused import fused_update
from zero_bnb.kernels.hyper import FAMILIES, Family, UpdateHyper, step_scalars
from zero_bnb.kernels.triton_update import triton_missing, triton_update

__all__ = ["GPU_FUSED_FASTER", "KERNELS", "FusedUpdate", "hyper_for", "install_fused_update", "installed",
           "uninstall_fused_update", "update_kernel"]

#: The (family, GPU compute capability) pairs for which a GPU measurement (``benchmarks/gpu/check.sh``: the kernel
#: alone and train_bench end to end) showed the Triton kernel faster than bitsandbytes' CUDA kernel, e.g.
#: ``(Family.ADAM, (9, 0))`` for Adam on an H100/H200; ``zero_gpu_update: "auto"`` takes it for these only. None has
#: been measured yet.
GPU_FUSED_FASTER: frozenset[tuple[Family, tuple[int, int]]] = frozenset()
#: What :func:`update_kernel` names: zero_bnb's CPU kernel, its Triton kernel, bitsandbytes' own update (CPU or CUDA,
#: 8-bit or 32-bit), and the step of an optimizer that is not bitsandbytes' (torch's Adam/AdamW).
KERNELS = ("zero_bnb fused CPU kernel", "zero_bnb Triton kernel", "bitsandbytes", "the optimizer's own step")

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


def _triton_refused(missing: str) -> RuntimeError:
    return RuntimeError(f"zero_gpu_update is \"fused\" but the Triton 8-bit update cannot run: {missing}. Set "
                        f"zero_gpu_update to \"auto\" or \"bitsandbytes\" to use bitsandbytes' kernel")


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


def _check_modes(mode: str, gpu_mode: str) -> None:
    if mode not in CPU_UPDATE_MODES:
        raise ValueError(f"zero_cpu_update must be one of {list(CPU_UPDATE_MODES)}, got {mode!r}")
    if gpu_mode not in GPU_UPDATE_MODES:
        raise ValueError(f"zero_gpu_update must be one of {list(GPU_UPDATE_MODES)}, got {gpu_mode!r}")


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


class FusedUpdate:
    """A replacement for a bitsandbytes optimizer's ``update_step`` that sends 8-bit updates to zero_bnb's kernels.

    Install with :func:`install_fused_update`. ``fused_steps`` counts the updates the CPU kernel made, ``triton_steps``
    those the Triton kernel made. ``announce``: log (once per process) which CPU kernel library the first fused update
    loaded.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "auto", gpu_mode: str = "auto", *,
                 announce: bool = False) -> None:
        _check_modes(mode, gpu_mode)
        self.optimizer = optimizer
        self.mode = mode
        self.gpu_mode = gpu_mode
        self.announce = announce
        self.original = optimizer.update_step
        self.fused_steps = 0
        self.triton_steps = 0

    def _eight_bit_on(self, p: torch.Tensor, device_type: str, gradient: bool = True,
                      eight_bit: bool | None = None) -> bool:
        """Whether ``p`` is an fp32 parameter on a ``device_type`` device whose fp32 gradient (with ``gradient``: the
        step's; DeepSpeed frees it after the step), uint8 ``state1`` and every other state tensor are plain tensors
        on the same device (never paged: paged state is a CPU tensor whatever the parameter's device), for an
        optimizer family with a fused kernel. ``eight_bit``: whether bitsandbytes will give ``p`` 8-bit state, where it
        has none yet (before the first step)."""
        if getattr(self.optimizer, "optimizer_name", None) not in FAMILIES:
            return False
        if p.device.type != device_type or p.dtype != torch.float32:
            return False
        if gradient and not (p.grad is not None and p.grad.device == p.device and p.grad.dtype == torch.float32):
            return False
        state = self.optimizer.state.get(p, {})
        if "state1" not in state and eight_bit is not None:  # what bitsandbytes' init_state will allocate:
            # get_state_buffer pages only CUDA parameters of at least 1e5 elements
            paged = getattr(self.optimizer, "is_paged", False) and p.device.type == "cuda" and p.numel() >= 1e5
            return eight_bit and not paged
        codes = state.get("state1")
        if not (isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8):
            return False
        tensors = [value for value in state.values() if isinstance(value, torch.Tensor)]
        return not any(value.device != p.device or getattr(value, "is_paged", False) for value in tensors)

    def _on_gpu(self, p: torch.Tensor, gradient: bool = True, eight_bit: bool | None = None) -> bool:
        """Whether the Triton kernel takes ``p`` (``zero_gpu_update`` and :data:`GPU_FUSED_FASTER` decide)."""
        # cheapest first: this runs for every GPU parameter at every step, and "auto" takes no family yet
        if p.device.type != "cuda" or self.gpu_mode == "bitsandbytes" or (self.gpu_mode == "auto"
                                                                          and not GPU_FUSED_FASTER):
            return False
        if not self._eight_bit_on(p, "cuda", gradient, eight_bit):
            return False
        if self.gpu_mode == "auto" and (Family(self.optimizer.optimizer_name),
                                        _capability(p.device)) not in GPU_FUSED_FASTER:
            return False
        missing = triton_missing()
        if missing and self.gpu_mode == "fused":  # where the mode was changed after install_fused_update checked
            raise _triton_refused(missing)
        return missing is None

    def _on_cpu(self, p: torch.Tensor, gradient: bool = True, eight_bit: bool | None = None) -> bool:
        """Whether the fused CPU kernel takes ``p`` (``zero_cpu_update`` decides; the kernel must build)."""
        if self.mode == "bitsandbytes" or not self._eight_bit_on(p, "cpu", gradient, eight_bit):
            return False
        return _fused_available(self.mode, self.announce)

    def kernel_for(self, p: torch.Tensor, eight_bit: bool | None = None) -> str:
        """Which kernel updates ``p`` (one of :data:`KERNELS`) at its next step with an fp32 gradient on its device,
        as :meth:`__call__` will decide it. ``eight_bit``: whether ``p``'s state will be 8-bit, where bitsandbytes
        has not allocated it yet."""
        if self._on_cpu(p, False, eight_bit):
            return KERNELS[0]
        return KERNELS[1] if self._on_gpu(p, False, eight_bit) else KERNELS[2]

    @torch.no_grad()
    def __call__(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> Any:
        kernel = fused_update if self._on_cpu(p) else triton_update if self._on_gpu(p) else None
        if kernel is None:
            return self.original(group, p, gindex, pindex)
        p.data = p.data.contiguous()
        p.grad = p.grad.contiguous()
        state = self.optimizer.state[p]
        config = self.optimizer.get_config(gindex, pindex, group)
        step = state["step"] + 1  # counted once the kernel has taken the step: a refusal leaves the count as it was
        hyper = hyper_for(self.optimizer.optimizer_name, config, step)
        kernel(hyper, step_scalars(hyper, step), p.data, p.grad, state["state1"], state["absmax1"],
               state["qmap1"], state.get("state2"), state.get("absmax2"), state.get("qmap2"))
        state["step"] = step
        if kernel is fused_update:
            self.fused_steps += 1
        else:
            self.triton_steps += 1
        return None


def install_fused_update(optimizer: torch.optim.Optimizer, mode: str, gpu_mode: str = "auto", *,
                         announce: bool = False) -> None:
    """Replace ``optimizer.update_step`` by a :class:`FusedUpdate` (bitsandbytes optimizers only): ``mode`` is
    ``zero_cpu_update``, ``gpu_mode`` ``zero_gpu_update``. Where one is installed already, its modes become these.
    ``announce``: log at INFO which CPU kernel library the first fused update loads (pass it on one rank).

    Raises:
        KernelBuildError: ``mode`` is ``"fused"`` and the CPU kernel cannot be built.
        RuntimeError: ``gpu_mode`` is ``"fused"``, a GPU is present and Triton cannot run the GPU kernel.
    """
    _check_modes(mode, gpu_mode)
    if mode == "fused":
        _fused_available(mode, announce)
    missing = triton_missing() if gpu_mode == "fused" and torch.cuda.is_available() else None
    if missing:
        raise _triton_refused(missing)
    update = installed(optimizer)
    if update is None:
        optimizer.update_step = FusedUpdate(optimizer, mode, gpu_mode, announce=announce)
    else:  # installed already (perhaps under a ChunkedUpdate): the settings of this call apply
        update.mode, update.gpu_mode, update.announce = mode, gpu_mode, announce


def installed(optimizer: Any) -> FusedUpdate | None:
    """The :class:`FusedUpdate` of ``optimizer`` (under a :class:`~zero_bnb.bnb.chunked.ChunkedUpdate` or other
    wrapper with an ``original``), or ``None``."""
    update = optimizer.__dict__.get("update_step")
    while update is not None and not isinstance(update, FusedUpdate):
        update = getattr(update, "original", None)
    return update


def update_kernel(optimizer: Any, p: torch.Tensor, eight_bit: bool | None = None) -> str:
    """Which kernel updates ``p`` (one of :data:`KERNELS`) at the optimizer's next step
    (:meth:`FusedUpdate.kernel_for`). Local."""
    update = installed(optimizer)
    if update is not None:
        return update.kernel_for(p, eight_bit)
    return KERNELS[2] if getattr(optimizer, "optimizer_name", None) is not None else KERNELS[3]


def uninstall_fused_update(optimizer: Any) -> None:
    """Remove a :class:`FusedUpdate` installed directly on ``optimizer``."""
    if isinstance(optimizer.__dict__.get("update_step"), FusedUpdate):
        del optimizer.update_step
