"""Device-independent memory measurements, for memory tests and benchmarks that must work on CPU as on GPU.

- :func:`live_storage_bytes`: what is kept. It sums, over every tensor object the cyclic collector tracks (every
  Python-visible tensor: parameters, gradients, optimizer state, DeepSpeed's flat buffers and their views), the bytes
  of each distinct storage once, optionally on one device type. It counts what Python keeps alive, wherever it
  lives, so an engine that keeps an extra buffer (or a load that leaves replaced state reachable) shows it on the CPU
  too, where ``torch.cuda.memory_allocated`` does not exist. Tensors only C++ holds (autograd's saved tensors
  between forward and backward) are not seen; measure between steps.
- :class:`AllocationTimeline`: the peak inside a phase. PyTorch's allocators (the CPU allocator and CUDA's caching
  allocator) report every allocation and free to the profiler while ``profile_memory`` is on; the timeline adds
  them up in time order, so a phase's peak includes the transient buffers that :func:`live_storage_bytes` never
  sees (gradient buckets, flattened copies, a save's CPU copies, a load's read buffers, autograd's saved tensors).
  Checked against :func:`live_storage_bytes` at the end of each phase and against known allocations in
  ``tests/test_census.py``.

Local: no collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator

import torch

__all__ = ["AllocationTimeline", "PhaseMemory", "live_storage_bytes"]

_PHASE_PREFIX = "zero_bnb.census.phase:"
_MAPPED = "zero_bnb.census.mapped_file"
_RECONCILE = "zero_bnb.census.reconcile:"


def live_storage_bytes(device_type: str | None = None) -> int:
    """Bytes of the distinct storages of every live tensor (after a collection), on ``device_type`` if given."""
    return sum(_live_storages(device_type).values())


def _live_storages(device_type: str | None) -> dict[tuple[str, int], int]:
    """(device, data pointer) -> bytes of every distinct storage of a live tensor, after a collection."""
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
    return seen


@dataclasses.dataclass(frozen=True, slots=True)
class PhaseMemory:
    """Bytes allocated on the timeline's device, net of frees, counted from the timeline's start."""

    peak_bytes: int
    """The most at any moment from the phase's start to its end (at least what was allocated when it started)."""
    end_bytes: int
    """What was allocated when the phase ended."""
    mapped_peak_bytes: int = 0
    """The most bytes of memory-mapped files (``torch.load(mmap=True)``) open at once during the phase: page
    cache, read only where touched, counted apart from ``peak_bytes``."""


class AllocationTimeline:
    """Net allocation over time and its peak per phase, from the allocator events of PyTorch's profiler.

    Use::

        with AllocationTimeline("cpu") as timeline:
            with timeline.phase("construction"):
                engine = build()
            with timeline.phase("step"):
                train_step(engine)
        timeline.phases()  # {"construction": PhaseMemory(...), "step": PhaseMemory(...)}

    Every figure counts from the timeline's start: start it before the objects it should attribute are made.
    Storages mapped from files (``torch.UntypedStorage.from_file``, which ``torch.load(mmap=True)`` uses, is
    labelled while the timeline runs) are counted apart, in ``mapped_peak_bytes``. Limits, from the profiler: a
    block allocated before the start and freed inside is not subtracted (the profiler does not know its size;
    figures then err high, never low); only allocations made by the thread that entered the timeline, or by
    threads that carry its profiler state (autograd's), are seen; memory that bypasses PyTorch's allocators
    (gloo's or NumPy's own buffers) is not. Profiling every operator costs time: measure memory and speed in
    separate runs. Not reentrant. Local: no collectives.

    A block released on another thread (a collective's buffer whose last reference a communication thread drops)
    frees unseen, and would count as allocated from then on. :meth:`reconcile` fixes that: called where every block
    still in use is held by a live tensor (between steps, once the collectives issued have completed), it closes
    every block the timeline holds open that no live tensor uses.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"AllocationTimeline(device_type={device_type!r}): only 'cpu' and 'cuda' allocators "
                             "report to the profiler; pass one of them")
        self.device_type = device_type
        self._profile: torch.profiler.profile | None = None
        self._from_file = None
        self._phases: dict[str, PhaseMemory] | None = None
        self._in_use: list[frozenset[int]] = []

    def __enter__(self) -> AllocationTimeline:
        if torch._C._autograd._profiler_enabled():
            raise RuntimeError("AllocationTimeline needs PyTorch's profiler to itself, but a profiler (another "
                               "timeline, or a torch.profiler.profile) is already running in this thread; end it "
                               "first, or mark phases with phase() inside one timeline")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._from_file = torch.UntypedStorage.__dict__.get("from_file")  # None: inherited from the C base
        original = torch.UntypedStorage.from_file

        def labelled_from_file(cls, *args, **kwargs):
            with torch.profiler.record_function(_MAPPED):
                return original(*args, **kwargs)

        torch.UntypedStorage.from_file = classmethod(labelled_from_file)
        self._profile = torch.profiler.profile(activities=activities, profile_memory=True)
        try:
            self._profile.__enter__()
        except BaseException:
            self._restore_from_file()
            raise
        return self

    def _restore_from_file(self) -> None:
        if self._from_file is None:
            del torch.UntypedStorage.from_file
        else:
            torch.UntypedStorage.from_file = self._from_file

    def __exit__(self, *exc_info) -> None:
        assert self._profile is not None
        try:
            self._profile.__exit__(*exc_info)
        finally:
            self._restore_from_file()
        if exc_info[0] is None:  # the profiler's event tree (torch._C._profiler), as of torch 2.13
            self._phases = self._tally(self._profile.profiler.kineto_results.experimental_event_tree())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark the code inside as phase ``name`` (names must be unique within a timeline)."""
        with torch.profiler.record_function(_PHASE_PREFIX + name):
            yield

    def reconcile(self) -> None:
        """Close every block allocated on this timeline that no live tensor uses now (its free was not seen).

        Call where nothing but live tensors holds memory of the device: between steps, after a barrier."""
        in_use = frozenset(ptr for _, ptr in _live_storages(self.device_type))
        with torch.profiler.record_function(f"{_RECONCILE}{len(self._in_use)}"):
            self._in_use.append(in_use)

    def phases(self) -> dict[str, PhaseMemory]:
        """Peak and end bytes of every phase, in the order they started; available once the timeline has ended."""
        if self._phases is None:
            raise RuntimeError("AllocationTimeline.phases() is available once the `with` block has ended "
                               "without an exception")
        return dict(self._phases)

    def _tally(self, roots) -> dict[str, PhaseMemory]:
        events: list[tuple[int, int, int, bool]] = []  # (time, ptr, bytes, inside a file mapping); ptr -1: reconcile
        windows: list[tuple[int, int, str]] = []
        stack = [(root, False) for root in roots]
        while stack:
            node, mapped = stack.pop()
            fields = node.extra_fields
            if type(fields).__name__ == "_ExtraFields_Allocation":
                if fields.device.type == self.device_type:
                    events.append((node.start_time_ns, fields.ptr, fields.alloc_size, mapped))
            elif node.name.startswith(_PHASE_PREFIX):
                windows.append((node.start_time_ns, node.end_time_ns, node.name[len(_PHASE_PREFIX):]))
            elif node.name.startswith(_RECONCILE):
                events.append((node.start_time_ns, -1, int(node.name[len(_RECONCILE):]), False))
            stack += [(child, mapped or node.name == _MAPPED) for child in node.children]
        events.sort(key=lambda event: event[0])
        windows.sort()
        names = [name for _, _, name in windows]
        if len(set(names)) != len(names):
            raise ValueError(f"AllocationTimeline: phase names must be unique, got {names}")
        # (time, allocated delta, mapped delta); a block is mapped or not as when it was allocated
        deltas: list[tuple[int, int, int]] = []
        open_blocks: dict[int, tuple[int, bool]] = {}

        def close(when: int, ptr: int) -> None:
            nbytes, mapped = open_blocks.pop(ptr)
            deltas.append((when, 0, -nbytes) if mapped else (when, -nbytes, 0))

        for when, ptr, nbytes, mapped in events:
            if ptr == -1:  # reconcile: blocks no live tensor uses were freed unseen
                for unused in [p for p in open_blocks if p not in self._in_use[nbytes]]:
                    close(when, unused)
            elif nbytes > 0:
                if ptr in open_blocks:  # the address is reused: its previous block was freed unseen
                    close(when, ptr)
                open_blocks[ptr] = (nbytes, mapped)
                deltas.append((when, 0, nbytes) if mapped else (when, nbytes, 0))
            elif ptr in open_blocks:  # else a block from before the timeline: its size is unknown
                close(when, ptr)
        phases = {}
        for start, end, name in windows:
            level = sum(allocated for when, allocated, _ in deltas if when < start)
            mapped_level = sum(mapped for when, _, mapped in deltas if when < start)
            peak, mapped_peak = level, mapped_level
            for when, allocated, mapped in deltas:
                if start <= when <= end:
                    level += allocated
                    mapped_level += mapped
                    peak, mapped_peak = max(peak, level), max(mapped_peak, mapped_level)
            phases[name] = PhaseMemory(peak_bytes=peak, end_bytes=level, mapped_peak_bytes=mapped_peak)
        return phases
