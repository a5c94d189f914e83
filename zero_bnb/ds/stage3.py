"""DeepSpeed's ZeRO stage-3 optimizer with per-parameter partitions that start on quantization blocks.

:class:`BlockAlignedStage3Optimizer` differs from ``DeepSpeedZeroOptimizer_Stage3`` in three places
(see :mod:`zero_bnb.core.stage3` for the geometry):

* every trained parameter is partitioned into slices of whole blocks: ``Init._padding_size`` pads a
  parameter that carries ``zero_bnb_block_size`` to ``lcm(block_size, 2) * dp`` elements (a module-level
  patch that leaves every other parameter as DeepSpeed pads it), and ``Init._partition_param`` zeroes
  the padding of its slice (DeepSpeed leaves it uninitialised: with L2 weight decay, which SGD, RMSprop
  and Adagrad add to the gradient, garbage there became state and the ``absmax`` of the block it shares
  with real elements); parameters that ``deepspeed.zero.Init`` already partitioned are gathered once and
  partitioned again;
* gradients are reduce-scattered on those slices: DeepSpeed's own ``__avg_scatter_grads`` runs, and the
  ``reduce_scatter_coalesced`` it calls (which cuts ``ceil(numel / dp)``) is handed each gradient zero-padded
  to its parameter's whole slices (a module-level patch that passes a stock engine's gradients as they are;
  the override of ``__avg_scatter_grads`` only names the bucket's parameters to it); a one-parameter
  all-gather (``_all_gather_sequential``, whose buffer is ``ceil(numel / dp) * dp``) goes through a buffer of
  the padded size, and at DP=1 (no gather) the parameter is a view of its partition's first ``numel`` elements;
* each sub-group holds one parameter, so the base optimizer's state of a sub-group is one parameter's
  slice and a checkpoint group is one parameter at every DP size.

Everything else (prefetching, gathering, loss scaling, the step loop) is DeepSpeed's. Construction is
collective: every rank of the data-parallel group must construct it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero import stage3 as deepspeed_stage3
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from zero_bnb.core.layout import GroupGeometry
from zero_bnb.core.stage3 import gathered_numel, padding_size
from zero_bnb.core.state_spec import OptimizerSpec, StateRule
from zero_bnb.ds.aligned import BlockAligned, ZeroLayoutError
from zero_bnb.ds.versions import uses_muon
from zero_bnb.format.manifest import ParamEntry

try:  # imported before the engine swaps DeepSpeedZeroOptimizer_Stage3 for a factory: it subclasses it on import
    from deepspeed.runtime.superoffload import superoffload_stage3  # noqa: F401
except ImportError:  # DeepSpeed releases without super-offload
    superoffload_stage3 = None

__all__ = ["BlockAlignedStage3Optimizer", "refuse_stage3_settings"]

logger = logging.getLogger(__name__)

#: Marks a parameter zero_bnb partitions on blocks; its value is the block size.
BLOCK_ATTRIBUTE = "zero_bnb_block_size"

_INSTALL_LOCK = threading.Lock()
_installed = False


def _block_padding_size(original):
    def _padding_size(self, param):
        block = getattr(param, BLOCK_ATTRIBUTE, None)
        if block is None:
            return original(self, param)
        return padding_size(param.ds_numel, dist.get_world_size(group=self.get_partition_dp_group(param)), block)

    _padding_size.zero_bnb_original = original
    return _padding_size


def _zero_padding(param: torch.nn.Parameter, rank: int) -> None:
    """Zero the elements of ``param``'s slice (``ds_tensor``, rank ``rank``'s) that lie past the parameter's end."""
    tensor = param.ds_tensor
    size = tensor.numel()
    real = max(0, min(size, param.ds_numel - rank * size))
    if real < size:
        with torch.no_grad():
            tensor.narrow(0, real, size - real).zero_()


def _zeroed_padding(original):
    def _partition_param(self, param, buffer=None, has_been_updated=False, free_data=True, **kwargs):
        # DeepSpeed writes a slice (and leaves its padding as torch.empty left it) when it creates the slice or the
        # full parameter was updated; otherwise it only frees the gathered parameter.
        writes = (getattr(param, BLOCK_ATTRIBUTE, None) is not None and param.ds_status is ZeroParamStatus.AVAILABLE
                  and (param.ds_tensor is None or has_been_updated))
        result = original(self, param, buffer, has_been_updated, free_data, **kwargs)
        if writes and param.ds_tensor is not None:
            _zero_padding(param, dist.get_rank(group=self.get_partition_dp_group(param)))
        return result

    _partition_param.zero_bnb_original = original
    return _partition_param


def _padded_allgather(original):
    def _dist_allgather_fn(input_tensor, output_tensor, group=None):
        world = dist.get_world_size(group=group)
        needed = gathered_numel(input_tensor.numel(), world)
        if output_tensor.numel() >= needed:
            return original(input_tensor, output_tensor, group)
        # DeepSpeed's one-parameter gather sized its buffer ceil(numel / dp) * dp; a zero_bnb slice is larger.
        # Slices are consecutive element ranges, so the parameter is the prefix of the whole gather.
        whole = torch.empty(needed, dtype=output_tensor.dtype, device=output_tensor.device)
        original(input_tensor, whole, group).wait()
        output_tensor.copy_(whole[: output_tensor.numel()])
        return _DoneHandle()

    _dist_allgather_fn.zero_bnb_original = original
    return _dist_allgather_fn


def _unpadded_no_gather(original):
    def _no_gather_coalesced(params):
        # At DP=1 DeepSpeed views the partition as the parameter (no gather); a zero_bnb partition is padded to
        # whole blocks, so the view is taken of its first numel elements (same storage, as DeepSpeed's).
        params = list(params)
        padded = [(param, param.ds_tensor) for param in params if getattr(param, BLOCK_ATTRIBUTE, None)
                  and param.ds_tensor is not None and param.ds_tensor.numel() > param.ds_numel]
        for param, tensor in padded:
            param.ds_tensor = tensor.narrow(0, 0, param.ds_numel)
        try:
            return original(params)
        finally:
            for param, tensor in padded:
                param.ds_tensor = tensor

    _no_gather_coalesced.zero_bnb_original = original
    return _no_gather_coalesced


#: The parameters whose gradients the current thread's ``__avg_scatter_grads`` reduce-scatters on blocks.
_REDUCING = threading.local()


@contextlib.contextmanager
def _cutting_on_blocks(params):
    """Within: the next ``reduce_scatter_coalesced`` of stage 3 (the one in DeepSpeed's ``__avg_scatter_grads``)
    reduces ``params``' gradients, in that order, on their block-aligned slices. Local."""
    _REDUCING.params = list(params)
    try:
        yield
        if _REDUCING.params is not None:
            raise ZeroLayoutError("DeepSpeed reduced a stage-3 gradient bucket without reduce_scatter_coalesced, so "
                                  "not on zero_bnb's block-aligned slices; this DeepSpeed version reduces differently "
                                  "from the supported range")
    finally:
        _REDUCING.params = None


def _filling_slices(grad: torch.Tensor, param: torch.nn.Parameter, world: int) -> torch.Tensor:
    """``grad`` zero-padded to ``world`` whole slices of ``param`` (``reduce_scatter_coalesced`` cuts
    ``ceil(numel / world)``); a gradient already that long goes as it is."""
    size = gathered_numel(param.partition_numel(), world)
    if grad.numel() >= size:
        return grad
    padded = torch.zeros(size, dtype=grad.dtype, device=grad.device)
    padded[: grad.numel()].copy_(grad.reshape(-1))
    return padded


def _block_reduce_scatter(original):
    def reduce_scatter_coalesced(tensors, group=None):
        params, _REDUCING.params = getattr(_REDUCING, "params", None), None
        if params is None:  # a stock engine's gradients
            return original(tensors, group)
        if len(params) != len(tensors):
            raise ZeroLayoutError(f"DeepSpeed reduce-scattered {len(tensors)} gradients for a bucket of {len(params)} "
                                  f"stage-3 parameters; this DeepSpeed version reduces differently from the supported "
                                  f"range")
        world = dist.get_world_size(group=group)
        return original([_filling_slices(grad, param, world) for grad, param in zip(tensors, params)], group)

    reduce_scatter_coalesced.zero_bnb_original = original
    return reduce_scatter_coalesced


class _DoneHandle:
    """The handle of a collective that already completed."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


def install_block_partitioning() -> None:
    """Patch DeepSpeed's parameter padding (its size and its zeroing), one-parameter all-gather and stage 3's
    gradient reduce-scatter (once per process).

    The patches change nothing for parameters without ``zero_bnb_block_size`` and for reduce-scatters outside a
    :class:`BlockAlignedStage3Optimizer`'s ``__avg_scatter_grads``: stock stage-3 engines in the same process
    partition, gather and reduce exactly as before. Local.
    """
    global _installed
    with _INSTALL_LOCK:
        if _installed:
            return
        init = partition_parameters.Init
        init._padding_size = _block_padding_size(init._padding_size)
        init._partition_param = _zeroed_padding(init._partition_param)
        partition_parameters._dist_allgather_fn = _padded_allgather(partition_parameters._dist_allgather_fn)
        partition_parameters._no_gather_coalesced = _unpadded_no_gather(partition_parameters._no_gather_coalesced)
        # stage3.py imports the function by name (from ... import), so its module attribute is the one it calls
        deepspeed_stage3.reduce_scatter_coalesced = _block_reduce_scatter(deepspeed_stage3.reduce_scatter_coalesced)
        _installed = True


def _offload_problems(zero: Mapping[str, Any]) -> list[str]:
    """What zero_bnb refuses of stage 3's offload sections (a section that is not an object is left to
    :func:`zero_bnb.core.config.prepare_offload`, which names it).

    Accepted: ``offload_optimizer`` and ``offload_param`` with ``device: "cpu"``. The fp32 partitions, the
    gradients' fp32 copies and the optimizer state live in CPU memory, the client optimizer steps there (8-bit
    state through the fused CPU kernel, :mod:`zero_bnb.kernels.update`), and parameter partitions wait in
    CPU memory between gathers; every buffer DeepSpeed allocates for them is sized by the (block-aligned)
    partition, so the layout is the one without offload and a checkpoint is the same files either way.
    """
    problems = []
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if not isinstance(section, Mapping):
            continue
        device = str(section.get("device", "none") or "none")
        if device == "nvme":
            problems.append(f"zero_optimization.{key}.device='nvme' (ZeRO-Infinity's NVMe swapping writes the "
                            f"{'optimizer state' if key == 'offload_optimizer' else 'parameter partitions'} to its own "
                            f"swap files; use \"device\": \"cpu\" (the 8-bit state is a quarter of fp32 Adam's))")
        elif key == "offload_param" and device not in ("none", "cpu"):
            problems.append(f"zero_optimization.offload_param.device={device!r} (use \"cpu\" or \"none\")")
    optimizer = zero.get("offload_optimizer")
    if isinstance(optimizer, Mapping) and str(optimizer.get("device", "none")) == "cpu":
        ratio = optimizer.get("ratio", 1.0)
        if ratio != 1.0:
            problems.append(f"zero_optimization.offload_optimizer.ratio={ratio!r} (partial offload steps the "
                            f"parameters it keeps on the accelerator with torch AdamW and needs DeepSpeedCPUAdam, not "
                            f"your optimizer; remove ratio to offload everything)")
        if optimizer.get("super_offload"):
            problems.append("zero_optimization.offload_optimizer.super_offload=true (remove it)")
    return problems


#: ``sub_group_size`` values nobody chose: DeepSpeed's default, and Lightning's (its strategy writes it into every
#: stage-3 config).
_DEFAULT_SUB_GROUP_SIZES = (10**9, 10**12)


def _warn_without_effect(zero: Mapping[str, Any]) -> None:
    """Warn (rank 0, or every process before the process group exists) for stage-3 settings zero_bnb accepts that
    have no effect under it. Local."""
    value = zero.get("sub_group_size")
    if value is None or value in _DEFAULT_SUB_GROUP_SIZES:
        return
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning("zero_bnb: zero_optimization.sub_group_size=%r has no effect at ZeRO stage 3: every sub-group "
                       "holds one parameter (never more elements than DeepSpeed's packing would put together), so "
                       "a checkpoint group is one parameter at every DP size; remove the setting", value)


def refuse_stage3_settings(ds_config: dict) -> None:
    """Refuse stage-3 settings zero_bnb does not support, naming the setting and the alternative; warn for
    accepted ones that have no effect (``sub_group_size``).

    Raises:
        zero_bnb.core.config.ZeroBnbConfigError: one line per refused setting.
    """
    from zero_bnb.core.config import ZeroBnbConfigError

    zero = ds_config.get("zero_optimization") or {}
    problems = _offload_problems(zero)
    for key in ("zero_hpz_partition_size", "mics_shard_size"):
        if zero.get(key) not in (None, 0, 1, -1):
            problems.append(f"zero_optimization.{key}={zero.get(key)!r} (hierarchical partitions / MiCS; remove it)")
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if zero.get(key):
            problems.append(f"zero_optimization.{key}=true (quantized communication; remove it)")
    if zero.get("reduce_scatter", True) is False:
        problems.append("zero_optimization.reduce_scatter=false (remove it: zero_bnb reduce-scatters on blocks)")
    if (zero.get("super_offload") or ds_config.get("super_offload")):
        problems.append("super_offload (remove it)")
    if zero.get("zenflow"):
        problems.append("zero_optimization.zenflow (remove it)")
    if problems:
        raise ZeroBnbConfigError("zero_bnb does not support these ZeRO stage-3 settings: " + "; ".join(problems))
    _warn_without_effect(zero)


def _align_parameters(module: torch.nn.Module, block_size: int, dp: int) -> int:
    """Mark every parameter for block-aligned partitioning; re-partition those ``zero.Init`` already cut.

    Collective (a re-partition all-gathers the parameter): every rank must call it with the same module.
    Returns how many parameters were re-partitioned.
    """
    moved = 0
    with torch.no_grad():
        for param in module.parameters():
            partitioned = getattr(param, "ds_tensor", None) is not None
            stale = partitioned and (param.ds_tensor.ds_numel
                                     != GroupGeometry(param.ds_numel, dp, block_size).partition_numel)
            if stale:  # gathered on DeepSpeed's padding, before the attribute changes what _padding_size says
                param.all_gather()
            setattr(param, BLOCK_ATTRIBUTE, block_size)
            if stale:
                param.ds_tensor = None
                param.partition()
                moved += 1
            elif partitioned:  # already whole blocks (stock padding gave them, or an earlier engine did): zero padding
                _zero_padding(param, dist.get_rank(group=param.ds_process_group))
    return moved


class BlockAlignedStage3Optimizer(BlockAligned, DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` whose parameter slices hold whole quantization blocks.

    Built by :class:`zero_bnb.ds.engine.ZeroBnbEngine` with DeepSpeed's arguments plus the optimizer's
    declared state layout and the user's replication rule.
    """

    #: Module weights live in the partitions (``ds_tensor``), refreshed from the masters after a load,
    #: not in DeepSpeed's model file.
    module_weights_partitioned = True
    #: bitsandbytes' 8-bit vs fp32 decision is made on the whole parameter (:meth:`_whole_parameter_config`).
    precision_on_whole_parameter = True

    def __init__(self, module, init_optimizer, *args, zero_bnb_spec: OptimizerSpec, zero_bnb_rule: StateRule,
                 **kwargs):
        self._prepare_block_alignment(zero_bnb_spec, zero_bnb_rule, kwargs.get("dp_process_group"))
        install_block_partitioning()
        moved = _align_parameters(module, zero_bnb_spec.block_size, self._zero_bnb_dp)
        if moved and dist.get_rank() == 0:
            logger.info("zero_bnb: re-partitioned %d parameters created under deepspeed.zero.Init on blocks", moved)
        if zero_bnb_spec.bitsandbytes:  # DeepSpeed's constructor creates the state (one step with zero gradients)
            init_optimizer.get_config = self._whole_parameter_config(init_optimizer.get_config)
        try:
            super().__init__(module, init_optimizer, *args, **kwargs)
        except BaseException:
            init_optimizer.__dict__.pop("get_config", None)
            raise
        self._check_layout()

    def _whole_parameter_config(self, original):
        """bitsandbytes' ``get_config``, with ``min_8bit_size`` decided on the whole parameter, not its slice.

        bitsandbytes keeps fp32 state for a tensor below ``min_8bit_size`` elements; the tensor it sees is one
        rank's slice, whose size depends on the DP size. Deciding on the whole parameter keeps every parameter's
        state precision the same at every DP size (``state_precision`` records the decision per group).
        """
        numel_of: dict[int, int] = {}

        def get_config(gindex, pindex, group):
            config = original(gindex, pindex, group)
            tensor = self.optimizer.param_groups[gindex]["params"][pindex]
            if id(tensor) not in numel_of:
                numel_of.update({id(flat): sum(p.ds_numel for p in params)
                                 for flat, params in zip(self.fp32_partitioned_groups_flat, self.fp16_groups)})
            whole = numel_of.get(id(tensor))
            if whole is not None:
                config["min_8bit_size"] = 0 if whole >= config["min_8bit_size"] else tensor.numel() + 1
            return config

        get_config.zero_bnb_original = original
        return get_config

    # -- DeepSpeed hooks ------------------------------------------------------------------------

    def _create_fp16_sub_groups(self, params_group):
        """One parameter per sub-group: its flat fp32 tensor is that parameter's slice."""
        return [[param] for param in params_group]

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, *args, **kwargs):
        """DeepSpeed's gradient average and reduce-scatter (its own body, any release's signature), whose
        ``reduce_scatter_coalesced`` cuts the block-aligned slices of ``params_to_reduce``."""
        with _cutting_on_blocks(params_to_reduce):
            return super()._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params_to_reduce, *args, **kwargs)

    # -- zero_bnb's vocabulary ------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.fp32_partitioned_groups_flat)

    def base_group_index(self, group_index: int) -> int:
        return self.sub_group_to_group_id[group_index]

    def group_params(self, group_index: int) -> list[torch.nn.Parameter]:
        return self.fp16_groups[group_index]

    def master_partition(self, group_index: int) -> torch.Tensor:
        return self.fp32_partitioned_groups_flat[group_index]

    def geometry(self, group_index: int) -> GroupGeometry:
        numel = sum(p.ds_numel for p in self.group_params(group_index))
        return GroupGeometry(numel=numel, dp=self.dp_size, block_size=self.zero_bnb_spec.block_size)

    def param_entries(self, group_index: int, names: dict[torch.nn.Parameter, str]) -> tuple[ParamEntry, ...]:
        entries, offset = [], 0
        for index, param in enumerate(self.group_params(group_index)):
            entries.append(ParamEntry(names.get(param, f"<unnamed {index}>"), tuple(param.ds_shape), offset))
            offset += param.ds_numel
        return tuple(entries)

    def cast_masters_into_module(self) -> None:
        """Set the module's (16-bit or fp32) partitions to the fp32 masters cast, as DeepSpeed's own load does, and
        gather the persistent parameters again. Collective (the gather): every rank must call it."""
        for index, master in enumerate(self.fp32_partitioned_groups_flat):
            flat = self.fp16_partitioned_groups_flat[index]
            if master.numel() > 0:
                flat.data.copy_(master.data)
            params = self.fp16_partitioned_groups[index]
            for param, view in zip(params, self.unflatten(flat, params)):
                param.data = view.data
        self._partition_all_parameters()
        self.checkpoint_event_epilogue()

    def _check_layout(self) -> None:
        if uses_muon(self):
            raise ZeroLayoutError("DeepSpeed's Muon optimizer is not supported by zero_bnb")
        for index in range(self.num_groups):
            params = self.group_params(index)
            geometry = self.geometry(index)
            if len(params) != 1 or params[0].partition_numel() != geometry.partition_numel \
                    or self.master_partition(index).numel() != geometry.partition_numel:
                raise ZeroLayoutError(
                    f"stage-3 sub-group {index} holds {len(params)} parameters with a partition of "
                    f"{self.master_partition(index).numel()} elements, but block-aligned partitioning expects one "
                    f"parameter of {geometry.partition_numel}; this DeepSpeed version partitions differently from the "
                    f"supported range"
                )
