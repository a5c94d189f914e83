"""Run a local action on every rank and make its failure, on any rank, a failure on all.

Checkpoint code must not let one rank raise while the others wait in the next collective:
the job would hang instead of reporting the error. :func:`agree` turns "rank 1 found a
damaged file" into the same exception on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from zero_bnb.errors import CheckpointError, error_class

__all__ = ["agree", "raise_reported"]

T = TypeVar("T")


def raise_reported(reports: list[tuple[str, str] | None], *, prefix: str = "") -> None:
    """Raise one error describing every non-``None`` ``(class name, message)`` report, by rank.

    Local: every rank holding the same reports raises the same error. The class is the first
    failing rank's if it is one of :mod:`zero_bnb.errors`' classes, else ``CheckpointError``.
    """
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    messages = {message for _, (_, message) in failed}
    ranks = [rank for rank, _ in failed]
    if len(messages) == 1:
        where = "every rank" if len(failed) == len(reports) else f"rank(s) {ranks}"
        text = f"{messages.pop()} (reported by {where})"
    else:
        text = "; ".join(f"rank {rank}: {name}: {message}" for rank, (name, message) in failed)
    raise error_class(failed[0][1][0])(prefix + text)


def agree(action: Callable[[], T], *, group: Any = None) -> T:
    """Run ``action()`` on this rank; if it raised on any rank of ``group``, raise on all of them.

    Collective: every rank of ``group`` (default: the world) must call it. Exceptions that are
    not :class:`~zero_bnb.errors.CheckpointError` and were raised only here are re-raised
    as they are on this rank; the other ranks raise a ``CheckpointError`` naming them.
    """
    try:
        result, failure = action(), None
    except Exception as error:  # noqa: BLE001 - reported to every rank below, then re-raised
        result, failure = None, error
    report = None if failure is None else (type(failure).__name__, str(failure))
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    if failure is not None and not isinstance(failure, CheckpointError):
        raise failure
    try:
        raise_reported(reports)
    except CheckpointError as error:
        raise error from failure
    return result  # type: ignore[return-value]
