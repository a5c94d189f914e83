"""A device-independent census of live tensor storage, for memory tests that must fail on CPU as on GPU.

:func:`live_storage_bytes` sums, over every tensor object the cyclic collector tracks (every Python-visible
tensor: parameters, gradients, optimizer state, DeepSpeed's flat buffers and their views), the bytes of each
distinct storage once, optionally on one device type. It counts what Python keeps alive, wherever it lives, so an
engine that keeps an extra buffer (or a load that leaves replaced state reachable) shows it on the CPU too, where
``torch.cuda.memory_allocated`` does not exist. Tensors only C++ holds (autograd's saved tensors between forward
and backward) are not seen; measure between steps.

Local: no collectives.
"""

from __future__ import annotations

import gc

import torch

__all__ = ["live_storage_bytes"]


def live_storage_bytes(device_type: str | None = None) -> int:
    """Bytes of the distinct storages of every live tensor (after a collection), on ``device_type`` if given."""
    gc.collect()
    seen: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass or sparse tensor without one storage
            continue
        if device_type is not None and storage.device.type != device_type:
            continue
        key = (str(storage.device), storage.data_ptr())
        if key[1]:
            seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())
