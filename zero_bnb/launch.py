"""Run a function on N local CPU processes with torch.distributed (gloo) and DeepSpeed.

Used by the elastic demo and the tests; real training launches use ``deepspeed`` or
``torchrun`` instead.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "run_distributed"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
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
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, start_method="spawn")
