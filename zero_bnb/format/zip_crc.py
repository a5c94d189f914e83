"""torch.save without the zip format's CRC-32, for the calling thread only.

``torch.load`` never checks a record's CRC-32 (PyTorch's reader is built without the check) and zero_bnb verifies
every file by the digest in its manifest, so :mod:`zero_bnb.format.durable` writes ``torch.save`` files without it:
serialising is about three times cheaper. torch's own switch (``torch.serialization.set_crc32_options``) is
process-wide, and the user's code may ``torch.save`` files zero_bnb does not own at the same time (an asynchronous
save's writer thread runs beside training), so zero_bnb never touches it: at the first use it wraps
``torch.serialization.get_crc32_options``, which torch's zip writers ask once per file, to answer ``False`` inside
:func:`without_zip_crc32` blocks of the asking thread and torch's own setting everywhere else. Local.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["without_zip_crc32"]

_WRAP_LOCK = threading.Lock()
_THIS_THREAD = threading.local()


def _wrap_getter() -> bool:
    """Make ``torch.serialization.get_crc32_options`` answer ``False`` inside this module's blocks (once); whether
    this torch has the switch at all."""
    with _WRAP_LOCK:
        original = getattr(torch.serialization, "get_crc32_options", None)
        if original is None:
            return False
        if getattr(original, "_zero_bnb_per_thread", False):
            return True

        @functools.wraps(original)
        def get_crc32_options(*args: Any, **kwargs: Any) -> bool:
            if getattr(_THIS_THREAD, "depth", 0):
                return False
            return original(*args, **kwargs)

        get_crc32_options._zero_bnb_per_thread = True  # type: ignore[attr-defined]
        torch.serialization.get_crc32_options = get_crc32_options
        return True


@contextmanager
def without_zip_crc32() -> Iterator[None]:
    """``torch.save`` calls of this thread inside the block compute no CRC-32 per zip record (``torch.load`` never
    checks it; the manifest's digest covers every byte). Other threads' ``torch.save`` calls, meanwhile too, and
    torch's process-wide setting are untouched. Blocks nest."""
    if not _wrap_getter():
        yield
        return
    _THIS_THREAD.depth = getattr(_THIS_THREAD, "depth", 0) + 1
    try:
        yield
    finally:
        _THIS_THREAD.depth -= 1
