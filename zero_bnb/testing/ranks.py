"""One rank of a local multi-process launch: its environment, its process group, and how it ends.

Shared by :mod:`zero_bnb.testing.launch` (spawned ranks) and :mod:`zero_bnb.testing.warm` (ranks forked by a warm
server). CPU ranks stay on the CPU on a machine with GPUs too (see :data:`DEVICES`).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["DEEPSPEED_LAZY_MODULES", "DEVICES", "SHM_COMM_OP", "build_shm_comm_op", "child_environment",
           "child_environment_for", "exit_skipping_finalization", "exit_status", "gpus_missing", "init_worker", "run_rank",
           "warm_up_deepspeed"]

logger = logging.getLogger(__name__)

#: Set in the parent before spawning, so each child reads it before it first imports torch (which happens while
#: the child unpickles ``fn``, before :func:`init_worker` runs): OpenMP's thread count, CUDA's visible devices and
#: DeepSpeed's accelerator are all fixed at first use.
_CHILD_ENV = {
    "cpu": {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""},
    "cuda": {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cuda"},
    "cuda-shared": {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cuda"},
}
_BACKEND = {"cpu": "gloo", "cuda": "nccl", "cuda-shared": "gloo"}
#: Where the ranks run: ``"cpu"`` (gloo, DeepSpeed's CPU accelerator, no CUDA device visible), ``"cuda"`` (nccl, rank
#: r on ``cuda:r``) or ``"cuda-shared"`` (every rank on ``cuda:0`` over gloo, which takes CUDA tensors where nccl
#: refuses two ranks on one device: DP > 1 on a one-GPU machine; ``LOCAL_RANK`` is 0 on every rank, so DeepSpeed's
#: per-rank device binding gives each the same device).
DEVICES = tuple(_CHILD_ENV)


#: DeepSpeed's name of its CPU shared-memory communication op (``ShareMemCommBuilder.NAME``).
SHM_COMM_OP = "deepspeed_shm_comm"


#: What DeepSpeed imports lazily in every process that builds an engine: its Muon optimizer's module (ZeRO's gradient
#: reduction imports it on the first step, for an ``isinstance``) and its AutoEP configuration (its config parser).
DEEPSPEED_LAZY_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_config",
                          "deepspeed.module_inject.auto_ep_layer")


def warm_up_deepspeed() -> None:
    """In a server that forks CPU ranks (its environment already :func:`child_environment_for` ``("cpu")``), before it
    forks: import :data:`DEEPSPEED_LAZY_MODULES` and probe DeepSpeed's ops once (compiler runs), its shared-memory op
    off as :func:`init_worker` sets it, so that every forked rank inherits both instead of redoing them: a quarter of
    the CPU of a front-door kill trial (tests/front_door_kills.py: 63 s -> 48 s for Trainer's 58 trials, 2 cores)."""
    import deepspeed

    for name in DEEPSPEED_LAZY_MODULES:
        importlib.import_module(name)
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def build_shm_comm_op() -> str:
    """JIT-build (or find in torch's extension cache) DeepSpeed's shared-memory communication op for CPU ranks, as the
    first CPU start of a script outside the tests' launcher (a ``torchrun`` or ``deepspeed`` launch) would; returns
    the built module's path. ``scripts/test.sh`` calls it in a process of its own before the workers start: the build
    (about 40 s and 75 CPU-s on a 2-core machine) then never runs under a test that may kill its process, and never
    holds torch's extension lock, which has no timeout, while other tests' ranks wait on it."""
    with child_environment("cpu"):
        from deepspeed.accelerator import get_accelerator

        return get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False).__file__


def child_environment_for(device: str) -> dict[str, str]:
    """The environment variables :func:`run_distributed` gives its children for ``device`` (a copy)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {list(DEVICES)}, got {device!r}")
    return dict(_CHILD_ENV[device])


def gpus_missing(world_size: int) -> str | None:
    """Why ``world_size`` GPU ranks cannot run here (a reason for ``pytest.skip``), or ``None`` when they can."""
    import torch

    if not torch.cuda.is_available():
        return f"needs {world_size} CUDA device(s); this machine has none"
    if torch.cuda.device_count() < world_size:
        return f"needs {world_size} CUDA devices, one per rank; this machine has {torch.cuda.device_count()}"
    return None


def init_worker(rank: int, world_size: int, store: str, device: str = "cpu") -> None:
    """Join a process group (gloo for ``"cpu"`` and ``"cuda-shared"``, nccl for ``"cuda"``) through
    ``deepspeed.init_distributed``,
    rendezvous by file.

    A file rendezvous (``store``: a path no process group has used) avoids picking a TCP port
    that another process may take before the group binds it. Processes not started by
    :func:`run_distributed` get its environment here, before torch first touches CUDA.

    DeepSpeed's shared-memory all-reduce op (used only by its inference all-reduce) is not loaded: a CPU start
    otherwise JIT-builds it under torch's extension lock, which has no timeout, so a rank killed during the build (the
    fault campaign kills ranks) would leave every later CPU start on the machine waiting for ever.
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        LOCAL_RANK=str(0 if device == "cuda-shared" else rank),  # cuda-shared: DeepSpeed binds every rank to cuda:0
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        **child_environment_for(device),
    )
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    if device == "cuda":
        torch.cuda.set_device(rank)
    elif device == "cuda-shared":
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend=_BACKEND[device], init_method=f"file://{store}", rank=rank,
                               world_size=world_size, auto_mpi_discovery=False, verbose=False)


def exit_status(exit: SystemExit) -> int:
    """The exit status ``sys.exit(code)`` gives a script: an int as it is, ``None`` 0, anything else 1 (Python
    prints it)."""
    return exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1


def exit_skipping_finalization(code: int = 0) -> None:
    """End a rank whose work is done and whose process group is destroyed, without interpreter finalization.

    torch's gloo worker threads may still drop their last reference to a finished collective's tensors while Python
    finalizes; taking the GIL then ends the thread, and the unwind through a ``noexcept`` frame aborts the process
    ("terminate called without an active exception", SIGABRT: seen in a core dump of a torchrun scenario, about once
    in 30 launches on a loaded 2-core machine). Non-daemon threads are joined and the ``atexit`` handlers run first (zero_bnb's report of a lost
    asynchronous save may still turn the exit status into 1), then logs and standard streams are flushed. Every rank
    calls it.
    """
    threading._shutdown()  # the non-daemon threads first, as the interpreter's own exit does
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_rank(rank: int, world_size: int, store: str, fn: Callable[..., Any], args: tuple, device: str) -> None:
    """One rank of a launch: join the process group, run ``fn(rank, world_size, *args)``, wait for the other ranks,
    and end the process (:func:`exit_skipping_finalization`); an exception is logged and re-raised. Every rank calls
    it, in a process of its own."""
    import torch.distributed as dist

    # A native abort (SIGABRT, SIGSEGV) in a child would otherwise leave only "terminate called ..." behind:
    # dump every thread's Python stack to stderr first.
    faulthandler.enable(all_threads=True)
    # What unpickling fn imported (torch, DeepSpeed, bitsandbytes: about 400k objects) lives as long as the process;
    # frozen, the cyclic collector skips it, so each collection costs what the run allocates since. DeepSpeed collects
    # explicitly: its BF16_Optimizer eight times per engine (see_memory_usage(force=True)), 3.6 s of 3.8 s per build.
    gc.freeze()
    init_worker(rank, world_size, store, device)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException as error:
        # when it failed (CLOCK_MONOTONIC is system-wide): a warm launch reports the rank that failed first, not a
        # peer whose collective broke because of it (zero_bnb.testing.warm)
        error.zero_bnb_failed_at = time.monotonic()
        # Logged before the process group is torn down, so the cause survives a teardown that dies natively.
        logger.exception("rank %d of %d failed in %s", rank, world_size, getattr(fn, "__name__", fn))
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    exit_skipping_finalization()


@contextlib.contextmanager
def child_environment(device: str) -> Iterator[None]:
    """The variables of :func:`child_environment_for` set in this process while the block runs."""
    values = child_environment_for(device)
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
