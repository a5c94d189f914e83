"""What a load tells the user when it changes the DP size and the ZeRO stage (issue 34, point 5): two launches of the
toy model. ``save_stage2`` saves a zero_bnb ZeRO-2 checkpoint at its DP size (3: the last group's partition, 2,880
elements, is under bitsandbytes' min_8bit_size and keeps fp32 state; the first group's is 8-bit); ``load_elsewhere``
loads it at another DP size (2) into a ZeRO-3 engine (one group per parameter: state regrouped by name) and into a
ZeRO-2 engine (the last group's partition, 4,320 elements, is now 8-bit). Rank 0 writes what zero_bnb logged, at
``initialize`` (issue 42, point 6: fp32 state below min_8bit_size said once) and at the load."""

from __future__ import annotations

import json
import logging
import os

import torch.distributed as dist
from scenarios import RUN, make_engine
from stage3_scenarios import stage3_engine

import zero_bnb
from zero_bnb.testing.toy import train_steps

#: Where ``initialize`` says which groups are 8-bit.
PLAN_LOGGER = "zero_bnb.ds.precision_plan"


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[list[str]] = []

    def emit(self, record):
        self.records.append([record.levelname, record.name, record.getMessage()])


def _logged_build(build) -> tuple[object, list[list[str]]]:
    """An engine from ``build()`` and what zero_bnb's precision plan logged while it was built."""
    logger = logging.getLogger("zero_bnb")
    logger.setLevel(logging.INFO)
    handler = _Log()
    logger.addHandler(handler)
    try:
        engine = build()
    finally:
        logger.removeHandler(handler)
    return engine, [entry for entry in handler.records if entry[1] == PLAN_LOGGER]


def save_stage2(rank, world, workdir):
    engine, logged = _logged_build(lambda: make_engine(world, zero_optimization={"stage": 2}))
    described = zero_bnb.describe(engine)
    train_steps(engine, RUN, 0, 2)
    engine.save_checkpoint(os.path.join(workdir, "stage2"), tag="saved")
    with open(os.path.join(workdir, f"init_log_rank{rank}.json"), "w") as handle:
        json.dump({"log": logged, "below": described["below_min_8bit_size"],
                   "after_steps": zero_bnb.describe(engine)["below_min_8bit_size"]}, handle)


def load_elsewhere(rank, world, workdir):
    logger = logging.getLogger("zero_bnb")
    logger.setLevel(logging.INFO)
    out = {}
    for name, build in (("stage3", lambda: stage3_engine(world, "adam8bit", offload=False)),
                        ("stage2", lambda: make_engine(world, zero_optimization={"stage": 2}))):
        engine, out[f"{name}_init"] = _logged_build(build)
        out[f"{name}_below"] = zero_bnb.describe(engine)["below_min_8bit_size"]
        handler = _Log()
        logger.addHandler(handler)
        try:
            engine.load_checkpoint(os.path.join(workdir, "stage2"), tag="saved")
        finally:
            logger.removeHandler(handler)
        out[name] = [entry for entry in handler.records if entry[1].startswith(("zero_bnb.ds.engine",
                                                                                  "zero_bnb.checkpoint"))]
        engine.destroy()
    if rank == 0:
        with open(os.path.join(workdir, f"load_log_dp{world}.json"), "w") as handle:
            json.dump(out, handle)
    dist.barrier()
