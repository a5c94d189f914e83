"""Run a function on N local CPU processes with torch.distributed (gloo) and DeepSpeed.

Used by the elastic demo and the tests; real training launches use ``deepspeed`` or
``torchrun`` instead.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["init_worker", "run_distributed"]


def init_worker(rank: int, world_size: int, store: str) -> None:
    """Join a gloo process group through ``deepspeed.init_distributed``, rendezvous by file.

    A file rendezvous (``store``: a path no process group has used) avoids picking a TCP port
    that another process may take before the group binds it.
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                               auto_mpi_discovery=False, verbose=False)


def _worker(rank: int, world_size: int, store: str, fn: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    init_worker(rank, world_size, store)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``fn`` must be importable (a module-level function). Each process joins a gloo process
    group through ``deepspeed.init_distributed``; a child's exception is re-raised here.
    """
    with tempfile.TemporaryDirectory(prefix="zero_bnb_rendezvous_") as folder:
        store = os.path.join(folder, "store")
        mp.start_processes(_worker, args=(world_size, store, fn, args), nprocs=world_size, start_method="spawn")
