"""The one save algorithm's second half: what is left once a save's call has staged what it writes.

``ZeroBnbEngine.save_checkpoint`` stages (a synchronous save through
:class:`~zero_bnb.checkpoint.staging.InlineStaging`, which copies nothing ahead; an asynchronous one into
:class:`~zero_bnb.checkpoint.staging.StagingPool`'s host buffers) and then runs :meth:`StagedSave.run` at once, or
hands it to :class:`~zero_bnb.checkpoint.background.BackgroundSaver`: the masters are decided, the files written
and the checkpoint committed the same way in both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from zero_bnb.checkpoint.commit import SaveTransaction
from zero_bnb.checkpoint.masters import LocalMasters, MasterPlan, agree_masters, derive_local_masters
from zero_bnb.checkpoint.partitioned import PartitionedOptimizer
from zero_bnb.checkpoint.save import LocalPayload
from zero_bnb.checkpoint.staging import StagingLimitError
from zero_bnb.format.direct_io import direct_writes
from zero_bnb.format.durable import save_torch
from zero_bnb.format.manifest import Manifest

__all__ = ["StagedSave"]


@dataclass
class StagedSave:
    """What is left of a staged save: decide the masters, write the files, commit (:meth:`run`); in the caller for a
    synchronous save, in the background writer for an asynchronous one.

    Attributes:
        transaction: the save's transaction (begun; :attr:`SaveTransaction.group` is the writers' group).
        optimizer: the engine's ZeRO optimizer (read for its geometry only: the values are the staged copies).
        names: parameter -> name (``engine.param_names``).
        candidates: :func:`~zero_bnb.checkpoint.masters.master_candidates` at the call.
        slices: group index -> this rank's staged module weights (groups whose masters could derive).
        deferred: ``(path, staged object)`` of DeepSpeed's files, and ``(tag folder, LocalPayload)``.
        manifest: completes the manifest described at the call from the files and the masters' storage.
        after_publish: runs on rank 0 once the checkpoint is published (``zero_to_fp32.py`` beside it).
        copies: the staging's device-to-host copies to wait for (``None``: all were synchronous).
        background: written by the background writer (around the page cache, so that training keeps its cores and
            memory bus: :func:`~zero_bnb.format.direct_io.direct_writes`); a synchronous save writes through it.
    """

    transaction: SaveTransaction
    optimizer: PartitionedOptimizer
    names: dict
    candidates: list[tuple[str, str]]
    slices: dict[int, torch.Tensor]
    deferred: list[tuple[str, Any]]
    manifest: Callable[[list, list[MasterPlan]], Manifest]
    after_publish: Callable[[], object]
    copies: Any = None
    background: bool = False

    def _inputs(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's staged masters and module weights of group ``index``, on the CPU (a synchronous save staged
        views: a device's are copied here, one group at a time)."""
        payloads = [staged for _, staged in self.deferred if isinstance(staged, LocalPayload)]
        if index not in self.slices or not payloads:
            raise StagingLimitError("the module weights or the masters were not staged "
                                    "(zero_checkpoint_async_max_staging_mb)")
        return payloads[0].shard.groups[index].fp32.to("cpu"), self.slices[index].to("cpu")

    def _derive(self) -> list[LocalMasters]:
        """This rank's rounding checks and residual splits (local: any thread may run it)."""
        return derive_local_masters(self.optimizer, self.candidates, self.names, self._inputs)

    def _write(self, masters: list[MasterPlan] | None) -> bool:
        """Write DeepSpeed's files by path (``masters`` ``None``) or the optimizer payloads into their folder with
        ``masters``. ``False`` when one failed: the error is recorded for the commit to report
        (:meth:`SaveTransaction.guard`) and the rest is not written."""
        wrote = False
        with self.transaction.guard(), direct_writes() if self.background else contextlib.nullcontext():
            for path, staged in self.deferred:
                if not isinstance(staged, LocalPayload) and masters is None:
                    self.transaction.add([save_torch(staged, path, root=self.transaction.staging_folder)])
                elif isinstance(staged, LocalPayload) and masters is not None:
                    self.transaction.add(staged.with_masters(masters).write(path))
            wrote = True
        return wrote

    def run(self) -> None:
        """Decide, write, commit. Collective over the writers' group: every rank's writer must run it."""
        transaction = self.transaction
        try:
            with transaction.guard():
                transaction.make_lock_durable()  # an asynchronous call did not wait: beside another writer, 13-55 ms
                if self.copies is not None:
                    self.copies.synchronize()
            # This rank's rounding check and residual split (local, about 1.5 ns per element) run on a helper thread
            # while DeepSpeed's files are written: those need no decision. Every rank then agrees, even after an
            # error (commit() reports it), so no writer waits for another; then the optimizer payloads are written.
            with ThreadPoolExecutor(1) as helper:  # a pool per save: one kept would not survive a fork
                try:
                    local = helper.submit(self._derive)
                except RuntimeError:  # the interpreter is exiting (a save the background writer ends then)
                    local = None
                wrote = self._write(None)
                found = local.result() if local is not None else self._derive()
            masters = agree_masters(self.optimizer, found, group=transaction.group)
            if wrote:  # after a failed file, as before: nothing more is written
                self._write(masters)
            transaction.commit(lambda files: self.manifest(files, masters), after_publish=self.after_publish)
        except BaseException:
            transaction.abort()  # a collective that failed (a dead peer, a timeout): leave no lock or staging folder
            raise
