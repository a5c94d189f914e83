"""What a load leaves alive: train (DeepSpeed links its per-parameter views of the optimizer state at the first
step), save, train on, then load and look at the replaced state and at the views. One launch, several engines."""

from __future__ import annotations

import gc
import logging
import os
import weakref

import bitsandbytes as bnb
import torch

import zero_bnb
from scenarios import _save_result

from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import build_engine, train_steps

#: name -> extra DeepSpeed config: ZeRO-1/2 (DeepSpeedZeroOptimizer), bf16 with fp32 accumulation (BF16_Optimizer),
#: optimizer offload, stage 3 (keeps no views).
CASES = {
    "fp32-zero1": {},
    "bf16acc-zero1": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
    "bf16-zero2": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    "fp32-zero2-offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "bf16-zero3": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}},
}


def _views(engine) -> list[tuple[str, torch.Tensor]]:
    """DeepSpeed's per-parameter views of the optimizer state (``_hp_mapping.optim_fragment``), by state key."""
    found = []
    for param in engine.module.parameters():
        mapping = getattr(param, "_hp_mapping", None)
        for key, view in ((getattr(mapping, "optim_fragment", None) or {}) if mapping is not None else {}).items():
            found.append((key, view))
    return found


def load_keeps_nothing_alive(rank: int, world: int, workdir: str) -> None:
    out = {}
    for case, extra in CASES.items():
        engine = build_engine(world, bnb.optim.Adam8bit, **extra)
        base = engine.optimizer.optimizer
        train_steps(engine, RUN, 0, 2)
        engine.save_checkpoint(os.path.join(workdir, case), tag="a")
        train_steps(engine, RUN, 2, 1)
        old = [weakref.ref(value) for entry in base.state.values() for value in entry.values()
               if isinstance(value, torch.Tensor)]
        old_bytes = sum(ref().untyped_storage().nbytes() for ref in old)
        views_before = sorted(key for key, _ in _views(engine))
        messages = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: messages.append(record.getMessage())
        logger = logging.getLogger("zero_bnb.ds.engine")
        logger.addHandler(handler)
        level = logger.level
        logger.setLevel(logging.INFO)  # setLevel, not the attribute: it clears the logger's cached decisions
        try:
            engine.load_checkpoint(os.path.join(workdir, case), tag="a")
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        gc.collect()
        live = {value.untyped_storage().data_ptr(): key for entry in base.state.values() for key, value in entry.items()
                if isinstance(value, torch.Tensor)}
        # bitsandbytes' own quantization maps, which every state's qmap1/qmap2 starts as, live as long as the optimizer.
        shared = {value.untyped_storage().data_ptr() for value in getattr(base, "name2qmap", {}).values()}
        alive = [ref() for ref in old if ref() is not None]
        views = _views(engine)
        out[case] = {
            "old_tensors": len(old), "old_bytes": old_bytes, "views_before": views_before,
            "views_after": sorted(key for key, _ in views),
            "kept_alive_bytes": sum(t.untyped_storage().nbytes() for t in alive
                                    if t.untyped_storage().data_ptr() not in live.keys() | shared),
            "stale_views": [key for key, view in views if view.untyped_storage().data_ptr() not in live],
            "described": zero_bnb.describe(engine),
            "load_log": [m for m in messages if m.startswith("zero_bnb: loaded checkpoint")],
            "losses_after_load": train_steps(engine, RUN, 2, 1),
        }
        engine.destroy()
    _save_result(os.path.join(workdir, f"memory_dp{world}.pt"), out)
