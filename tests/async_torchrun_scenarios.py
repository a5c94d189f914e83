"""Asynchronous saves (``zero_checkpoint_async``) where the tests' launcher would hide the behaviour: scripts run by a
real ``torchrun`` (``python -m torch.distributed.run``), whose ranks end as a user's script ends (the launcher's
``destroy_process_group``, which waits for pending saves, is not called; the non-daemon threads are joined and the
exit handlers run as at the interpreter's exit, then finalization is skipped: ``exit_skipping_finalization``). Run as
``python tests/async_torchrun_scenarios.py SCENARIO OUT_FOLDER``; each rank writes ``OUT_FOLDER/rank<r>.json``.

* ``exit``: an asynchronous save with a slow writer, then the script ends at once: the process must wait for the
  commit (the writer is a non-daemon thread).
* ``exit_failed``: a complete asynchronous save, then one whose background write fails on rank 1 (a full disk: a
  real file-size limit), then the script ends without waiting: the process must exit non-zero with an ERROR naming
  the tag and the checkpoint that stays ``latest``.
* ``mixed``: ``zero_checkpoint_async`` on rank 0 only: the save must fail on every rank with an error naming the
  key, instead of rank 0 waiting in the creation of the writers' process group for a rank that never joins.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _engine(**config):
    import bitsandbytes as bnb
    import deepspeed
    import torch

    from zero_bnb.testing.toy import DEFAULT_RUN, build_engine, train_steps

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    engine = build_engine(int(os.environ["WORLD_SIZE"]), bnb.optim.Adam8bit, **config)
    train_steps(engine, DEFAULT_RUN, 0, 1)
    return engine


def exit_without_waiting(out_folder: str) -> dict:
    from zero_bnb.format import durable

    engine = _engine(zero_checkpoint_async=True)
    durable.set_io_hook(lambda event, path: time.sleep(0.05) if event == "write" else None)
    engine.save_checkpoint(os.path.join(out_folder, "ckpt"), tag="at_exit")
    return {"pending_at_exit": engine._zero_bnb_background.pending}  # the script ends here


def exit_with_a_failed_save(out_folder: str) -> dict:
    import resource
    import signal

    engine = _engine(zero_checkpoint_async=True)
    folder = os.path.join(out_folder, "ckpt")
    engine.save_checkpoint(folder, tag="good")
    engine.wait_for_checkpoint()
    if os.environ["RANK"] == "1":  # a full disk in this rank's writer: no file beyond 4 KiB (its result file is smaller)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    engine.save_checkpoint(folder, tag="lost")
    return {"pending_at_exit": engine._zero_bnb_background.pending}  # the script ends here, nothing waits


def mixed(out_folder: str) -> dict:
    rank = int(os.environ["RANK"])
    engine = _engine(zero_checkpoint_async=rank == 0)
    try:
        engine.save_checkpoint(os.path.join(out_folder, "ckpt"), tag="mixed")
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return {"raised": f"{type(error).__name__}: {error}"}
    return {"raised": None}


if __name__ == "__main__":
    scenario, out_folder = sys.argv[1], sys.argv[2]
    result = {"exit": exit_without_waiting, "exit_failed": exit_with_a_failed_save, "mixed": mixed}[scenario](
        out_folder)
    with open(os.path.join(out_folder, f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump(result, handle)
    from zero_bnb.testing.ranks import exit_skipping_finalization

    # The exit handlers run as at the interpreter's own exit (zero_bnb's wait for a pending save and its exit status
    # among them), then the process ends without finalization: not gloo's teardown race there (SIGABRT "terminate
    # called without an active exception", seen twice in one afternoon's full runs). "mixed" has no save pending.
    if scenario == "mixed":
        import torch.distributed as dist

        dist.destroy_process_group()
    exit_skipping_finalization()
