"""What a zero_bnb engine holds, as plain data: so a user can assert in their own script that their optimizer state is
8-bit after a resume at another DP size, without digging into DeepSpeed's and bitsandbytes' objects.

Local: no collectives; describes this rank's partitions.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from zero_bnb.core.state_spec import classify_state
from zero_bnb.ds.precision_plan import below_min_8bit_size
from zero_bnb.kernels.update import update_kernel

__all__ = ["announce_update_kernels", "describe", "update_kernels_line"]

logger = logging.getLogger("zero_bnb.ds.engine")  # the engine's messages, as zero_bnb.ds.load_log's


def describe(engine: Any) -> dict[str, Any]:
    """This rank's view of a zero_bnb engine.

    Returns:
        ``{"optimizer": class, "zero_stage": int, "dp_size": int, "dp_rank": int, "groups": [{"numel",
        "partition_numel", "state": {key: {"kind", "dtype", "shape", "bytes"}}} per flat group], "masters_bytes",
        "state_bytes", "state_bytes_per_param", "eight_bit_groups": indexes of the groups whose moments are 8-bit,
        "below_min_8bit_size": the groups an 8-bit optimizer keeps in fp32 because they are below bitsandbytes'
        ``min_8bit_size`` (:func:`~zero_bnb.ds.precision_plan.below_min_8bit_size`), "update_kernels": {kernel: group
        indexes} (which kernel steps each group: :data:`zero_bnb.kernels.update.KERNELS`, chosen by
        ``zero_cpu_update``/``zero_gpu_update`` and the partition's device)}``; each group also has its
        ``"update_kernel"``. Naming the fused CPU kernel needs it built: the first call on a machine may compile
        it (about 3 s, cached; the first CPU step would otherwise), or warn once that it cannot.
        Bytes per parameter are this rank's state bytes over its partition's elements.

    Raises:
        TypeError: ``engine`` was not built by zero_bnb (its optimizer is not block-aligned).
    """
    optimizer = getattr(engine, "optimizer", None)
    if not hasattr(optimizer, "zero_bnb_spec"):
        raise TypeError(f"describe() takes an engine built by zero_bnb.initialize (or under zero_bnb.enable()); "
                        f"this one's optimizer is {type(optimizer).__name__}")
    base = optimizer.optimizer
    spec = optimizer.zero_bnb_spec
    groups, masters_bytes, state_bytes, partition_numel, eight_bit, kernels = [], 0, 0, 0, [], {}
    for index in range(optimizer.num_groups):
        master = optimizer.master_partition(index)
        geometry = optimizer.geometry(index)
        state = {}
        for key, value in base.state.get(master, {}).items():
            # The kind a save gives it (zero_unsharded_state_keys and the size threshold included).
            kind = classify_state(key, value, spec=spec, rule=optimizer.zero_bnb_rule,
                                  partition_numel=geometry.partition_numel).kind.value
            if isinstance(value, torch.Tensor):
                state[key] = {"kind": kind, "dtype": str(value.dtype).removeprefix("torch."),
                              "shape": tuple(value.shape), "bytes": value.numel() * value.element_size()}
                state_bytes += state[key]["bytes"]
            else:
                state[key] = {"kind": kind, "value": value}
        if any(entry.get("dtype") == "uint8" for entry in state.values()):
            eight_bit.append(index)
        masters_bytes += master.numel() * master.element_size()
        partition_numel += master.numel()
        plan = optimizer.state_precision(index)  # before the first step: what bitsandbytes will allocate
        kernel = update_kernel(base, master, plan["eight_bit"] if plan else None)
        kernels.setdefault(kernel, []).append(index)
        groups.append({"numel": geometry.numel, "partition_numel": master.numel(), "state": state,
                       "update_kernel": kernel})
    return {"optimizer": f"{type(base).__module__}.{type(base).__qualname__}",
            "zero_stage": int(engine.zero_optimization_stage()), "dp_size": optimizer.dp_size,
            "dp_rank": optimizer.dp_rank, "groups": groups, "masters_bytes": masters_bytes, "state_bytes": state_bytes,
            "state_bytes_per_param": state_bytes / partition_numel if partition_numel else 0.0,
            "eight_bit_groups": eight_bit, "below_min_8bit_size": below_min_8bit_size(optimizer),
            "update_kernels": kernels}


def update_kernels_line(engine: Any, described: dict[str, Any] | None = None) -> str:
    """Which kernel steps which groups, with the settings that chose them: one line for the initialize and load
    logs. Local."""
    described = described or describe(engine)
    config = engine.zero_bnb_config
    chosen = "; ".join(f"{kernel} for group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))}"
                       for kernel, groups in described["update_kernels"].items())
    return f"optimizer steps by {chosen} (zero_cpu_update={config.cpu_update}, zero_gpu_update={config.gpu_update})"


def announce_update_kernels(engine: Any) -> None:
    """Log at INFO which kernel steps each group (:func:`update_kernels_line`). Call on the rank that logs; local."""
    logger.info("zero_bnb: %s", update_kernels_line(engine))
