"""A plain DeepSpeed training script with zero_bnb's preemption one-liner, started by a real ``torchrun``.

``python -m torch.distributed.run --standalone --nproc_per_node N tests/preemption_script.py FOLDER STEPS``: builds
the toy engine, resumes from ``FOLDER`` when it holds a checkpoint (``engine.load_checkpoint(FOLDER)`` follows
``latest``, at any number of processes), installs ``zero_bnb.save_on_preemption(engine, FOLDER)`` and trains to
``STEPS`` optimizer steps, each a little slowed down so that a signal arrives mid-run. Rank 0 appends each step's
loss to ``FOLDER.losses.jsonl`` (``{"step", "loss", "dp"}``); ``tests/test_preemption.py`` sends the signal.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(folder: str, steps: int) -> None:
    import bitsandbytes as bnb
    import torch.distributed as dist

    import zero_bnb
    from zero_bnb.testing.toy import DEFAULT_RUN, build_engine, train_steps

    world = int(os.environ["WORLD_SIZE"])
    engine = build_engine(world, bnb.optim.Adam8bit)
    if os.path.isfile(os.path.join(folder, "latest")):
        engine.load_checkpoint(folder)  # saved at any number of processes
    zero_bnb.save_on_preemption(engine, folder)  # the one-liner
    for step in range(engine.global_steps, steps):
        loss = train_steps(engine, DEFAULT_RUN, step, 1)[0]
        if dist.get_rank() == 0:
            with open(f"{folder}.losses.jsonl", "a") as handle:
                handle.write(json.dumps({"step": step + 1, "loss": loss, "dp": world}) + "\n")
        time.sleep(0.3)  # room for the signal to land mid-run
    engine.save_checkpoint(folder)
    dist.destroy_process_group()
    from zero_bnb.testing.ranks import exit_skipping_finalization

    # not gloo's teardown race at interpreter exit: CI lost the uninterrupted run's rank 1 to "terminate called
    # without an active exception" (SIGABRT) once (see exit_skipping_finalization)
    exit_skipping_finalization()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
