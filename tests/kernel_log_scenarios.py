"""Which ranks say which fused CPU kernel library they loaded (issue 34, point 10) and which kernel steps each group
(issue 45): a toy zero_bnb engine (ZeRO-2, Adam8bit, CPU ranks: every 8-bit update takes the fused kernel) trains 2
steps, a second one with ``zero_cpu_update: "bitsandbytes"`` and ``zero_gpu_update: "fused"`` one step; each rank
writes what ``zero_bnb.kernels.build`` and the engine logged, how many updates the kernel made and what
``zero_bnb.describe`` says of both engines' kernels."""

from __future__ import annotations

import json
import logging
import os

import bitsandbytes as bnb

import zero_bnb

from zero_bnb.testing.toy import DEFAULT_RUN, build_engine, train_steps


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def train_and_record(rank, world, folder):
    handler = _Log()
    for name in ("zero_bnb.kernels.build", "zero_bnb.ds.engine"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    engine = build_engine(world, bnb.optim.Adam8bit, zero_optimization={"stage": 2})
    train_steps(engine, DEFAULT_RUN, 0, 2)
    second = build_engine(world, bnb.optim.Adam8bit, zero_optimization={"stage": 2}, zero_cpu_update="bitsandbytes",
                          zero_gpu_update="fused")  # a second engine: no new library line; bitsandbytes' CPU path
    train_steps(second, DEFAULT_RUN, 0, 1)
    fused = engine.optimizer.optimizer.update_step
    while not hasattr(fused, "fused_steps"):  # under zero_bnb's chunked update
        fused = fused.original
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump({"messages": handler.messages, "fused_steps": fused.fused_steps,
                   "eight_bit_groups": _eight_bit_groups(engine),
                   "kernels": [zero_bnb.describe(e)["update_kernels"] for e in (engine, second)]}, handle)


def _eight_bit_groups(engine) -> int:
    """The flat groups of this rank whose state is 8-bit: each takes one fused update per step."""
    import torch

    wrapper = engine.optimizer
    states = [wrapper.optimizer.state.get(wrapper.master_partition(index), {}) for index in range(wrapper.num_groups)]
    return sum(1 for state in states if "state1" in state and state["state1"].dtype == torch.uint8)
