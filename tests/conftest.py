"""Suite-wide pytest hooks."""

from __future__ import annotations

import gc


def pytest_collection_finish(session) -> None:
    """Freeze what collection imported (torch, DeepSpeed, bitsandbytes, transformers, Lightning: about half a million
    objects that live as long as the run) out of the cyclic collector: each collection then costs what the tests
    allocate. DeepSpeed's zero_to_fp32 collects once per file it writes, 1.3 to 1.9 s each on this suite's heap
    (tests/test_stage3.py calls it in process). Spawned workers do the same (zero_bnb.testing.launch)."""
    gc.freeze()
