"""Atomic checkpoint commit: a tag folder becomes visible only when every rank's files are durable.

A save of tag ``T`` into ``save_dir`` goes through three states:

1. **staging** — rank 0 takes the save folder's lock (:mod:`zero_bnb.format.lock`: one writer at a
   time; a second job gets an error naming the holder), removes staging folders that crashed
   saves left, checks that ``T`` and ``latest`` can be replaced (no symlink, no folder named
   ``latest``), and every rank learns the outcome before anything else happens. Every rank
   then writes into ``save_dir/.T.zero_bnb-staging-<token>`` (hidden, unique per save).
   Files are fsynced as they are closed.
2. **agreement** — all ranks report their files (size, digest) or their error to every
   rank. If any rank failed, the staging folder is removed and every rank raises
   :class:`~zero_bnb.errors.CheckpointSaveError`; the previous checkpoint is untouched.
3. **publish** (rank 0) — write the manifest (with every file's checksum) last, fsync the
   folders, write the new ``latest`` into a private folder (a full disk fails here, before
   anything is visible), rename the staging folder to ``save_dir/T`` (an existing ``T`` is first
   moved aside to ``.T.zero_bnb-replaced``, and after the rename removed under a staging name, so that no
   loader finds it half removed; one holding what zero_bnb did not write is renamed
   ``T.replaced-<UTC time>`` instead, and the files zero_bnb proves it wrote are removed from it: what remains is
   what the user added, or the whole folder where nothing is proven, e.g. a stock DeepSpeed checkpoint), then rename
   the new ``latest`` into
   place, then release the lock. An error after the folder's rename says that ``T`` *was*
   published and what ``latest`` names.

Killing any process at any moment therefore leaves either the previous checkpoint with its
``latest``, or the new one complete. The one window in which ``save_dir/T`` is absent
(between the two renames when ``T`` is re-saved) is covered by :func:`zero_bnb.format.tags.resolve_tag`, which
then returns the complete previous folder; a load that finds a folder and then sees it go away reports
:class:`~zero_bnb.errors.CheckpointReplacedError` (load again), never damage. Offline tools write through
:func:`local_commit`, the same protocol in one process.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from zero_bnb.checkpoint.collective import raise_reported
from zero_bnb.checkpoint.recovery_script import SCRIPT_NAME
from zero_bnb.errors import CheckpointError, CheckpointSaveError, CheckpointUsageError, failure_kind
from zero_bnb.format.durable import FileRecord, fsync_dir, makedirs, remove_tree, write_text
from zero_bnb.format.publish import TEMP_SUFFIX, StagedFile, finish_publish, publish_folder
from zero_bnb.format.lock import SaveFolderLock
from zero_bnb.format.manifest import SUBDIR, Manifest, write_manifest
from zero_bnb.format.ownership import CHECKPOINT_MARKERS, checkpoint_strangers, remove_own_files
from zero_bnb.format.progress import STAGING_SUFFIX
from zero_bnb.format.stock_files import MODEL_STATES
from zero_bnb.format.tags import LATEST_NAME, UNIVERSAL_LATEST, aside_tag, check_new_tag

__all__ = ["PublishedError", "SaveTransaction", "local_commit"]

logger = logging.getLogger(__name__)

_PUBLISHED_MARK = "published:"


class PublishedError(CheckpointSaveError):
    """The new checkpoint was published, but a step after (``latest``, syncing, tidying) failed; the message says which."""


def _check_targets(save_dir: str, tag: str, latest_name: str | None, owned_only: bool = True) -> None:
    """Refuse, before anything is written, targets that publishing could not replace cleanly.

    With ``owned_only`` (engine saves), also an existing tag folder that holds what zero_bnb did not write and is no
    checkpoint (a user's folder). One that is a checkpoint (stock DeepSpeed's, or a zero_bnb one with a user's file
    added) is replaced, and what zero_bnb did not write in it is kept beside the new one (:func:`_publish`). Offline tools replace an existing output
    only when asked (``--force``), after their own checks (:func:`zero_bnb.tools.outputs.check_output_folder`).
    """
    final = os.path.join(save_dir, tag)
    if os.path.islink(final) or (os.path.lexists(final) and not os.path.isdir(final)):
        raise CheckpointSaveError(
            f"{final} exists and is {'a symbolic link' if os.path.islink(final) else 'not a folder'}; zero_bnb "
            f"replaces only checkpoint folders it wrote. Nothing was written. Save under another tag, or remove "
            f"{final} yourself"
        )
    if latest_name is not None:
        latest = os.path.join(save_dir, latest_name)
        if os.path.islink(latest) or (os.path.lexists(latest) and not os.path.isfile(latest)):
            raise CheckpointSaveError(
                f"{latest} is not a regular file, so it cannot point at the new checkpoint. Nothing was written. "
                f"Remove or rename {latest}"
            )
    strangers = checkpoint_strangers(final) if owned_only and os.path.isdir(final) else []
    if strangers and not (any(os.path.isfile(os.path.join(final, marker)) for marker in CHECKPOINT_MARKERS)
                          or any(name.endswith(MODEL_STATES) for name in os.listdir(final))):  # stage 3's, per rank
        raise CheckpointSaveError(
            f"{final} exists and is not a checkpoint folder (it holds {_shown(strangers)}); zero_bnb replaces only "
            f"checkpoint folders it wrote. Nothing was written. Save under another tag, or move {final} away yourself"
        )


def _shown(paths: list[str]) -> str:
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _kept_name(save_dir: str, tag: str) -> str:
    """A free visible name beside ``tag`` for a folder kept whole: ``<tag>.replaced-<UTC time>[-n]``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return next(path for path in (os.path.join(save_dir, f"{tag}.replaced-{stamp}{suffix}")
                                  for suffix in ("", *(f"-{n}" for n in range(1, 10**6))))
                if not os.path.lexists(path))


def _prepare(save_dir: str, tag: str, latest_name: str | None, token: str,
             owned_only: bool = True, durable_lock: bool = True) -> tuple[SaveFolderLock, str]:
    """Create ``save_dir`` (durably: a save folder the first save creates must survive a crash with its checkpoints),
    take its lock, clear stale staging folders; returns the lock and staging folder."""
    makedirs(save_dir, durable=True)
    lock = SaveFolderLock(save_dir, f"saving tag {tag!r}")
    lock.acquire(durable=durable_lock)
    try:
        _check_targets(save_dir, tag, latest_name, owned_only)
        for name in os.listdir(save_dir):  # only the lock holder stages or replaces these, so they are crashed saves'
            if name.startswith(".") and (STAGING_SUFFIX in name or name.endswith(TEMP_SUFFIX) and name.startswith(
                    tuple(f".{single}." for single in (LATEST_NAME, UNIVERSAL_LATEST, SCRIPT_NAME)))):
                remove_tree(os.path.join(save_dir, name))
        staging = os.path.join(save_dir, f".{tag}{STAGING_SUFFIX}-{token}")
        # Not fsynced: the staging folder's entry needs no durability (a crash before the commit leaves a staging
        # folder the next save removes, or none), and an fsync does not make it visible to other nodes (NFS creates
        # it on the server before mkdir returns); the commit fsyncs every folder before and after its rename. Beside
        # another process writing to the disk, that fsync waited for its data: up to 29 ms of every save's call.
        makedirs(staging, fresh=True)
    except BaseException:
        lock.release()
        raise
    return lock, staging


def _publish(save_dir: str, tag: str, staging: str, latest_name: str | None, owned_only: bool = True) -> str:
    """Make the finished ``staging`` folder visible as ``save_dir/tag``, then point ``latest_name`` at it.

    Raises:
        OSError: nothing was published (the previous checkpoint and pointer file are unchanged).
        PublishedError: ``save_dir/tag`` is the new checkpoint, but a later step failed (named).
    """
    for folder in [os.path.join(root, name) for root, names, _ in os.walk(staging) for name in names] + [staging]:
        fsync_dir(folder)
    final = os.path.join(save_dir, tag)
    aside = os.path.join(save_dir, aside_tag(tag))
    trash = f"{staging}-replaced"  # a staging name: the next save removes it if a crash leaves it
    pointer = None if latest_name is None else StagedFile(os.path.join(save_dir, latest_name))
    try:
        if pointer is not None:
            write_text(tag, pointer.path, root=pointer.folder)  # before anything is visible: a full disk fails here
        # A save killed while replacing the tag left its previous folder at the hidden name, with what the user
        # added: renamed whole now, stripped of zero_bnb's files only once the new checkpoint is in place.
        leftover = (_keep(save_dir, tag, aside, "a save of the same tag was interrupted while replacing it")
                    if owned_only and _real_folder(aside) and checkpoint_strangers(aside) else None)
        publish_folder(staging, final, aside, trash)
        try:
            if leftover is not None:
                _strip(leftover)
            # The replaced folder, as it is now that nothing can arrive in it any more: removed only if it holds
            # nothing zero_bnb did not write, else renamed to a visible name, without zero_bnb's own files.
            if owned_only and _real_folder(aside) and checkpoint_strangers(aside):
                _strip(_keep(save_dir, tag, aside, f"the new checkpoint took the place of {final}"))
            else:
                _finish_even_if_interrupted(final, aside, trash)
            if pointer is not None:
                pointer.publish()
        except OSError as error:
            if pointer is None:
                state = "no pointer file was asked for"
            elif pointer.published:
                state = f"{pointer.destination} names it"
            else:
                state = f"{pointer.destination} still names the previous tag; load the new one with tag={tag!r}"
            raise PublishedError(
                f"the new checkpoint {final} was published, but a step after failed ({type(error).__name__}: "
                f"{error}); {state}. Fix the cause (disk space, permissions) before the next save"
            ) from error
    finally:
        if pointer is not None:
            pointer.discard()
    return final


def _identity(path: str) -> tuple[int, int] | None:
    """The (device, inode) of folder ``path``, ``None`` when there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino)


def _real_folder(path: str) -> bool:
    """A folder, not a link to one (a link planted at a hidden name is removed as a leftover, never followed)."""
    return os.path.isdir(path) and not os.path.islink(path)


def _keep(save_dir: str, tag: str, aside: str, why: str) -> str:
    """Rename the replaced folder ``aside``, which holds files zero_bnb did not write, to a visible
    ``<tag>.replaced-<UTC time>``, saying so; returns the new name. :func:`_strip` then removes zero_bnb's own files
    from it, so that repeated saves over a folder the user adds a file to keep the user's files, not copies of the
    checkpoint. A crash in between leaves the visible folder whole, never a hidden one a later save removes."""
    keep = _kept_name(save_dir, tag)
    kept = checkpoint_strangers(aside)
    os.rename(aside, keep)
    fsync_dir(save_dir)
    logger.warning("zero_bnb: %s; the previous folder held files zero_bnb did not write (%s): they are in %s (remove "
                   "it when you no longer need them)", why, _shown(kept), keep)
    return keep


def _strip(keep: str) -> None:
    """Remove from the kept folder ``keep`` the files its manifest proves zero_bnb wrote (the new checkpoint is in
    place). Cleanup only: a failure is logged, never raised (the new checkpoint is published and ``latest`` is still
    to be moved)."""
    try:
        _, removed = remove_own_files(keep)
    except OSError as error:
        logger.warning("zero_bnb: could not remove zero_bnb's own files of the previous checkpoint from %s (%r); "
                       "the new checkpoint is saved. Remove what you do not need of %s yourself", keep, error, keep)
        return
    if removed:
        logger.info("zero_bnb: %s: zero_bnb's own files of that checkpoint (%.3g MiB) were removed from it", keep,
                    removed / 2**20)
    else:
        logger.warning("zero_bnb: %s is kept whole: nothing in it is proven zero_bnb's (a stock DeepSpeed checkpoint, "
                       "another user's, or one whose manifest others can write)", keep)


def _finish_even_if_interrupted(final: str, aside: str, trash: str) -> None:
    """:func:`finish_publish`; an interrupt (Ctrl-C) in it lets the removal of the previous folder finish first (it
    would be left in a hidden folder nobody else removes), then propagates."""
    try:
        finish_publish(final, aside, trash)
    except KeyboardInterrupt:
        try:
            remove_tree(aside, via=trash)
        except OSError as error:
            logger.error("zero_bnb: could not remove the replaced %s: %r; remove it yourself", aside, error)
        raise


@contextmanager
def local_commit(save_dir: str, tag: str, *, latest_name: str | None = LATEST_NAME, replace: bool = False,
                 after_publish: Callable[[], object] | None = None) -> Iterator[str]:
    """Write a checkpoint folder in one process: yields the staging folder, publishes it on success.

    Local: for offline tools. Holds the save folder's lock throughout; if the block raises,
    the staging folder is removed and ``save_dir/tag`` and the pointer file are unchanged.
    ``latest_name=None`` leaves the pointer file alone; ``after_publish`` runs once the checkpoint
    is published, under the lock (``zero_to_fp32.py`` beside it); it must not raise.

    Raises:
        CheckpointUsageError: ``save_dir/tag`` exists and ``replace`` is false (checked under
            the lock, so two tools writing the same output cannot both succeed).
    """
    tag = check_new_tag(tag)
    lock, staging = _prepare(save_dir, tag, latest_name, uuid.uuid4().hex[:12], owned_only=False)
    try:
        if not replace and os.path.lexists(os.path.join(save_dir, tag)):
            raise CheckpointUsageError(
                f"the output {os.path.join(save_dir, tag)} already exists (another command may have just written it); "
                f"pass --force (force=True) to replace it, or choose another output"
            )
        yield staging
        _publish(save_dir, tag, staging, latest_name, owned_only=False)
        if after_publish is not None:
            after_publish()  # still under the lock, as SaveTransaction.commit's
    finally:
        try:
            remove_tree(staging)
        finally:
            lock.release()


class SaveTransaction:
    """One checkpoint save, from staging to publication (see the module docstring).

    Collective: every rank of the world group must create it and call :meth:`begin` and
    :meth:`commit` in the same order. Between the two, each rank writes into
    :attr:`staging_folder`, adding its files with :meth:`add` and wrapping each write phase
    in :meth:`guard`, which records an error instead of raising it (so that no rank leaves
    the collective protocol early).
    """

    def __init__(self, save_dir: str, tag: str, *, save_latest: bool = True) -> None:
        self.save_dir = save_dir
        self.tag = check_new_tag(tag)
        self.latest_name = LATEST_NAME if save_latest else None
        self.staging_tag = ""
        self.staging_folder = ""
        #: Rank 0's descriptor of the staging folder it made, held until the commit: the folder's inode cannot be
        #: reused meanwhile, so a folder removed and made again under its name is told apart.
        self._staging_fd = -1
        self.files: list[FileRecord] = []
        self.errors: list[str] = []
        #: the first exception a :meth:`guard` caught on this rank (chained to the error raised for it)
        self.cause: BaseException | None = None
        #: the process group :meth:`commit` agrees on (``None``: the world; an asynchronous save's own group,
        #: so that a commit in a background thread never interleaves with training's collectives)
        self.group: Any = None
        self._lock: SaveFolderLock | None = None

    def begin(self, *, durable_lock: bool = True) -> None:
        """Rank 0 takes the lock and prepares the staging folder; every rank learns the outcome. Collective.

        Args:
            durable_lock: ``False``: the fsync of the lock's record runs in a helper thread and this does not wait
                for it (an asynchronous save's call); :meth:`make_lock_durable` waits (its writer, first).

        Raises:
            CheckpointSaveError: on every rank, if rank 0 could not prepare (read-only folder,
                another job holding the lock, a symlinked tag folder); nothing was written.
        """
        token: list[Any] = [None]
        if dist.get_rank() == 0:
            with self.guard():
                self._lock, staging = _prepare(self.save_dir, self.tag, self.latest_name, uuid.uuid4().hex[:12],
                                               durable_lock=durable_lock)
                token = [os.path.basename(staging)]
                self._staging_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, ("; ".join(self.errors) or None, token[0]))
        self.staging_tag = reports[0][1] or ""
        self.staging_folder = os.path.join(self.save_dir, self.staging_tag)
        self.errors = []
        prefix = (f"saving checkpoint {self.tag!r} to {self.save_dir} failed before anything was written; the previous "
                  f"checkpoint and 'latest' are unchanged. Cause: ")
        failures = [None if error is None else ("CheckpointSaveError", error) for error, _ in reports]
        if any(failures):
            self.abort()
            self._raise_reported(failures, prefix)
        # The staging name is unique to this save, so a rank that does not see it saves into another folder.
        seen = None if os.path.isdir(self.staging_folder) else (
            f"rank {dist.get_rank()} does not see the staging folder {self.staging_tag} that rank 0 created in "
            f"{self.save_dir}: every rank must save into the same shared folder (same absolute path, shared storage)")
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, seen)
        failures = [None if error is None else ("CheckpointSaveError", error) for error in reports]
        if any(failures):
            self.abort()
            self._raise_reported(failures, prefix)

    def make_lock_durable(self) -> None:
        """Wait until the save folder lock's record is fsynced (rank 0, after ``begin(durable_lock=False)``). Local.

        Raises:
            OSError: that fsync failed (call it inside :meth:`guard`)."""
        if self._lock is not None:
            self._lock.make_durable()

    def add(self, records: list[FileRecord]) -> None:
        self.files.extend(records)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Record an exception raised inside the block (it is re-raised on every rank by :meth:`commit`).

        Local. The record names the exception, its message and its kind (:func:`~zero_bnb.errors.failure_kind`:
        a full disk, permissions, an unpicklable ``client_state``, a bug...); the traceback is logged here, and
        the first exception becomes the ``__cause__`` of the error :meth:`begin` or :meth:`commit` raises on this rank.
        """
        try:
            yield
        except Exception as error:  # noqa: BLE001 - reported collectively by commit()
            kind = failure_kind(error)
            logger.error("zero_bnb: saving checkpoint %r failed on rank %d (%s)", self.tag, dist.get_rank(), kind,
                         exc_info=error)
            text = f"{type(error).__name__}: {error}"
            self.errors.append(text if isinstance(error, CheckpointError) else f"{text} [{kind}]")
            self.cause = self.cause or error

    def _raise_reported(self, failures: list[tuple[str, str] | None], prefix: str) -> None:
        """:func:`raise_reported`, chaining this rank's own exception (if it had one) as the cause."""
        try:
            raise_reported(failures, prefix=prefix)
        except CheckpointError as error:
            raise error from self.cause

    def commit(self, build_manifest: Callable[[list[FileRecord]], Manifest],
               after_publish: Callable[[], object] | None = None) -> None:
        """Agree on success, then publish on rank 0 and release the lock. Collective.

        ``after_publish`` runs on rank 0 once the checkpoint is published, before any rank
        returns (``zero_to_fp32.py`` beside it); it must not raise.

        Raises:
            CheckpointSaveError: on every rank, if any rank failed to write or rank 0 failed to
                publish; the previous checkpoint and ``latest`` are then unchanged.
        """
        local = (self.files, "; ".join(self.errors) or None)
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, local, group=self.group)
        failures = [None if error is None else ("CheckpointSaveError", error) for _, error in gathered]
        outcome: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                if not self._staging_intact():  # before the ranks' errors: it is their cause
                    raise CheckpointSaveError(
                        f"the staging folder {self.staging_folder} was removed while the save ran, by something other "
                        f"than this save (a user, a cleaner of old files such as systemd-tmpfiles, another job); nothing "
                        f"was published. Keep other programs out of the save folder's hidden .*{STAGING_SUFFIX}-* "
                        f"folders")
                if not any(failures):
                    files = [record for records, _ in gathered for record in records]
                    self._publish(build_manifest(files))
                    if after_publish is not None:
                        after_publish()
            except PublishedError as error:
                logger.error("zero_bnb: checkpoint %r published, but: %r", self.tag, error)
                outcome = [("CheckpointSaveError", f"{_PUBLISHED_MARK}{error}")]
            except CheckpointSaveError as error:  # rank 0's own finding: its message is the cause
                logger.error("zero_bnb: checkpoint %r not published: %s", self.tag, error)
                outcome = [("CheckpointSaveError", str(error))]
                self.cause = self.cause or error
            except Exception as error:  # noqa: BLE001 - reported to every rank below
                kind = failure_kind(error)
                logger.error("zero_bnb: publishing checkpoint %r failed (%s)", self.tag, kind, exc_info=error)
                outcome = [("CheckpointSaveError",
                            f"rank 0 could not publish it: {type(error).__name__}: {error} [{kind}]")]
                self.cause = self.cause or error
            finally:
                self.abort()
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if outcome[0] is not None and outcome[0][1].startswith(_PUBLISHED_MARK):
            raise CheckpointSaveError(f"saving checkpoint {self.tag!r} to {self.save_dir}: "
                                      f"{outcome[0][1][len(_PUBLISHED_MARK):]}")
        if outcome[0] is not None:
            failures = [outcome[0]] + [None] * (len(failures) - 1)
        self._raise_reported(
            failures,
            f"saving checkpoint {self.tag!r} to {self.save_dir} failed; the previous checkpoint and 'latest' are "
            f"unchanged. Fix the cause named here and save again. Cause: ",
        )

    def _staging_intact(self) -> bool:
        """Whether the staging folder rank 0 made is still there under its name (not removed, nor removed and made
        again as another folder by a rank's makedirs). Rank 0."""
        if self._staging_fd < 0:
            return True
        held = os.fstat(self._staging_fd)
        return held.st_nlink > 0 and _identity(self.staging_folder) == (held.st_dev, held.st_ino)

    def abort(self) -> None:
        """Remove the staging folder (if still there) and release the lock. Local; idempotent."""
        if self._staging_fd >= 0:
            descriptor, self._staging_fd = self._staging_fd, -1
            os.close(descriptor)
        if self._lock is None:
            return
        try:
            remove_tree(self.staging_folder)
        except OSError as error:
            logger.error("zero_bnb: could not remove the unfinished %s: %r", self.staging_folder, error)
        finally:
            self._lock.release()
            self._lock = None

    def _publish(self, manifest: Manifest) -> None:
        missing = [f"{record.path} ({record.size} bytes)" for record in manifest.files
                   if not os.path.isfile(os.path.join(self.staging_folder, record.path))
                   or os.path.getsize(os.path.join(self.staging_folder, record.path)) != record.size]
        if missing:
            raise CheckpointSaveError(
                f"files the ranks reported are missing or differ in rank 0's staging folder {self.staging_folder}: "
                f"{missing[:5]}; every rank must save into the same shared folder, and nothing else may remove or "
                f"change the staging folder while the save runs"
            )
        write_manifest(manifest, os.path.join(self.staging_folder, SUBDIR), root=self.staging_folder)
        _publish(self.save_dir, self.tag, self.staging_folder, self.latest_name)
        logger.info(
            "zero_bnb: checkpoint %s committed (%d files, DP=%d)",
            os.path.join(self.save_dir, self.tag), len(manifest.files) + 1, manifest.dp_world_size,
        )
