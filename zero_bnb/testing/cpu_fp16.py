"""fp16 engines on CPU ranks, for tests: DeepSpeed's CPU accelerator builds them once told it may.

DeepSpeed 0.19.8's CPU accelerator reports fp16 as supported only where oneDNN has fp16 kernels
(``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX), and its engine refuses
``"fp16": {"enabled": true}`` elsewhere. torch computes fp16 on any CPU (more slowly), and the fp16 ZeRO
optimizer, its dynamic loss scaler and checkpoints run there unchanged, so the tests can round-trip fp16
state (the loss scaler, whole fp32 masters) on CPU ranks. Not for training: use a GPU.

Local: no collectives.
"""

from __future__ import annotations

__all__ = ["allow_fp16_on_cpu"]


def allow_fp16_on_cpu() -> bool:
    """Let DeepSpeed's CPU accelerator build fp16 engines in this process; ``False`` (nothing changed) when the
    accelerator is not the CPU one. Call it in each rank before building an engine."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return False
    type(accelerator).is_fp16_supported = lambda self: True
    return True
