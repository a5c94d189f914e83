"""The process's asynchronous saves, all engines together: waiting for them (:func:`wait_for_pending_saves`,
:func:`join_saves_into`), work that must follow them (:func:`after_pending_saves`), ``destroy_process_group`` made
to wait for them, and the end of the process reporting one that failed unseen.

Each :class:`~zero_bnb.checkpoint.background.BackgroundSaver` registers itself at its first asynchronous save
(:func:`register`). Local.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from zero_bnb.errors import CheckpointSaveError
from zero_bnb.format.progress import folder_status

__all__ = ["after_pending_saves", "forget_failure", "join_saves_into", "record_failure", "register", "unregister",
           "wait_for_pending_saves"]

logger = logging.getLogger(__name__)

#: The registered savers (:class:`~zero_bnb.checkpoint.background.BackgroundSaver`: ``wait``, ``defer``,
#: ``join_if_into``).
_SAVERS: weakref.WeakSet[Any] = weakref.WeakSet()
_WRAP_LOCK = threading.Lock()


def register(saver: Any) -> None:
    """Count ``saver`` among the process's savers, and make ``destroy_process_group`` wait for them (once)."""
    _wait_before_destroy()
    _SAVERS.add(saver)


def unregister(saver: Any) -> None:
    _SAVERS.discard(saver)


#: Failed asynchronous saves no call has raised yet: saver's key -> (tag, save folder, error). What the end of the
#: process reports (:func:`_report_lost_saves`); kept here, not on the saver, so an engine freed before the end of
#: the process does not take its failure with it.
_UNREPORTED: dict[object, tuple[str, str, BaseException]] = {}


def record_failure(key: object, tag: str, folder: str, error: BaseException) -> None:
    """A save's failure, for the end of the process to report unless a call raises it first (:func:`forget_failure`)."""
    _UNREPORTED[key] = (tag, folder, error)


def forget_failure(key: object) -> None:
    """The failure recorded under ``key`` was raised by a call: the end of the process has nothing to report."""
    _UNREPORTED.pop(key, None)


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
    """Wait for every asynchronous save of this process (``BackgroundSaver.wait``; a failure is raised). Local."""
    for saver in list(_SAVERS):
        saver.wait()
