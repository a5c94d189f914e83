"""Rebinding DeepSpeed's module-level names for the duration of a call: how zero_bnb has DeepSpeed build its
subclasses (the engine, the ZeRO optimizer wrappers) without copying DeepSpeed's constructor calls. Local; serialised
by a process-wide lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["swapped_attribute"]

_PATCH_LOCK = threading.RLock()


@contextmanager
def swapped_attribute(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """Rebind ``owner.name`` for the duration of a ``with`` block (serialised by a lock).

    DeepSpeed builds its engine and ZeRO optimizer from module-level names; this is how
    zero_bnb substitutes its subclasses without copying DeepSpeed's constructor calls.
    """
    if not hasattr(owner, name):
        raise RuntimeError(
            f"{getattr(owner, '__name__', owner)} has no attribute {name!r}: this DeepSpeed version is outside "
            f"zero_bnb's supported range (see pyproject.toml)"
        )
    with _PATCH_LOCK:
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        try:
            yield
        finally:
            setattr(owner, name, original)
