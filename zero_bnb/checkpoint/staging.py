"""Host staging for asynchronous saves: a snapshot of what a save writes, in buffers reused between saves.

An asynchronous save (``zero_checkpoint_async``) returns once every tensor it will write is copied into host
memory that training does not touch; the files are written from that copy in the background. The copies go into
:class:`StagingPool`'s buffers, one per tensor, allocated at the first save and reused by every later save of the
same shapes (pinned host memory when the tensor is on an accelerator, so that the device-to-host copies are
asynchronous DMA; plain memory for CPU tensors). A buffer holds exactly its tensor's bytes, so ``torch.save`` of a
staged tensor writes what it would have written for the original; tensors that share memory (tied weights) stay
shared. Non-tensor values are deep-copied, so a ``client_state`` changed after the call does not reach the files.

A synchronous save stages through :class:`InlineStaging` instead, which copies nothing ahead.

Local: no collectives. Not thread-safe: one save stages at a time (the engine waits for the previous save first).
"""

from __future__ import annotations

import copy
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from zero_bnb.checkpoint.save import copy_to_cpu

__all__ = ["InlineStaging", "StagingPool", "StagingLimitError"]

logger = logging.getLogger(__name__)


class StagingLimitError(RuntimeError):
    """A save would stage more bytes than ``zero_checkpoint_async_max_staging_mb`` allows."""


def _pinnable(tensor: torch.Tensor) -> bool:
    """Whether a host copy of ``tensor`` should be pinned: it lives on a CUDA device (whose copies
    :meth:`StagingPool.copies_done` waits for with a CUDA event)."""
    return tensor.device.type == "cuda"


def _distinct_mib(limit: int, needed: int) -> tuple[str, str]:
    """``limit`` and ``needed`` bytes in MiB with the fewest significant digits (at least 4) that tell them apart: a
    limit of 0.1 MiB and a save of 0.1000038 MiB do not both read "0.1"."""
    for digits in range(4, 17):
        shown = f"{limit / 2**20:.{digits}g}", f"{needed / 2**20:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return shown


@dataclass
class StagingPool:
    """Host buffers for the tensors of successive saves, matched by position and shape.

    Attributes:
        limit_bytes: the most bytes one save may stage (``None``: no limit). Checked before a buffer is
            allocated, so a save over the limit fails before it holds more memory than the limit.
    """

    limit_bytes: int | None = None
    _buffers: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)
    _cursor: int = field(default=0, init=False, repr=False)
    _staged_bytes: int = field(default=0, init=False, repr=False)
    #: (device, storage address, bytes) -> (the staged copy, the source, kept so its address stays taken)
    _shared: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False, repr=False)
    _device_copies: bool = field(default=False, init=False, repr=False)

    @property
    def held_bytes(self) -> int:
        """Bytes of host memory the pool keeps between saves."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers)

    @property
    def staged_bytes(self) -> int:
        """Bytes staged by the current (or last) save."""
        return self._staged_bytes

    def begin(self) -> None:
        """Start staging a new save: buffers are handed out again from the first."""
        self._cursor = 0
        self._staged_bytes = 0
        self._shared = {}
        self._device_copies = False

    def release(self) -> None:
        """Free every buffer (they are allocated again by the next save)."""
        self._buffers = []
        self._shared = {}

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """The next buffer of this save, reused when the last save had one of this shape, dtype and pinning."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.limit_bytes is not None and self._staged_bytes + nbytes > self.limit_bytes:
            needed = self._staged_bytes + nbytes
            limit_mib, needed_mib = _distinct_mib(self.limit_bytes, needed)
            raise StagingLimitError(
                f"this save stages more than zero_checkpoint_async_max_staging_mb allows: the limit is {limit_mib} MiB "
                f"({self.limit_bytes} bytes), this save needs at least {needed_mib} MiB ({needed} bytes, "
                f"{needed - self.limit_bytes} over)")
        buffer = self._buffers[self._cursor] if self._cursor < len(self._buffers) else None
        if buffer is None or buffer.dtype != dtype or tuple(buffer.shape) != shape or buffer.is_pinned() != pin:
            buffer = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
            if self._cursor < len(self._buffers):
                self._buffers[self._cursor] = buffer
            else:
                self._buffers.append(buffer)
        self._cursor += 1
        self._staged_bytes += nbytes
        self._device_copies |= pin
        return buffer

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        """A compact host copy of ``value`` in a reused buffer (same dtype, shape and values; contiguous).

        A device tensor's copy is queued on the current stream (see :meth:`copies_done`)."""
        value = value.detach()
        pin = _pinnable(value)
        buffer = self._buffer(tuple(value.shape), value.dtype, pin)
        buffer.copy_(value, non_blocking=pin)
        return buffer

    def master(self, value: torch.Tensor) -> torch.Tensor:
        """A group's master weights: staged whole like any tensor (the writer decides whether they derive)."""
        return self.tensor(value)

    def view_or_copy(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as a view of this save's staged copy of its storage if :meth:`snapshot` staged that storage
        already (no second copy of the same bytes), else :meth:`tensor`'s compact copy."""
        value = value.detach()
        storage = value.untyped_storage()
        entry = self._shared.get((value.device, storage.data_ptr(), storage.nbytes()))
        if entry is None:
            return self.tensor(value)
        return torch.empty(0, dtype=value.dtype).set_(entry[0].untyped_storage(), value.storage_offset(),
                                                      value.shape, value.stride())

    def _same_storage(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as a view of a host copy of its whole storage (one copy per storage), so that ``torch.save``
        writes exactly what it writes for the original: the same storages, shared where they were."""
        value = value.detach()
        storage = value.untyped_storage()
        key = (value.device, storage.data_ptr(), storage.nbytes())
        entry = self._shared.get(key)
        if entry is None:
            pin = _pinnable(value)
            copied = self._buffer((storage.nbytes(),), torch.uint8, pin)
            source = torch.empty(0, dtype=torch.uint8, device=value.device).set_(storage)
            copied.copy_(source, non_blocking=pin)
            # The source is kept until the staging ends: a freed one's address could be reused by a new tensor.
            entry = self._shared[key] = (copied, value)
        copied = entry[0]
        return torch.empty(0, dtype=value.dtype).set_(copied.untyped_storage(), value.storage_offset(),
                                                      value.shape, value.stride())

    def snapshot(self, obj: Any) -> Any:
        """``obj`` with every tensor replaced by a view of a staged copy of its storage, every other value deep-copied.

        dicts (their type and attributes kept: an ``OrderedDict`` state dict's ``_metadata``), lists and tuples are walked; anything else is
        ``copy.deepcopy``-ed (a tensor inside such an object is copied where it lives, not staged)."""
        if isinstance(obj, torch.Tensor):
            return self._same_storage(obj) if obj.device.type != "meta" else obj.detach().clone()
        if type(obj) is OrderedDict:
            copied = OrderedDict((key, self.snapshot(value)) for key, value in obj.items())
            copied.__dict__.update(copy.deepcopy(vars(obj)))  # a state dict's _metadata (module versions)
            return copied
        if type(obj) is dict:
            return {key: self.snapshot(value) for key, value in obj.items()}
        if type(obj) is list:
            return [self.snapshot(value) for value in obj]
        if type(obj) is tuple:
            return tuple(self.snapshot(value) for value in obj)
        return copy.deepcopy(obj)

    def trim(self) -> None:
        """End this save's staging: drop buffers it did not use (a model that shrank between saves) and the
        references to the staged sources."""
        del self._buffers[self._cursor:]
        self._shared = {}

    def copies_done(self) -> Any:
        """A marker of this save's queued device-to-host copies, recorded on the current stream: the writer calls
        its ``synchronize()`` before reading the buffers (``None`` when every copy was synchronous). Call from the
        thread that staged, after the last :meth:`tensor`."""
        if not self._device_copies:
            return None
        event = torch.cuda.Event()
        event.record()
        return event


class InlineStaging:
    """The staging of a synchronous save, which writes before training goes on: nothing is copied ahead. Tensors of
    the optimizer files become compact CPU tensors (:func:`~zero_bnb.checkpoint.save.copy_to_cpu`: themselves where
    they already are); the master weights and module weights stay views where they live (on a GPU too: the writer
    copies one group at a time to the host to decide how its masters are stored, and the masters kept whole when it
    writes them), so a save holds no host copy of masters that derive; DeepSpeed's objects are written as they are.

    The same methods as :class:`StagingPool`, so one save algorithm serves both (:mod:`zero_bnb.checkpoint.staged`).
    """

    def begin(self) -> None:
        """Nothing to start."""

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        return copy_to_cpu(value)

    def master(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach()

    def view_or_copy(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach()

    def snapshot(self, obj: Any) -> Any:
        return obj

    def trim(self) -> None:
        """Nothing to trim."""

    def copies_done(self) -> None:
        return None
