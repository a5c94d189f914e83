"""Run a function on N local CPU processes with torch.distributed (gloo) and DeepSpeed.

Used by the elastic demo and the tests; real training launches use ``deepspeed`` or
``torchrun`` instead.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp

__all__ = ["init_worker", "run_distributed"]

logger = logging.getLogger(__name__)

#: Set in the parent before spawning, so each child's OpenMP runtime reads it when torch is first imported
#: (which happens while the child unpickles ``fn``, before :func:`init_worker` runs).
_CHILD_ENV = {"OMP_NUM_THREADS": "1"}


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
        **_CHILD_ENV,  # already set by run_distributed; processes started another way get it here
    )
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                               auto_mpi_discovery=False, verbose=False)


def _worker(rank: int, world_size: int, store: str, fn: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    # A native abort (SIGABRT, SIGSEGV) in a child would otherwise leave only "terminate called ..." behind:
    # dump every thread's Python stack to stderr first.
    faulthandler.enable(all_threads=True)
    # What unpickling fn imported (torch, DeepSpeed, bitsandbytes: about 400k objects) lives as long as the process;
    # frozen, the cyclic collector skips it, so each collection costs what the run allocates since. DeepSpeed collects
    # explicitly: its BF16_Optimizer eight times per engine (see_memory_usage(force=True)), 3.6 s of 3.8 s per build.
    gc.freeze()
    init_worker(rank, world_size, store)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        # Logged before the process group is torn down, so the cause survives a teardown that dies natively.
        logger.exception("rank %d of %d failed in %s", rank, world_size, getattr(fn, "__name__", fn))
        raise
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in _CHILD_ENV}
    os.environ.update(_CHILD_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``fn`` must be importable (a module-level function). Each process joins a gloo process
    group through ``deepspeed.init_distributed``; a child's exception is re-raised here.
    """
    with tempfile.TemporaryDirectory(prefix="zero_bnb_rendezvous_") as folder, _child_environment():
        store = os.path.join(folder, "store")
        mp.start_processes(_worker, args=(world_size, store, fn, args), nprocs=world_size, start_method="spawn")
