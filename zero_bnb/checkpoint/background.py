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
  folder's lock until it commits) and its load from that folder (:func:`join_saves_into`) (the writer is a non-daemon thread; ``destroy_process_group`` is wrapped once, at
  the first asynchronous save, to wait for every pending save first: the commit needs the process group).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import torch

from zero_bnb.checkpoint.commit import SaveTransaction
from zero_bnb.checkpoint.staging import StagingPool
from zero_bnb.errors import CheckpointSaveError, CheckpointUsageError
from zero_bnb.format.progress import folder_status

__all__ = ["BackgroundSaver", "after_pending_saves", "check_same_switch", "join_saves_into", "wait_for_pending_saves"]

logger = logging.getLogger(__name__)

_SAVERS: weakref.WeakSet[BackgroundSaver] = weakref.WeakSet()
_WRAP_LOCK = threading.Lock()


#: Failed asynchronous saves no call has raised yet: saver's key -> (tag, save folder, error). What the end of the
#: process reports (:func:`_report_lost_saves`); kept here, not on the saver, so an engine freed before the end of
#: the process does not take its failure with it.
_UNREPORTED: dict[object, tuple[str, str, BaseException]] = {}


def _wait_before_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` wait for every pending asynchronous save first and raise a
    failure after destroying the group (once)."""
    with _WRAP_LOCK:
        original = dist.destroy_process_group
        if getattr(original, "_zero_bnb_waits", False):
            return

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            failures = []
            for saver in list(_SAVERS):
                try:
                    saver.wait()
                except CheckpointSaveError as error:
                    failures.append(error)
            result = original(*args, **kwargs)
            if failures:
                raise failures[0]
            return result

        destroy_process_group._zero_bnb_waits = True  # type: ignore[attr-defined]
        dist.destroy_process_group = destroy_process_group


def _still_latest(folder: str) -> str:
    status = folder_status(folder)
    if status.tag is not None:
        return f"'latest' there still names {status.tag!r}"
    return f"{folder} holds no complete checkpoint ('latest' was not written)"


def _report_lost_saves() -> None:
    """At the end of the process (after its threads, the writers included, are joined): an asynchronous save that
    failed and that no call raised is logged as an ERROR, and the process exits with status 1 instead of 0."""
    if not _UNREPORTED:
        return
    for tag, folder, error in list(_UNREPORTED.values()):
        logger.error("zero_bnb: the asynchronous save of checkpoint %r into %s failed and nothing raised it before "
                     "the process ended: %s. %s. Exiting with status 1", tag, folder or "?", error,
                     _still_latest(folder) if folder else "the previous checkpoint is unchanged")
    for handler in [*logging.getLogger().handlers, *logger.handlers]:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(1)  # an exception in an atexit handler would not change the exit status


# Registered when zero_bnb's checkpoint code is first imported, before the libraries a training script sets up later
# (loggers, uploaders): atexit runs the handlers registered after this one first, so they are not cut short by the
# os._exit above. A no-op unless an asynchronous save failed unreported.
atexit.register(_report_lost_saves)


def after_pending_saves(action: Callable[[], object], what: str) -> None:
    """Run ``action`` now, or, while an asynchronous save of this process is pending, in its writer thread right
    after the save is committed; never if the save fails. Local.

    For the front doors' deletions of older checkpoints (Trainer's ``save_total_limit``, Lightning's
    ``save_top_k``): an older checkpoint is removed only once the newer one is complete.
    """
    if not any(saver.defer(action, what) for saver in list(_SAVERS)):
        action()


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


def join_saves_into(save_dir: str) -> None:
    """Block until every pending asynchronous save of this process into ``save_dir`` is finished; its outcome is
    left for its own engine's next call to raise. Local.

    Called before a save takes ``save_dir``'s lock, which a pending save of another engine holds until its commit,
    and before a load reads ``save_dir``: in program order, that other engine's save came first.
    """
    folder = os.path.realpath(save_dir)
    for saver in list(_SAVERS):
        saver.join_if_into(folder)


def wait_for_pending_saves() -> None:
    """Wait for every asynchronous save of this process (:meth:`BackgroundSaver.wait`; a failure is raised). Local."""
    for saver in list(_SAVERS):
        saver.wait()


def _lowest_cpu_priority() -> None:
    """Give the calling thread (and the threads it starts) the lowest CPU priority, where the OS allows it (Linux:
    ``nice`` is per thread): on a CPU that training keeps busy, the writer then takes what training leaves idle
    instead of slowing its steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError) as error:  # not Linux, or not permitted: the writer runs at training's priority
        logger.debug("zero_bnb: the checkpoint writer keeps its CPU priority: %r", error)


class BackgroundSaver:
    """One engine's asynchronous saves: the staging buffers, the writer thread, the last save's outcome.

    Args:
        limit_bytes: the most bytes one save may stage (``None``: no limit).
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.pool = StagingPool(limit_bytes=limit_bytes)
        self._key = object()  # this saver's entry in _UNREPORTED (an id() could be reused by another saver)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
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
        return self._thread is not None and self._thread.is_alive()

    def process_group(self) -> Any:
        """The process group of the background commits (created by the first call). Collective the first time:
        every rank must call it."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
            _wait_before_destroy()
            _SAVERS.add(self)
        return self._group

    def start(self, tag: str, work: Callable[[], None], save_dir: str = "") -> None:
        """Run ``work`` (the rest of the save of ``tag`` into ``save_dir``) in the writer thread. Local; call after
        :meth:`wait`."""
        with self._state_lock:
            if self.pending:
                raise RuntimeError("BackgroundSaver.start while a save is pending; wait() first")
            self._start(tag, work, save_dir)

    def _start(self, tag: str, work: Callable[[], None], save_dir: str) -> None:
        self._tag, self._error = tag, None
        self._folder = os.path.realpath(save_dir) if save_dir else ""
        with self._after_lock:
            self._accepting = True
        began = time.perf_counter()

        def run() -> None:
            _lowest_cpu_priority()
            try:
                work()
                self.last_duration = time.perf_counter() - began
                logger.debug("zero_bnb: asynchronous save of checkpoint %r committed in %.2f s", tag, self.last_duration)
            except BaseException as error:  # noqa: BLE001 - kept, logged, and raised by the next call
                self._error = error
                _UNREPORTED[self._key] = (tag, self._folder, error)
                logger.error("zero_bnb: the asynchronous save of checkpoint %r failed; the previous checkpoint and "
                             "'latest' are unchanged. The next save_checkpoint, load_checkpoint or "
                             "wait_for_checkpoint raises this error: %s", tag, error)
            finally:
                self._run_after(tag)

        thread = threading.Thread(target=run, name=f"zero_bnb-save-{tag}", daemon=False)
        thread.start()
        self._thread = thread  # only once started: another thread's wait() may join it at once

    def defer(self, action: Callable[[], object], what: str) -> bool:
        """Hand ``action`` to the writer to run right after the pending save is committed (or drop it, logged, if
        that save failed and is not raised yet); ``False`` when this saver has nothing pending. Local."""
        with self._after_lock:
            if self._accepting:
                logger.info("zero_bnb: %s waits until the asynchronous save of checkpoint %r is committed", what,
                            self._tag)
                self._after.append((action, what))
                return True
            if self._error is not None:  # it failed before the front door asked, and is not raised yet
                logger.warning("zero_bnb: %s did not run: the asynchronous save of checkpoint %r failed, so the "
                               "older checkpoints are kept", what, self._tag)
                return True
        return False

    def join_if_into(self, folder: str) -> None:
        """Block until the pending save, if it writes into ``folder`` (a real path), is finished; its outcome is
        left for :meth:`wait` to raise. Local."""
        thread = self._thread
        if thread is not None and thread.is_alive() and self._folder == folder:
            logger.info("zero_bnb: waiting for the asynchronous save of checkpoint %r into %s (another engine's) to "
                        "release the folder", self._tag, folder)
            thread.join()

    def _run_after(self, tag: str) -> None:
        """Run the deletions the front doors handed over (in order, until none is left; skipped if the save failed),
        then stop accepting more. Called by the writer thread once its save ended."""
        while True:
            with self._after_lock:
                if not self._after:
                    self._accepting = False  # only now: a deletion arriving meanwhile is queued behind the others
                    return
                action, what = self._after.pop(0)
            if self._error is not None:
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
        thread = self._thread
        if thread is not None:
            if thread.is_alive():
                logger.info("zero_bnb: waiting for the asynchronous save of checkpoint %r", self._tag)
            thread.join()
        with self._state_lock:
            if self._thread is not thread:  # another caller reported this save, or a newer save started meanwhile
                return
            self._thread = None
            error, self._error, tag = self._error, None, self._tag
            if raise_error:
                _UNREPORTED.pop(self._key, None)
        if error is not None and raise_error:
            if isinstance(error, CheckpointSaveError):
                raise error
            raise CheckpointSaveError(
                f"the asynchronous save of checkpoint {tag!r} failed in the background: "
                f"{type(error).__name__}: {error}; the previous checkpoint and 'latest' are unchanged"
            ) from error

    def close(self, *, report: bool = True) -> None:
        """Wait for a pending save and free the staging buffers. Local.

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
