"""``DeepSpeedEngine`` with zero_bnb's partitioning and elastic ZeRO checkpoints.

The engine subclass (the :mod:`zero_bnb.ds` package is the only code that touches DeepSpeed
internals). The engine is a real ``DeepSpeedEngine``; it differs only in

* the optimizer wrapper it builds (:mod:`zero_bnb.ds.zero_optimizer`: DeepSpeed's ZeRO-1/2 optimizer, or its
  ``BF16_Optimizer`` for bf16 with fp32 gradient accumulation at stage 1, both block-aligned),
* the optimizer files it writes (:mod:`zero_bnb.checkpoint.save`) and reads (:mod:`zero_bnb.checkpoint.restore`,
  and stock DeepSpeed's through :mod:`zero_bnb.checkpoint.stock_import`), so that ``load_checkpoint`` works at
  any DP size,
* how a checkpoint is committed (:mod:`zero_bnb.checkpoint.commit`: staged, fsynced, checksummed,
  published by rename, ``latest`` last; with ``zero_checkpoint_async`` staged and committed in the background,
  :mod:`zero_bnb.checkpoint.background`; DeepSpeed's own files through :mod:`zero_bnb.ds.checkpoint_engine`) and
  planned, checked and applied all-or-nothing on load (:mod:`zero_bnb.checkpoint.load`).

Module weights, LR scheduler and client state stay in DeepSpeed's own model file (the module weights are left
out with ``zero_derived_module_weights: true`` and rebuilt from the master weights on load).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import deepspeed.runtime.engine as ds_engine_module
import deepspeed.runtime.zero.stage3 as ds_stage3_module
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.utils import ZeRORuntimeException
import torch.distributed as dist

from zero_bnb.bnb.chunked import ChunkedUpdate, uninstall_chunked_update
from zero_bnb.checkpoint.background import BackgroundSaver, check_same_switch
from zero_bnb.checkpoint.pending import join_saves_into
from zero_bnb.checkpoint.batch import batch_of, warn_if_batch_changed
from zero_bnb.checkpoint.collective import agree
from zero_bnb.checkpoint.commit import SaveTransaction
from zero_bnb.checkpoint.derived import DERIVED_PARAMS_KEY, derived_entries
from zero_bnb.checkpoint.exclusive import one_at_a_time
from zero_bnb.checkpoint.front_door import mark_if_saving_into
from zero_bnb.checkpoint.load import LoadPlan, apply_module_weights, open_for_load, plan_load
from zero_bnb.checkpoint.masters import MasterPlan, master_candidates, stage_module_slices
from zero_bnb.checkpoint.recovery_script import write_recovery_script
from zero_bnb.checkpoint.restore import apply_masters, apply_restore
from zero_bnb.checkpoint.save import manifest_draft, stage_local_payload
from zero_bnb.checkpoint.staged import StagedSave
from zero_bnb.checkpoint.staging import InlineStaging
from zero_bnb.checkpoint.state_checks import find_non_finite, verify_replicated_state
from zero_bnb.core.config import ZeroBnbConfig
from zero_bnb.core.state_spec import StateRule, declared, spec_for
from zero_bnb.ds.checkpoint_engine import LoadCall, SaveCall, configure_checkpointing
from zero_bnb.ds.load_log import log_load
from zero_bnb.ds.patching import swapped_attribute
from zero_bnb.ds.stage3 import BlockAlignedStage3Optimizer
from zero_bnb.ds.zero_optimizer import BlockAlignedBF16Optimizer, BlockAlignedZeroOptimizer
from zero_bnb.errors import CheckpointSaveError, CheckpointUsageError
from zero_bnb.format.masters import FULL
from zero_bnb.format.stock_files import MODEL_STATES, stage3_model_states, stock_dp_world_size
from zero_bnb.format.tags import resolve_tag
from zero_bnb.kernels.update import install_fused_update, uninstall_fused_update

__all__ = ["ZeroBnbEngine"]

logger = logging.getLogger(__name__)



class ZeroBnbEngine(DeepSpeedEngine):
    """A ``DeepSpeedEngine`` (ZeRO stage 1 or 2) whose checkpoints load at any DP size.

    Built by :func:`zero_bnb.initialize`; takes ``DeepSpeedEngine``'s arguments plus the
    parsed :class:`~zero_bnb.core.config.ZeroBnbConfig`.
    """

    #: The front door that built the engine (a key of ``zero_bnb.checkpoint.batch.FRONT_DOORS``): its messages use
    #: that front door's words. Set by ``zero_bnb.enable()``'s dispatcher and the Lightning strategy.
    zero_bnb_front_door: str = "deepspeed"
    #: The batch geometry (``global``, ``micro``, ``accumulation``, ``dp``) the last loaded checkpoint recorded.
    zero_bnb_loaded_batch: dict[str, int] | None = None
    #: The save or load under way (:meth:`_calling`), ``None`` outside one.
    _zero_bnb_call: SaveCall | LoadCall | None = None

    def __init__(self, *args: Any, zero_bnb_config: ZeroBnbConfig, **kwargs: Any) -> None:
        self.zero_bnb_config = zero_bnb_config
        super().__init__(*args, **kwargs)
        if zero_bnb_config.derived_module_weights and not self.fp16_enabled() and self.global_rank == 0:
            logger.warning(
                "zero_bnb: zero_derived_module_weights saves nothing in fp32 or bf16 training (checkpoints already "
                "store each weight once: the master weights derive from the module weights in DeepSpeed's model "
                "file), and it leaves the module weights out of that file, so stock DeepSpeed cannot read them; "
                "remove the key (it still saves 2 bytes per parameter with fp16, whose masters are stored whole)"
            )

    # -- construction -------------------------------------------------------------------------

    def _state_rule(self, spec) -> StateRule:
        config = self.zero_bnb_config
        keys = config.unsharded_state_keys
        if keys is None:
            keys = spec.replicated_by_default
            if keys and self.global_rank == 0:
                logger.info(
                    "zero_bnb: zero_unsharded_state_keys not set; keeping %s replicated (the default for %s)",
                    list(keys),
                    spec.name,
                )
        return StateRule(unsharded_keys=frozenset(keys), max_numel=config.unsharded_state_max_numel)

    def _do_optimizer_sanity_check(self, basic_optimizer):
        # DeepSpeed warns "untested optimizer" for anything outside its own list; the families zero_bnb
        # declares (zero_bnb.core.state_spec.SPECS) are tested under ZeRO here, so that warning is not shown for them.
        if not declared(basic_optimizer):
            return super()._do_optimizer_sanity_check(basic_optimizer)
        with swapped_attribute(ds_engine_module, "is_zero_supported_optimizer", lambda optimizer: True):
            return super()._do_optimizer_sanity_check(basic_optimizer)

    def _configure_zero_optimizer(self, optimizer):
        # zero_bnb.initialize refused stages other than 1, 2 and 3 before DeepSpeed started.
        if self.zero_optimization_partition_weights():  # stage 3: DeepSpeed imports its class from this module
            if self.has_moe_layers:
                raise ZeRORuntimeException("mixture-of-experts layers are not supported by zero_bnb")
            return self._block_aligned("DeepSpeedZeroOptimizer_Stage3", BlockAlignedStage3Optimizer, optimizer,
                                       super()._configure_zero_optimizer, owner=ds_stage3_module)
        return self._block_aligned("DeepSpeedZeroOptimizer", BlockAlignedZeroOptimizer, optimizer,
                                   super()._configure_zero_optimizer)

    def _configure_bf16_optimizer(self, optimizer):
        return self._block_aligned("BF16_Optimizer", BlockAlignedBF16Optimizer, optimizer,
                                   super()._configure_bf16_optimizer)

    def _block_aligned(self, ds_name: str, cls: type, optimizer, build, owner: Any = ds_engine_module):
        """Let DeepSpeed build its optimizer wrapper ``ds_name`` (a name in ``owner``) as zero_bnb's ``cls``."""
        spec = spec_for(optimizer)
        factory = functools.partial(cls, zero_bnb_spec=spec, zero_bnb_rule=self._state_rule(spec))
        try:
            if spec.bitsandbytes:  # 8-bit updates take zero_bnb's kernels as zero_cpu_update/zero_gpu_update say, and
                install_fused_update(optimizer, self.zero_bnb_config.cpu_update, self.zero_bnb_config.gpu_update,
                                     announce=self.global_rank == 0)
                # partitions above the kernels' 2^31 elements are updated in pieces (DeepSpeed's constructor steps once)
                optimizer.update_step = ChunkedUpdate(optimizer, spec, self.zero_bnb_config.update_max_numel)
            with swapped_attribute(owner, ds_name, factory):
                wrapper = build(optimizer)
            if not isinstance(wrapper, cls):
                raise ZeRORuntimeException(
                    f"DeepSpeed built {type(wrapper).__name__} instead of zero_bnb's {cls.__name__}; features that "
                    f"replace it (zenflow, Muon) are not supported by zero_bnb"
                )
        except BaseException:
            uninstall_chunked_update(optimizer)  # the user's optimizer leaves a failed construction as it came
            uninstall_fused_update(optimizer)
            raise
        return wrapper

    def _configure_checkpointing(self, *args):  # DeepSpeed 0.17.0 passes dist_init_required
        configure_checkpointing(self, lambda: super(ZeroBnbEngine, self)._configure_checkpointing(*args))

    # -- checkpoints --------------------------------------------------------------------------

    @one_at_a_time
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's ``save_checkpoint``, committed atomically and written DP-independently.

        Collective: all ranks must call it. Before any file is written, replicated optimizer
        state is verified across ranks and master weights and state are scanned for NaN/Inf
        (``zero_nonfinite_check``). Files go to a hidden staging folder, are fsynced and
        checksummed, and the folder is renamed to ``save_dir/tag`` only when every rank has
        succeeded; ``latest`` is replaced after that. With ``zero_checkpoint_async`` it returns once
        every tensor it writes is staged in host memory; the rest runs in a background writer
        (:mod:`zero_bnb.checkpoint.background`), whose failure the next save, load or
        :meth:`wait_for_checkpoint` raises.

        Raises:
            zero_bnb.errors.CheckpointError: on every rank; the previous checkpoint and
                ``latest`` are then unchanged (also: a pending asynchronous save that failed).
            zero_bnb.errors.CheckpointUsageError: on the calling rank only, when another
                ``save_checkpoint`` or ``load_checkpoint`` of this engine is still running
                (:mod:`zero_bnb.checkpoint.exclusive`).
        """
        if not save_dir or not isinstance(save_dir, (str, os.PathLike)):
            raise CheckpointUsageError(f"save_dir must be a non-empty path, got {save_dir!r}")
        # one save at a time; a failed asynchronous save is raised here, saying that this one was not written
        self._wait_before(f"checkpoint {str(tag) if tag is not None else f'global_step{self.global_steps}'!r} was "
                          f"not saved (nothing of it was written); call save_checkpoint again to save it")
        self._agree_on_async_saves()
        save_dir = os.fspath(save_dir)
        join_saves_into(save_dir)  # another engine's pending save holds the folder's lock until it commits
        mark_if_saving_into(save_dir)  # a front door's folder (Accelerate's) is marked unfinished before any write
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        transaction = SaveTransaction(save_dir, tag, save_latest=save_latest)  # refuses unsafe tags on every rank
        verify_replicated_state(self.optimizer)
        non_finite = find_non_finite(self.optimizer, self.param_names, self.zero_bnb_config.nonfinite_check)
        draft, batch = manifest_draft(self.optimizer, self.param_names, non_finite), batch_of(self)
        saver = self._zero_bnb_saver()
        staging = InlineStaging() if saver is None else saver.pool  # a synchronous save copies nothing ahead
        if saver is not None:
            transaction.group = saver.process_group()
        staging.begin()
        weights = self._saved_module_weights(exclude_frozen_parameters)
        candidates = master_candidates(self.optimizer, weights, self.param_names)
        transaction.begin(durable_lock=saver is None)  # asynchronous: the lock record's fsync is left to the writer
        call = SaveCall(transaction, staging)

        def manifest(files, masters: list[MasterPlan]):
            return dataclasses.replace(draft(files, masters), batch=batch)

        def after_publish() -> None:
            write_recovery_script(save_dir)  # DeepSpeed's zero_to_fp32.py habit

        try:
            with self._calling(call):  # DeepSpeed's files, and the optimizer files, staged: written by the writer
                super().save_checkpoint(save_dir, tag=transaction.staging_tag,
                                        client_state={} if client_state is None else client_state, save_latest=False,
                                        exclude_frozen_parameters=exclude_frozen_parameters)
            try:  # after DeepSpeed's model file: where its copy was staged, the module weights are views of it
                slices = stage_module_slices(self.optimizer, candidates, weights, self.param_names,
                                             staging.view_or_copy)
            except Exception as error:  # noqa: BLE001 - the writers then store the masters whole, on every rank
                logger.warning("zero_bnb: staging the module weights failed (%r); this save stores the fp32 master "
                               "weights whole", error)
                slices = {}
            staging.trim()
            work = StagedSave(transaction, self.optimizer, self.param_names, candidates, slices, call.deferred,
                              manifest, after_publish, staging.copies_done(), background=saver is not None)
            if saver is not None:
                saver.start(tag, work.run, save_dir)
        except BaseException:
            transaction.abort()  # an error outside every guard, or no writer will commit: leave no lock or staging
            raise
        if saver is None:
            work.run()  # decide the masters, write, commit: what the background writer runs for an asynchronous save
        return True

    def wait_for_checkpoint(self) -> None:
        """Block until this engine's asynchronous save (``zero_checkpoint_async``), if one is pending, is committed.

        Local (each rank waits for its own writer; the writers agree among themselves). A no-op for
        synchronous saves. ``save_checkpoint``, ``load_checkpoint`` and ``destroy`` call it first.

        Raises:
            zero_bnb.errors.CheckpointSaveError: the last asynchronous save failed (the previous checkpoint
                and ``latest`` are then unchanged); raised once.
        """
        saver = getattr(self, "_zero_bnb_background", None)
        if saver is not None:
            saver.wait()

    def _wait_before(self, what: str) -> None:
        """:meth:`wait_for_checkpoint` before a save or a load; a failure of the pending asynchronous save is raised
        with ``what`` (what became of the call that found it) in front. Local."""
        try:
            self.wait_for_checkpoint()
        except CheckpointSaveError as error:
            raise CheckpointSaveError(f"{what}: the previous asynchronous save failed, and is reported here (once). "
                                      f"{error}") from error

    def _agree_on_async_saves(self) -> None:
        """At this engine's first save, check that every rank has the same ``zero_checkpoint_async``
        (:func:`~zero_bnb.checkpoint.background.check_same_switch`). Collective."""
        if not getattr(self, "_zero_bnb_async_agreed", False):
            check_same_switch(self.zero_bnb_config.checkpoint_async)
            self._zero_bnb_async_agreed = True

    def _zero_bnb_saver(self) -> BackgroundSaver | None:
        """The asynchronous saver (created at the first asynchronous save), or ``None`` for synchronous saves."""
        config = self.zero_bnb_config
        if not config.checkpoint_async:
            return None
        saver = getattr(self, "_zero_bnb_background", None)
        if saver is None:
            limit = config.checkpoint_async_max_staging_mb
            saver = self._zero_bnb_background = BackgroundSaver(None if limit is None else int(limit * 2**20))
        return saver

    def destroy(self) -> None:
        """DeepSpeed's ``destroy``, after this rank's pending asynchronous save is finished and the staging buffers
        freed. Local.

        Raises:
            zero_bnb.errors.CheckpointSaveError: that save failed (raised once DeepSpeed's ``destroy`` ran).
        """
        saver = getattr(self, "_zero_bnb_background", None)
        try:
            if saver is not None:
                saver.close()  # a pending save is finished, the staging buffers freed; its failure raised
        finally:
            super().destroy()

    def __del__(self) -> None:
        # DeepSpeed's __del__ calls destroy() and swallows what it raises: a failed asynchronous save is left for the
        # end of the process to report (exit status 1) instead (zero_bnb.checkpoint.background).
        saver = getattr(self, "_zero_bnb_background", None)
        if saver is not None:
            saver.close(report=False)
        super().__del__()

    def _save_checkpoint(self, save_dir, tag, client_state=None, exclude_frozen_parameters=False):
        call = self._save_call()
        derived = self._derived_module_weights()
        call.dropped = set(derived)
        # A plain DeepSpeed engine given this checkpoint (zero_bnb.enable() forgotten) fails naming zero_bnb.
        extra = {"dp_world_size": stock_dp_world_size(self.optimizer.dp_size,
                                                      stage3=self.optimizer.module_weights_partitioned)}
        if derived:
            extra[DERIVED_PARAMS_KEY] = derived
        try:
            with call.transaction.guard():
                super()._save_checkpoint(save_dir, tag, client_state={**(client_state or {}), **extra},
                                         exclude_frozen_parameters=exclude_frozen_parameters)
        finally:
            call.dropped = set()

    def _saved_module_weights(self, exclude_frozen_parameters: bool) -> dict[str, Any] | None:
        """The parameters DeepSpeed's model file will hold, by state-dict key: the master weights derive from them.
        ``None`` where it holds none: ``zero_derived_module_weights`` leaves them out, and at ZeRO stage 3 the
        module's parameters are partitioned placeholders (DeepSpeed names that model file per rank)."""
        if self.zero_bnb_config.derived_module_weights or self.zero_optimization_partition_weights():
            return None
        return self.module_state_dict(keep_vars=True, exclude_frozen_parameters=exclude_frozen_parameters)

    def _derived_module_weights(self) -> dict[str, list[str]]:
        """Model-file entries to drop (``zero_derived_module_weights``): trained weights are their master weights
        cast to the module dtype, so they can be stored once, in the shards. Off by default: DeepSpeed's model file
        then holds the module weights for stock DeepSpeed, ``load_module_only`` and other readers."""
        if not self.zero_bnb_config.derived_module_weights:
            return {}
        return derived_entries(self.module, {p: self.param_names[p] for p in self.optimizer.trained_params()})

    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        state = super().module_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars,
                                          exclude_frozen_parameters=exclude_frozen_parameters)
        call = self._zero_bnb_call
        for key in call.dropped if isinstance(call, SaveCall) else ():
            state.pop(prefix + key, None)
        return state

    def load_module_state_dict(self, checkpoint, *args, **kwargs):
        # The other arguments pass through (z3_params_to_fetch and allowed_missing_keys arrived in DeepSpeed 0.19).
        if DERIVED_PARAMS_KEY in checkpoint:  # a plan puts the module weights back before this point
            raise ZeRORuntimeException("zero_bnb checkpoints load only through ZeroBnbEngine.load_checkpoint")
        return super().load_module_state_dict(checkpoint, *args, **kwargs)

    def _save_zero_checkpoint(self, save_path, tag):
        call, folder = self._save_call(), os.path.join(save_path, str(tag))
        whole = [MasterPlan(FULL)] * self.optimizer.num_groups  # the writer decides which derive (StagedSave.run)
        with call.transaction.guard():
            staged = self.checkpoint_engine.defer(folder, lambda: stage_local_payload(
                self.optimizer, whole, call.staging.tensor, call.staging.master), "the optimizer files")
            if not staged:  # over an asynchronous save's staging limit: written now, the masters whole
                call.transaction.add(stage_local_payload(self.optimizer, whole).write(folder))

    @contextmanager
    def _calling(self, call: SaveCall | LoadCall) -> Iterator[SaveCall | LoadCall]:
        """The one record of the save or load under way, for DeepSpeed's methods that zero_bnb overrides and for its
        checkpoint engine; set for the block, cleared after it (also when it raises). Local."""
        self._zero_bnb_call = self.checkpoint_engine.call = call
        try:
            yield call
        finally:
            self._zero_bnb_call = self.checkpoint_engine.call = None

    def _save_call(self) -> SaveCall:
        call = self._zero_bnb_call
        if not isinstance(call, SaveCall):
            raise ZeRORuntimeException("zero_bnb saves ZeRO state only through ZeroBnbEngine.save_checkpoint")
        return call

    @one_at_a_time
    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
        custom_load_fn=None,
    ):
        """DeepSpeed's ``load_checkpoint``, at any DP size, with every check done before anything changes.

        Collective: all ranks must call it. The checkpoint (zero_bnb, or stock DeepSpeed ZeRO-1
        at its own DP size) is verified first: tag, manifest, files, checksums, parameter names
        and shapes, optimizer and block size. Then every rank reads everything the load will
        write (optimizer partitions, module weights checked against the model) into new tensors
        and the ranks agree; only then is anything replaced. On any problem every rank raises
        the same error and the engine is left exactly as it was. ``load_module_only`` and
        ``load_optimizer_states=False`` restore the exact fp32 master weights too.

        Returns:
            DeepSpeed's ``(load_path, client_state)``; ``(None, None)`` when ``tag`` is ``None`` and
            ``load_dir`` has no ``latest`` file.

        Raises:
            zero_bnb.errors.CheckpointUsageError: on the calling rank only, when another
                ``save_checkpoint`` or ``load_checkpoint`` of this engine is still running.
        """
        # a pending asynchronous save is committed first (its failure raised here, saying that nothing was loaded)
        self._wait_before("nothing was loaded (the engine is as it was); call load_checkpoint again to load")
        join_saves_into(load_dir)  # and another engine's into this folder (its outcome left to that engine)
        if self.load_universal_checkpoint():
            raise ZeRORuntimeException(
                "checkpoint.load_universal is set, but zero_bnb engines load their own checkpoints at any DP size; "
                "remove checkpoint.load_universal from the config"
            )
        folder_tag = agree(lambda: resolve_tag(load_dir, None if tag is None else str(tag)))
        if folder_tag is None:
            return super().load_checkpoint(load_dir, tag=None)  # DeepSpeed warns that there is no 'latest'
        optimizer_states = load_optimizer_states and not load_module_only
        if custom_load_fn is not None and self.optimizer.module_weights_partitioned:
            raise ZeRORuntimeException(
                "load_checkpoint(custom_load_fn=...) is not supported at ZeRO stage 3 by zero_bnb (the module's weights "
                "are partitions set from the master weights); load without it"
            )
        opened = open_for_load(self, load_dir, folder_tag, optimizer_states=optimizer_states,
                               module_only=load_module_only)
        try:
            plan: LoadPlan = agree(lambda: plan_load(
                self, opened, self._model_file(load_dir, folder_tag, opened), optimizer_states=optimizer_states,
                strict=load_module_strict, module_only=load_module_only, scheduler_states=load_lr_scheduler_states,
                custom_load_fn=custom_load_fn is not None))
        finally:
            opened.close()  # everything is read (shards stay memory-mapped)
        saved = opened.saved
        warn_if_batch_changed(saved.manifest, self, os.path.join(load_dir, folder_tag), self.zero_bnb_front_door)
        self.zero_bnb_loaded_batch = dict(saved.manifest.batch) or None
        partitioned = self.optimizer.module_weights_partitioned
        # DeepSpeed asserts that the model file's path exists before it "reads" it (state_dict_factory.py); a re-save
        # of the tag can move the folder away at that moment on one rank only, which would fail that rank alone
        # after the plan was agreed. It is handed an empty private file standing in for the planned model states.
        stand_in = tempfile.NamedTemporaryFile(prefix="zero_bnb_planned_model_states_", suffix=".pt")
        try:
            with self._calling(LoadCall(plan, {stand_in.name: plan.model_states})):
                    result = super().load_checkpoint(
                    load_dir,
                    tag=folder_tag,
                    load_module_strict=load_module_strict,
                    # At stage 3 DeepSpeed would rebuild weights-only loads from its own optimizer files
                    # (zero_to_fp32); the plan already holds what to apply (state or masters only) and
                    # _load_zero_checkpoint applies it.
                    load_optimizer_states=True if partitioned else load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only,
                    custom_load_fn=custom_load_fn,
                )
        finally:
            stand_in.close()
        if result[0] == stand_in.name:
            result = (plan.model_file, *result[1:])
        if not optimizer_states:
            # DeepSpeed rebuilt the fp32 masters from the module's (maybe bf16) weights; the exact ones are on disk.
            apply_masters(self.optimizer, plan.optimizer)
        if partitioned:  # stage 3: the module's partitions from the masters, persistent parameters gathered again
            self.optimizer.cast_masters_into_module()
        else:
            apply_module_weights(self.optimizer, plan)  # the plan left the trained module weights to this
        return result

    def _model_file(self, load_dir, tag, opened) -> str:
        """DeepSpeed's model file a load reads: ``mp_rank_00_model_states.pt`` from stages 1/2; from stage 3, where
        every DP rank wrote one (module entries are empty placeholders, the rest alike), rank 0's, which exists at
        every saved DP size. A zero_bnb checkpoint of either stage loads at the other (weights come from the masters)."""
        folder = os.path.join(load_dir, str(tag))
        names = (stage3_model_states(0), MODEL_STATES)  # zero_bnb.initialize refuses mpu: model-parallel rank 0
        if not self.optimizer.module_weights_partitioned:
            names = names[::-1]
        if opened.reader is not None:
            saved = {record.path for record in opened.reader.manifest.files}
            names = [name for name in names if name in saved] or names
        return os.path.join(folder, names[0])

    def _get_all_ckpt_names(self, checkpoints_path, tag):
        call = self._zero_bnb_call
        if isinstance(call, LoadCall):  # the model file the plan read (its stand-in), not whatever a glob finds now
            return list(call.planned)
        return super()._get_all_ckpt_names(checkpoints_path, tag)

    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        call = self._zero_bnb_call
        if not isinstance(call, LoadCall):
            raise ZeRORuntimeException("zero_bnb loads ZeRO state only through ZeroBnbEngine.load_checkpoint")
        plan: LoadPlan = call.plan
        apply_restore(self.optimizer, plan.optimizer)
        if self.global_rank == 0:
            log_load(self, os.path.join(load_dir, str(tag)), plan)
        return True
