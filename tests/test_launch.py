"""The test launcher itself: a child that dies natively leaves its Python stack behind, and every child's
OpenMP runtime starts with one thread (the environment is set before the child imports torch)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException

from zero_bnb.testing.launch import run_distributed


def abort_natively_on_rank_1(rank: int, world_size: int, folder: str) -> None:
    """Rank 1 aborts the way a C++ ``std::terminate`` does (SIGABRT); rank 0 records its start-up environment."""
    with open(os.path.join(folder, f"env{rank}"), "w") as handle:
        handle.write(os.environ.get("OMP_NUM_THREADS", "unset"))
    dist.barrier()
    if rank == 1:
        os.abort()
    dist.barrier()


def test_a_native_abort_in_a_child_prints_its_python_stack(tmp_path, capfd):
    # CI once lost a rank to "terminate called without an active exception" with nothing else to go on.
    before = os.environ.get("OMP_NUM_THREADS")
    with pytest.raises(ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
        run_distributed(abort_natively_on_rank_1, 2, str(tmp_path))
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err, err[-2000:]
    assert "in abort_natively_on_rank_1" in err, err[-2000:]
    assert [(tmp_path / f"env{rank}").read_text() for rank in (0, 1)] == ["1", "1"]
    assert os.environ.get("OMP_NUM_THREADS") == before  # the parent's environment is restored
