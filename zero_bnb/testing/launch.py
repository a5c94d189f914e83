"""Run a function on N local processes with torch.distributed and DeepSpeed: CPU ranks (gloo) or one per GPU (nccl).

Used by the elastic demo, the tests and the benchmarks; real training launches use ``deepspeed`` or
``torchrun`` instead. CPU ranks stay on the CPU on a machine with GPUs too: their children see no CUDA
device and use DeepSpeed's CPU accelerator (otherwise DeepSpeed's CUDA accelerator gives rank r the
device ``cuda:r``, which a machine with fewer GPUs than ranks lacks and gloo cannot reduce-scatter).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from zero_bnb.testing import warm
from zero_bnb.testing.ranks import (
    DEVICES,
    SHM_COMM_OP,
    child_environment,
    child_environment_for,
    exit_skipping_finalization,
    gpus_missing,
    init_worker,
    run_rank,
)

__all__ = ["DEVICES", "SHM_COMM_OP", "child_environment", "child_environment_for", "exit_skipping_finalization",
           "gpus_missing", "init_worker", "launches", "run_distributed", "run_rank"]

_launches = 0


def launches() -> int:
    """How many launches :func:`run_distributed` started in this process (tests/conftest.py's ``launch`` marker
    check)."""
    return _launches


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (CPU ranks are forked by a warm server
    instead where ``ZERO_BNB_WARM_LAUNCH=1``, as in the test suite: :mod:`zero_bnb.testing.warm`).

    ``fn`` must be importable (a module-level function). Each process joins a process group
    through ``deepspeed.init_distributed``; a child's exception is re-raised here.
    ``device="cpu"`` (the default) keeps every rank on the CPU whatever GPUs the machine has;
    ``device="cuda"`` puts rank r on ``cuda:r`` with nccl; ``device="cuda-shared"`` puts every rank on ``cuda:0``
    with gloo (:data:`~zero_bnb.testing.ranks.DEVICES`).

    Raises:
        ValueError: an unknown ``device``, fewer CUDA devices than ranks for ``"cuda"``, none for ``"cuda-shared"``.
    """
    if device != "cpu" and (reason := gpus_missing(world_size if device == "cuda" else 1)) is not None:
        raise ValueError(f"run_distributed(device={device!r}) {reason}; use device=\"cpu\""
                         + (" or fewer ranks" if device == "cuda" else ""))
    global _launches
    _launches += 1
    if device == "cpu" and warm.warm_enabled():
        warm.run_warm(fn, world_size, args)
        return
    with tempfile.TemporaryDirectory(prefix="zero_bnb_rendezvous_") as folder, child_environment(device):
        store = os.path.join(folder, "store")
        mp.start_processes(run_rank, args=(world_size, store, fn, args, device), nprocs=world_size,
                           start_method="spawn")
