"""``zero_bnb.initialize``: ``deepspeed.initialize`` with elastic 8-bit optimizer checkpoints."""

from __future__ import annotations

import copy
import functools
import logging
import sys
from typing import Any

import deepspeed
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

from zero_bnb.bnb.overrides import attach_overrides, isolate_overridden_parameters
from zero_bnb.core.config import (
    ZeroBnbConfigError,
    load_ds_config,
    prepare_offload,
    refuse_optimizer_section,
    split_config,
)
from zero_bnb.core.state_spec import family_of
from zero_bnb.ds.engine import ZeroBnbEngine
from zero_bnb.ds.patching import swapped_attribute
from zero_bnb.ds.precision_plan import announce_precision
from zero_bnb.ds.describe import announce_update_kernels
from zero_bnb.ds.stage3 import refuse_stage3_settings
from zero_bnb.ds.dispatch import calling_deepspeed, underlying_initialize
from zero_bnb.versions import check_supported

__all__ = ["initialize"]

logger = logging.getLogger(__name__)


def _resolve_config(args: Any, config: Any, config_params: Any) -> tuple[Any, Any]:
    """The raw config from whichever place ``deepspeed.initialize`` would take it, and ``args`` without it."""
    if config is None:
        config = config_params
    path = getattr(args, "deepspeed_config", None) if args is not None else None
    if path is not None:
        if config is not None:
            raise ZeroBnbConfigError(
                "a DeepSpeed config was given both as args.deepspeed_config and as config=; pass only one"
            )
        config = path
        args = copy.copy(args)
        args.deepspeed_config = None
    if config is None:
        raise ZeroBnbConfigError("zero_bnb.initialize needs a DeepSpeed config: pass config= (a dict or JSON path)")
    return config, args


def _refuse_unsupported(ds_config: dict, mpu: Any) -> None:
    """Refuse settings under which zero_bnb's checkpoints would be wrong, before DeepSpeed starts."""
    if mpu is not None:
        raise ZeroBnbConfigError(
            f"zero_bnb supports data parallelism only, but an mpu ({type(mpu).__name__}) was passed: with tensor or "
            f"pipeline parallelism, ranks of different model-parallel groups would write the same shard files. "
            f"Remove mpu= (or use stock DeepSpeed for model-parallel runs)"
        )
    autotp = (ds_config.get("tensor_parallel") or {}).get("autotp_size", 1)
    if isinstance(autotp, int) and autotp > 1:
        raise ZeroBnbConfigError(
            f"zero_bnb supports data parallelism only, but the config sets tensor_parallel.autotp_size={autotp}; "
            f"remove the tensor_parallel section"
        )
    if (ds_config.get("checkpoint") or {}).get("use_node_local_storage"):
        raise ZeroBnbConfigError(
            "zero_bnb commits a checkpoint by renaming one folder that every rank wrote into, which needs storage "
            "shared by all nodes, but the config sets checkpoint.use_node_local_storage=true; remove it and save "
            "to a shared file system"
        )


def _build(ds_initialize, engine_factory, **kwargs):
    with swapped_attribute(deepspeed, "DeepSpeedEngine", engine_factory), calling_deepspeed():
        return ds_initialize(**kwargs)


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """Initialize a DeepSpeed engine (ZeRO stage 1, 2 or 3) whose checkpoints resume at any DP size.

    Same arguments and same 4-tuple ``(engine, optimizer, training_dataloader, lr_scheduler)``
    as ``deepspeed.initialize``. The engine is a :class:`~zero_bnb.ds.engine.ZeroBnbEngine`, a real
    ``DeepSpeedEngine``. zero_bnb reads ``zero_unsharded_state_keys`` and
    ``zero_unsharded_state_max_numel`` from the top level of the config or from
    ``zero_optimization``, and sets ``zero_allow_untested_optimizer`` for client optimizers
    (bitsandbytes' are not on DeepSpeed's list), as transformers and accelerate do. With
    ``zero_optimization.offload_optimizer: {"device": "cpu"}`` the fp32 partitions and the
    optimizer state live in CPU memory and the client optimizer steps there
    (``zero_force_ds_cpu_optimizer`` is set to false for it; see
    :func:`zero_bnb.core.config.prepare_offload` for what is refused).

    At ZeRO stage 3 every parameter is partitioned into slices of whole quantization blocks
    (:mod:`zero_bnb.ds.stage3`); settings it does not support are refused by name. Through every front door
    (Trainer, Accelerate, Lightning) alike; bitsandbytes per-parameter overrides (Trainer's 32-bit embeddings)
    are kept at every stage.

    Collective: call it on every rank, as ``deepspeed.initialize``.

    Raises:
        zero_bnb.versions.UnsupportedVersionError: torch, DeepSpeed or bitsandbytes (or transformers,
            Accelerate or Lightning, when imported) is a release known not to work; untested releases
            warn once (:func:`zero_bnb.versions.check_supported`).
    """
    check_supported(optional=tuple(name for name in ("transformers", "accelerate", "lightning") if name in sys.modules))
    raw_config, args = _resolve_config(args, config, config_params)
    zero_bnb_config, ds_config = split_config(load_ds_config(raw_config))
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (1, 2, 3):
        raise ZeroBnbConfigError(
            f"zero_bnb wraps ZeRO stages 1, 2 and 3, but the config has zero_optimization.stage={stage}; "
            f"set \"zero_optimization\": {{\"stage\": 1}} (or 2, or 3)"
        )
    if stage == 3:
        refuse_stage3_settings(ds_config)
    _refuse_unsupported(ds_config, mpu)
    refuse_optimizer_section(ds_config, optimizer)
    prepare_offload(ds_config, optimizer)
    if optimizer is not None and "zero_allow_untested_optimizer" not in ds_config:
        ds_config["zero_allow_untested_optimizer"] = True
    isolation = None
    if optimizer is not None and model is not None:
        family = family_of(optimizer)
        isolation = isolate_overridden_parameters(optimizer, {id(p): name for name, p in model.named_parameters()},
                                                  bitsandbytes=family is not None and family.bitsandbytes)
    overridden = isolation.groups if isolation is not None else {}

    engine_factory = functools.partial(ZeroBnbEngine, zero_bnb_config=zero_bnb_config)
    ds_initialize = underlying_initialize()  # never zero_bnb's own dispatcher (zero_bnb.enable)
    try:
        result = _build(ds_initialize, engine_factory, args=args,
                        model=model, optimizer=optimizer, model_parameters=model_parameters,
                        training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                        mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                        mesh_param=mesh_param)
    except BaseException:
        if isolation is not None:
            isolation.undo()  # a failed initialize leaves the user's optimizer and bitsandbytes' manager as they were
        raise
    if overridden:
        zero_optimizer = result[0].optimizer
        # An isolated param group is one flat group at stages 1/2 (the same index) and one parameter's sub-group at 3.
        flat_index = {}
        for index in range(zero_optimizer.num_groups):
            flat_index.setdefault(zero_optimizer.base_group_index(index), index)
        overridden = {flat_index[group]: config for group, config in overridden.items()}
        flat = [zero_optimizer.master_partition(index) for index in range(zero_optimizer.num_groups)]
        attach_overrides(zero_optimizer.optimizer, flat, overridden)
        result[0].zero_bnb_isolated = [p.name for g in overridden for p in zero_optimizer.param_entries(g, result[0].param_names)]
    if not isinstance(result[0], ZeroBnbEngine):
        raise ZeroBnbConfigError(
            f"DeepSpeed built a {type(result[0]).__name__} (pipeline or hybrid engine), which zero_bnb does not "
            f"support; pass a plain torch.nn.Module and no hybrid_engine section"
        )
    if result[0].global_rank == 0:  # once bitsandbytes' per-parameter overrides are attached (optim_bits=32)
        announce_precision(result[0].optimizer)
        announce_update_kernels(result[0])
    return result
