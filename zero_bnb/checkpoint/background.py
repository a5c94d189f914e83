"""Asynchronous saves: the writing, checksumming, fsync and commit of a staged checkpoint in a background thread.

With ``zero_checkpoint_async`` an engine's ``save_checkpoint`` stages everything it will write
(:mod:`zero_bnb.checkpoint.staging`) and hands :class:`BackgroundSaver` the rest of the save: the writes into the
save's staging folder and the collective commit of :class:`~zero_bnb.checkpoint.commit.SaveTransaction`, which
publishes the folder and moves ``latest`` only when every rank's files are durable and agreed. The commit's
collectives run on a process group of their own (gloo, created at the first asynchronous save), so they never
interleave with training's collectives.

What this changes for a user:

* the checkpoint holds the state at the call, never a later step's;
* a failure in the background (a full disk, a killed rank, a write error) leaves the previous checkpoint and
  ``latest`` as they were; it is logged at once and raised by the next ``save_checkpoint``,
  ``load_checkpoint`` or :meth:`BackgroundSaver.wait` (``engine.wait_for_checkpoint()``);
* a second save, a load, ``engine.destroy()``, ``torch.distributed.destroy_process_group()`` and the end of the
  process wait for a pending save; so do another engine's save into the same folder (the pending save holds the
  folder's lock until it commits) and its load from that folder (:func:`~zero_bnb.checkpoint.pending.join_saves_into`).
  The writer is one ``concurrent.futures`` worker per engine (joined before the process ends, like a non-daemon
  thread), its ``Future`` carrying the save's outcome; what all engines' saves share (the registry,
  ``destroy_process_group`` waiting first, the end-of-process report) is :mod:`zero_bnb.checkpoint.pending`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import torch.distributed as dist

from zero_bnb.checkpoint import pending
from zero_bnb.checkpoint.staging import StagingPool
from zero_bnb.errors import CheckpointSaveError, CheckpointUsageError

__all__ = ["BackgroundSaver", "check_same_switch"]

logger = logging.getLogger(__name__)


def check_same_switch(asynchronous: bool) -> None:
    """Check that every rank has the same ``zero_checkpoint_async``. Collective over the world: every rank must call
    it (an engine does at its first save, before anything is written).

    The asynchronous writers commit on a process group of their own, created by every rank at the first
    asynchronous save; a rank saving synchronously would never join it, and the others would wait for it.

    Raises:
        CheckpointUsageError: on every rank, naming the ranks of each setting.
    """
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(asynchronous))
    if len(set(flags)) > 1:
        on = [rank for rank, flag in enumerate(flags) if flag]
        off = [rank for rank, flag in enumerate(flags) if not flag]
        raise CheckpointUsageError(
            f"zero_checkpoint_async is true on rank(s) {on} and false on rank(s) {off}: every rank must save the "
            f"same way (the asynchronous writers commit together on a process group every rank joins at the "
            f"first asynchronous save). Nothing was written. Give every rank the same DeepSpeed config"
        )


def _lowest_cpu_priority() -> None:
    """Give the calling thread (and the threads it starts) the lowest CPU priority, where the OS allows it (Linux:
    ``nice`` is per thread): on a CPU that training keeps busy, the writer then takes what training leaves idle
    instead of slowing its steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError) as error:  # not Linux, or not permitted: the writer runs at training's priority
        logger.debug("zero_bnb: the checkpoint writer keeps its CPU priority: %r", error)


class BackgroundSaver:
    """One engine's asynchronous saves: the staging buffers, the writer (one ``concurrent.futures`` worker at the
    lowest CPU priority), the last save's ``Future``.

    Args:
        limit_bytes: the most bytes one save may stage (``None``: no limit).
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.pool = StagingPool(limit_bytes=limit_bytes)
        self._key = object()  # this saver's failure in pending's record (an id() could be reused by another saver)
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._group: Any = None
        self._tag = ""
        self._folder = ""  # the real path of the save folder of the last save
        self._after: list[tuple[Callable[[], object], str]] = []
        self._after_lock = threading.Lock()
        self._state_lock = threading.Lock()  # start() and the end of wait(): which save a wait() reports on
        self._accepting = False  # whether after_pending_saves() hands its action to the writer
        #: seconds the last background save took, from its start to its commit (``None`` before one finished)
        self.last_duration: float | None = None

    @property
    def pending(self) -> bool:
        """Whether a save is being written now."""
        future = self._future
        return future is not None and not future.done()

    def process_group(self) -> Any:
        """The process group of the background commits (created by the first call). Collective the first time:
        every rank must call it."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
            pending.register(self)
        return self._group

    def start(self, tag: str, work: Callable[[], None], save_dir: str = "") -> None:
        """Run ``work`` (the rest of the save of ``tag`` into ``save_dir``) in the writer. Local; call after
        :meth:`wait`."""
        began = time.perf_counter()
        with self._state_lock:
            if self.pending:
                raise RuntimeError("BackgroundSaver.start while a save is pending; wait() first")
            self._tag = tag
            self._folder = os.path.realpath(save_dir) if save_dir else ""
            with self._after_lock:
                self._accepting = True
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="zero_bnb-save",
                                                    initializer=_lowest_cpu_priority)
            try:
                self._future = future = self._executor.submit(self._run, tag, work, began)
                return
            except RuntimeError:  # the interpreter is ending (an atexit handler saves): no worker starts any more
                self._future = future = Future()
        logger.info("zero_bnb: the process is ending; the asynchronous save of checkpoint %r is written now", tag)
        try:
            self._run(tag, work, began)
            future.set_result(None)
        except BaseException as error:  # noqa: BLE001 - the save's outcome, raised by wait() as any other
            future.set_exception(error)

    def _run(self, tag: str, work: Callable[[], None], began: float) -> None:
        """The writer's part: ``work``, then the front doors' deletions it holds; a failure is logged at once, recorded
        for the end of the process, and carried by the ``Future`` to the next call that waits."""
        try:
            work()
            self.last_duration = time.perf_counter() - began
            logger.debug("zero_bnb: asynchronous save of checkpoint %r committed in %.2f s", tag, self.last_duration)
        except BaseException as error:
            pending.record_failure(self._key, tag, self._folder, error)
            logger.error("zero_bnb: the asynchronous save of checkpoint %r failed; the previous checkpoint and "
                         "'latest' are unchanged. The next save_checkpoint, load_checkpoint or "
                         "wait_for_checkpoint raises this error: %s", tag, error)
            self._run_after(tag, failed=True)
            raise
        self._run_after(tag, failed=False)

    def _failed(self) -> bool:
        """Whether the last save ended in a failure that no call has raised yet."""
        future = self._future
        return future is not None and future.done() and future.exception() is not None

    def defer(self, action: Callable[[], object], what: str) -> bool:
        """Hand ``action`` to the writer to run right after the pending save is committed (or drop it, logged, if
        that save failed and is not raised yet); ``False`` when this saver has nothing pending. Local."""
        with self._after_lock:
            if self._accepting:
                logger.info("zero_bnb: %s waits until the asynchronous save of checkpoint %r is committed", what,
                            self._tag)
                self._after.append((action, what))
                return True
            if self._failed():  # it failed before the front door asked, and is not raised yet
                logger.warning("zero_bnb: %s did not run: the asynchronous save of checkpoint %r failed, so the "
                               "older checkpoints are kept", what, self._tag)
                return True
        return False

    def join(self) -> None:
        """Block until the pending save (if any) has ended; its outcome is left for :meth:`wait`. Local."""
        future = self._future
        if future is not None:
            futures_wait([future])

    def join_if_into(self, folder: str) -> None:
        """Block until the pending save, if it writes into ``folder`` (a real path), is finished; its outcome is
        left for :meth:`wait` to raise. Local."""
        if self.pending and self._folder == folder:
            logger.info("zero_bnb: waiting for the asynchronous save of checkpoint %r into %s (another engine's) to "
                        "release the folder", self._tag, folder)
            self.join()

    def _run_after(self, tag: str, *, failed: bool) -> None:
        """Run the deletions the front doors handed over (in order, until none is left; skipped if the save failed),
        then stop accepting more. Called by the writer once its save ended."""
        while True:
            with self._after_lock:
                if not self._after:
                    self._accepting = False  # only now: a deletion arriving meanwhile is queued behind the others
                    return
                action, what = self._after.pop(0)
            if failed:
                logger.warning("zero_bnb: %s did not run: the asynchronous save of checkpoint %r failed, so the "
                               "older checkpoints are kept", what, tag)
                continue
            try:
                action()
            except Exception as error:  # noqa: BLE001 - the front door's own deletion; logged like it would be
                logger.error("zero_bnb: %s failed after checkpoint %r was committed: %r", what, tag, error)

    def wait(self, *, raise_error: bool = True) -> None:
        """Block until the pending save (if any) is committed or failed. Local; any thread may call it.

        Raises:
            zero_bnb.errors.CheckpointSaveError: the last asynchronous save failed (raised once, by one caller; with
                ``raise_error=False`` it is only logged, as it was when it happened).
        """
        future = self._future
        if future is None:
            return
        if not future.done():
            logger.info("zero_bnb: waiting for the asynchronous save of checkpoint %r", self._tag)
        futures_wait([future])
        with self._state_lock:
            if self._future is not future:  # another caller reported this save, or a newer save started meanwhile
                return
            self._future = None
            tag = self._tag
            if raise_error:
                pending.forget_failure(self._key)
        error = future.exception()
        if error is not None and raise_error:
            if isinstance(error, CheckpointSaveError):
                raise error
            raise CheckpointSaveError(
                f"the asynchronous save of checkpoint {tag!r} failed in the background: "
                f"{type(error).__name__}: {error}; the previous checkpoint and 'latest' are unchanged"
            ) from error

    def close(self, *, report: bool = True) -> None:
        """Wait for a pending save, free the staging buffers and end the writer. Local.

        Args:
            report: raise a failure here; ``False`` (an engine being garbage-collected, where nothing would see it):
                leave it for the end of the process to report.

        Raises:
            zero_bnb.errors.CheckpointSaveError: the last asynchronous save failed (see :meth:`wait`).
        """
        try:
            self.wait(raise_error=report)
        finally:
            self.pool.release()
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=False)  # idle: its save ended above
