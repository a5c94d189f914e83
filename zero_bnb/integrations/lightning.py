"""Lightning front door: ``import zero_bnb.integrations.lightning`` registers ``strategy="deepspeed_zero_bnb_stage_1"``
(and ``_2``, ``_1_offload``, ``_2_offload``).

:class:`ZeroBnbStrategy` is Lightning's ``DeepSpeedStrategy`` with three changes:

* the engine is built by :func:`zero_bnb.initialize`, so checkpoints (``trainer.save_checkpoint``,
  ``ModelCheckpoint``) resume at any number of processes;
* it runs on CPU too (Lightning's own strategy refuses anything but CUDA, and passes
  ``device_rank=None`` to DeepSpeed there);
* the loss is scaled for gradient accumulation once: Lightning already divides the training
  loss by ``accumulate_grad_batches``, and DeepSpeed's ``engine.backward`` would divide it
  again, making gradients depend on the accumulation setting (a resume that changes
  ``accumulate_grad_batches`` to keep the global batch would drift). Here DeepSpeed's second
  division is switched off (``scale_wrt_gas=False``), so the gradient of one optimizer step
  is the mean over its micro-batches, whatever the split.

The strategy names keep "deepspeed" in them: Lightning's accelerator connector recognises
DeepSpeed strategies by that substring. Needs ``pip install zero_bnb[lightning]``.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

try:
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
    from lightning.pytorch.strategies.ddp import DDPStrategy
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "zero_bnb.integrations.lightning needs Lightning: pip install 'zero_bnb[lightning]' (or pip install 'lightning>=2.6,<2.7')"
    ) from error

import zero_bnb

__all__ = ["STRATEGY_NAMES", "ZeroBnbStrategy"]

logger = logging.getLogger(__name__)

#: Registered strategy name -> its ``ZeroBnbStrategy`` arguments (ZeRO stage; optimizer offloaded to the CPU).
STRATEGY_NAMES = {
    "deepspeed_zero_bnb_stage_1": {"stage": 1},
    "deepspeed_zero_bnb_stage_2": {"stage": 2},
    "deepspeed_zero_bnb_stage_1_offload": {"stage": 1, "offload_optimizer": True},
    "deepspeed_zero_bnb_stage_2_offload": {"stage": 2, "offload_optimizer": True},
}


class ZeroBnbStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy (ZeRO stage 1 or 2) with zero_bnb's engine, on CUDA or CPU.

    Takes ``DeepSpeedStrategy``'s arguments; ``stage`` must be 1 or 2. ``offload_optimizer=True``
    (as in Lightning's own strategy; ``"deepspeed_zero_bnb_stage_2_offload"``) keeps the fp32
    partitions and the optimizer state in CPU memory, stepped there by the module's own
    bitsandbytes optimizer (``offload_optimizer_device`` must stay ``"cpu"``).
    """

    strategy_name = "deepspeed_zero_bnb"

    def __init__(self, *args: Any, stage: int = 1, **kwargs: Any) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"ZeroBnbStrategy supports ZeRO stages 1 and 2, got stage={stage}; use strategy="
                f"\"deepspeed_zero_bnb_stage_1\" or \"deepspeed_zero_bnb_stage_2\""
            )
        super().__init__(*args, stage=stage, **kwargs)

    def setup_environment(self) -> None:
        """Lightning's environment set-up, on CUDA or CPU (collective: every rank)."""
        # DeepSpeedStrategy refuses every accelerator but CUDA; zero_bnb also trains on CPU (gloo).
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        """Join the process group (collective: every rank)."""
        if any(device.type != "cpu" for device in self.parallel_devices or ()):
            return super().setup_distributed()
        # On CPU the devices have no index, which DeepSpeedStrategy's device-index check cannot handle.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        """``zero_bnb.initialize`` in place of ``deepspeed.initialize`` (collective: every rank)."""
        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        index = self.root_device.index
        engine, deepspeed_optimizer, _, _ = zero_bnb.initialize(
            args=argparse.Namespace(device_rank=index) if index is not None else None,
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """DeepSpeed's backward without its second division by the accumulation steps (every rank, every micro-batch)."""
        # Lightning has divided the loss by accumulate_grad_batches already; DeepSpeed must not divide again.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, params in STRATEGY_NAMES.items():
            offload = ", optimizer offloaded to the CPU" if params.get("offload_optimizer") else ""
            strategy_registry.register(name, cls, description=f"zero_bnb: DeepSpeed ZeRO stage {params['stage']}"
                                       f"{offload}, elastic bitsandbytes checkpoints", override=True, **params)


ZeroBnbStrategy.register_strategies(StrategyRegistry)
