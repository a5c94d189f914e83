"""torch.save without the zip format's CRC-32, and the background writer that keeps it.

``torch.load`` never checks a record's CRC-32 (PyTorch's reader is built without the check) and zero_bnb verifies
every file by the SHA-256 in its manifest, so :mod:`zero_bnb.format.durable` writes ``torch.save`` files without it:
serialising is about three times cheaper. The switch (``torch.serialization.set_crc32_options``) is process-wide;
overlapping saves (threads) count their users, and an asynchronous save's background writer, which runs while the
user's own code may ``torch.save`` files zero_bnb does not own, leaves it alone (:func:`keeping_zip_crc32`). Local.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["keeping_zip_crc32", "without_zip_crc32"]

_crc32_lock = threading.Lock()
_crc32_users = 0
_crc32_previous = True
_crc32_kept = threading.local()


@contextmanager
def keeping_zip_crc32() -> Iterator[None]:
    """``save_torch`` calls of this thread inside the block leave torch's CRC-32 switch alone: a background writer
    (asynchronous saves) runs while the user's own code may ``torch.save`` files zero_bnb does not own, which must be
    written as torch writes them."""
    previous = getattr(_crc32_kept, "on", False)
    _crc32_kept.on = True
    try:
        yield
    finally:
        _crc32_kept.on = previous


@contextmanager
def without_zip_crc32() -> Iterator[None]:
    """``torch.save`` inside the block computes no CRC-32 per zip record (``torch.load`` never checks it; the
    manifest's SHA-256 covers every byte). The switch is process-wide: a ``torch.save`` another thread runs meanwhile
    writes no CRC-32 either (it loads all the same); the first of overlapping blocks (threads) turns it off, the last
    puts back what it found."""
    global _crc32_users, _crc32_previous
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None or getattr(_crc32_kept, "on", False):
        yield
        return
    with _crc32_lock:
        if _crc32_users == 0:
            _crc32_previous = get()
            set_(False)
        _crc32_users += 1
    try:
        yield
    finally:
        with _crc32_lock:
            _crc32_users -= 1
            if _crc32_users == 0:
                set_(_crc32_previous)
