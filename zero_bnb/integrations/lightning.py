"""Lightning front door: ``import zero_bnb.integrations.lightning`` registers ``strategy="deepspeed_zero_bnb_stage_1"``
(and ``_2``, ``_3``, ``_1_offload``, ``_2_offload``, ``_3_offload``).

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

A resume from a checkpoint Lightning saved mid-epoch at another number of processes (or whose
batch counter is not a multiple of the new ``accumulate_grad_batches``) logs a warning with the
numbers: Lightning keeps the saved run's micro-batch counter, so the first optimizer step after
resume is partial and the rest of the epoch is counted in the old split.

Importing this module also lets Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` and
DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` read zero_bnb checkpoints
(:mod:`zero_bnb.integrations.conversions`).

The strategy names keep "deepspeed" in them: Lightning's accelerator connector recognises
DeepSpeed strategies by that substring. Needs ``pip install zero_bnb[lightning]``.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch

try:
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
    from lightning.pytorch.strategies.ddp import DDPStrategy
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "zero_bnb.integrations.lightning needs Lightning: pip install 'zero_bnb[lightning]' (or pip install 'lightning>=2.6,<2.7')"
    ) from error

import zero_bnb
from zero_bnb.checkpoint.pending import after_pending_saves
from zero_bnb.integrations.conversions import route_deepspeed_zero_to_fp32, route_lightning_convert
from zero_bnb.integrations.lightning_resume import complete_checkpoint
from zero_bnb.integrations.preemption import DEFAULT_SIGNALS, Preemption

__all__ = ["STRATEGY_NAMES", "SaveOnPreemption", "ZeroBnbStrategy", "mid_epoch_warning"]

logger = logging.getLogger(__name__)

#: Registered strategy name -> its ``ZeroBnbStrategy`` arguments (ZeRO stage; optimizer, and at stage 3 parameters,
#: offloaded to the CPU).
STRATEGY_NAMES = {
    "deepspeed_zero_bnb_stage_1": {"stage": 1},
    "deepspeed_zero_bnb_stage_2": {"stage": 2},
    "deepspeed_zero_bnb_stage_1_offload": {"stage": 1, "offload_optimizer": True},
    "deepspeed_zero_bnb_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "deepspeed_zero_bnb_stage_3": {"stage": 3},
    "deepspeed_zero_bnb_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
}


class ZeroBnbStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy (ZeRO stage 1, 2 or 3) with zero_bnb's engine, on CUDA or CPU.

    Takes ``DeepSpeedStrategy``'s arguments; ``stage`` must be 1, 2 or 3. At stage 3 a model built in
    ``configure_model`` is created under ``deepspeed.zero.Init`` (Lightning's habit) and partitioned on
    blocks when the engine is built; ``load_full_weights`` is refused there, and what
    :func:`zero_bnb.initialize` refuses at stage 3 (NVMe, ``reduce_scatter=False``, ...) is refused by name when the
    engine is built. ``offload_optimizer=True`` (as in Lightning's own strategy; ``"deepspeed_zero_bnb_stage_2_offload"``)
    keeps the fp32 partitions and the optimizer state in CPU memory, stepped there by the module's own bitsandbytes
    optimizer (``offload_optimizer_device`` must stay ``"cpu"``); ``"deepspeed_zero_bnb_stage_3_offload"`` offloads
    the parameters too (``offload_parameters=True``), as Lightning's ``"deepspeed_stage_3_offload"`` does.
    """

    strategy_name = "deepspeed_zero_bnb"

    def __init__(self, *args: Any, stage: int = 1, **kwargs: Any) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(
                f"ZeroBnbStrategy supports ZeRO stages 1, 2 and 3, got stage={stage}; use strategy="
                f"\"deepspeed_zero_bnb_stage_1\", \"deepspeed_zero_bnb_stage_2\" or \"deepspeed_zero_bnb_stage_3\""
            )
        if stage == 3 and kwargs.get("load_full_weights"):
            # Lightning would load the file into the gathered 16-bit weights after the engine was built, leaving
            # the optimizer's fp32 masters as they were: the first step would put the old weights back.
            raise ValueError(
                "ZeroBnbStrategy(load_full_weights=True) is not supported at ZeRO stage 3 (the loaded weights would "
                "not reach the optimizer's fp32 master weights); load the weights in configure_model before fit, or "
                "resume from the DeepSpeed checkpoint folder (ckpt_path=...), which restores weights and optimizer "
                "state at any number of processes"
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
        engine.zero_bnb_front_door = "lightning"  # its messages name accumulate_grad_batches
        return engine, deepspeed_optimizer

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's DeepSpeed load of the newest complete checkpoint for ``checkpoint_path``
        (:func:`zero_bnb.integrations.lightning_resume.complete_checkpoint`: ``ckpt_path="last"`` never resumes from an
        interrupted save), then a warning when a mid-epoch checkpoint resumes at another split (collective: every
        rank; rank 0 logs). Lightning's other arguments pass through (``weights_only`` since 2.6)."""
        trainer = self.lightning_module.trainer
        if self.deepspeed_engine is not None:
            self.deepspeed_engine.wait_for_checkpoint()  # a save still being written is complete before the choice
        checkpoint_path = complete_checkpoint(checkpoint_path, [callback.dirpath for callback in
                                                                trainer.checkpoint_callbacks
                                                                if getattr(callback, "dirpath", None)])
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        saved = getattr(self.deepspeed_engine, "zero_bnb_loaded_batch", None)
        message = mid_epoch_warning(checkpoint, saved, self.world_size,
                                    self.lightning_module.trainer.accumulate_grad_batches)
        if message and self.global_rank == 0:
            logger.warning("zero_bnb: %s %s", checkpoint_path, message)
        return checkpoint

    def on_train_end(self) -> None:
        """Lightning's end of training, then the wait for a pending asynchronous save, whose failure is raised here
        rather than lost at exit (every rank)."""
        super().on_train_end()
        if self.deepspeed_engine is not None:
            self.deepspeed_engine.wait_for_checkpoint()

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's removal of an older checkpoint (``save_top_k``), deferred while an asynchronous save
        (``zero_checkpoint_async``) is pending until that save is committed; never done if it fails. Local."""
        after_pending_saves(lambda: super(ZeroBnbStrategy, self).remove_checkpoint(filepath),
                            f"Lightning's removal of {filepath}")

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """DeepSpeed's backward without its second division by the accumulation steps (every rank, every micro-batch)."""
        # Lightning has divided the loss by accumulate_grad_batches already; DeepSpeed must not divide again.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, params in STRATEGY_NAMES.items():
            offloaded = " and ".join(part for part in ("optimizer", "parameters") if params.get(f"offload_{part}"))
            offload = f", {offloaded} offloaded to the CPU" if offloaded else ""
            strategy_registry.register(name, cls, description=f"zero_bnb: DeepSpeed ZeRO stage {params['stage']}"
                                       f"{offload}, elastic bitsandbytes checkpoints", override=True, **params)


class SaveOnPreemption(Callback):
    """Lightning's one-liner for preemption: ``pl.Trainer(..., callbacks=[zero_bnb.lightning.SaveOnPreemption()])``.

    After SIGTERM or SIGUSR1 (:mod:`zero_bnb.integrations.preemption`) the ranks agree at the end of the next optimizer
    step, save ``last.ckpt`` in the first ``ModelCheckpoint``'s directory (where ``fit(ckpt_path="last")`` finds it;
    ``path=`` to choose), wait until it is committed and durable, and exit with ``128 + signal``. Create it in the
    main thread, before ``fit``. Lightning installs its own SIGTERM handler when ``fit`` starts (it broadcasts from inside
    the handler and stops at the end of the micro-batch, without a checkpoint); from ``on_train_start`` on, this
    callback's handler takes its place (Lightning puts the earlier handlers back at its teardown).

    Args:
        signals: the signals that announce a preemption.
        exit_code: the status to exit with; default ``128 + signal``.
        path: where to save; default ``{ModelCheckpoint.dirpath}/last.ckpt``.
    """

    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS, exit_code: int | None = None,
                 path: str | None = None) -> None:
        self.preemption = Preemption(tuple(signals), exit_code)
        self.path = path
        self._step = -1

    def _save_path(self, trainer: Any) -> str:
        if self.path is not None:
            return self.path
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                path = os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
                callback.last_model_path = path
                return path
        logger.warning("zero_bnb: no ModelCheckpoint with a dirpath: the preemption checkpoint goes to %s, where "
                       "fit(ckpt_path=\"last\") does not look; pass it as ckpt_path", trainer.default_root_dir)
        return os.path.join(trainer.default_root_dir, "last.ckpt")

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.preemption.install_again()  # in place of Lightning's own (see the class docstring)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._step:
            return  # inside an accumulation: not a step boundary
        self._step = trainer.global_step
        if self.preemption.requested():
            trainer.save_checkpoint(self._save_path(trainer))
            trainer.strategy.deepspeed_engine.wait_for_checkpoint()  # committed and durable
            self.preemption.exit()


def mid_epoch_warning(checkpoint: dict[str, Any], saved: dict[str, int] | None, processes: int,
                      accumulation: int) -> str | None:
    """What is wrong with resuming Lightning's ``checkpoint`` with ``processes`` and ``accumulation``, or ``None``.

    ``saved`` is the batch geometry zero_bnb recorded (``dp``, ``accumulation``, ...). Only a
    checkpoint saved mid-epoch matters: Lightning resumes its per-process micro-batch counter
    where it was, counted in the saved run's split.
    """
    try:
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        counter, last = int(progress["current"]["completed"]), bool(progress["is_last_batch"])
    except (KeyError, TypeError, ValueError):
        return None  # not a fitting checkpoint, or another Lightning version's layout
    saved_dp = (saved or {}).get("dp", processes)
    if last or counter == 0 or (saved_dp == processes and counter % accumulation == 0):
        return None
    partial = counter % accumulation
    first_step = (f"; {counter} is not a multiple of accumulate_grad_batches={accumulation}, so the first optimizer "
                  f"step after resume accumulates {accumulation - partial} micro-batches instead of {accumulation}"
                  if partial else "")
    return (f"was saved mid-epoch, after {counter} micro-batches per process at {saved_dp} processes "
            f"(accumulation {(saved or {}).get('accumulation', '?')}); this run has {processes} processes and "
            f"accumulate_grad_batches={accumulation}. Lightning resumes its batch counter at {counter}, counted in "
            f"the saved run's split ({counter * saved_dp} micro-batches of all processes then, "
            f"{counter * processes} now){first_step}. To resume at another number of processes, save at epoch ends "
            f"(or where the counter is a multiple of the accumulation at every process count you will use).")


ZeroBnbStrategy.register_strategies(StrategyRegistry)
route_deepspeed_zero_to_fp32()  # DeepSpeed's and Lightning's zero_to_fp32 habits work on zero_bnb checkpoints
route_lightning_convert()
