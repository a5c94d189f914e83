"""Which flat groups an 8-bit bitsandbytes optimizer keeps in fp32, and saying so once at ``initialize``.

bitsandbytes keeps 8-bit state only for tensors of at least ``min_8bit_size`` elements (4096 by default). Under ZeRO
stages 1 and 2 the tensor it sees is a rank's *partition* of a flat group, so a small model or a LoRA adapter spread
over a few ranks gets fp32 state from an "8-bit" optimizer: 4 bytes per moment instead of 1. At stage 3 the decision is
made on the whole parameter, as bitsandbytes makes it without ZeRO.

Local: no collectives; reads this rank's optimizer.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["announce_precision", "below_min_8bit_size"]

logger = logging.getLogger(__name__)
#: At most this many groups are named in the warning (the rest are counted).
_NAMED_GROUPS = 8


def below_min_8bit_size(optimizer: Any, plans: list[dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
    """The groups whose state is fp32 only because they are below ``min_8bit_size``.

    Args:
        optimizer: a zero_bnb ZeRO wrapper (``num_groups``, ``state_precision``).
        plans: ``optimizer.state_precision(index)`` of every group, when the caller already has them.

    Returns:
        One record per such group: ``group``, ``numel`` (the whole flat group), ``partition_numel`` (this rank's),
        ``min_8bit_size``, ``eight_bit_up_to_dp`` (the largest DP size that keeps it 8-bit; ``None`` where no DP size
        does, or where the decision is made on the whole parameter) and ``decided_on`` (``"partition"`` or
        ``"whole parameter"``). Groups of optimizers that are not 8-bit bitsandbytes ones are never listed.
    """
    if plans is None:
        plans = [optimizer.state_precision(index) for index in range(optimizer.num_groups)]
    found = []
    for index, plan in enumerate(plans):
        if plan is None or plan["optim_bits"] != 8 or plan["eight_bit"]:
            continue
        found.append({"group": index, "numel": optimizer.geometry(index).numel,
                      "partition_numel": plan["partition_numel"], "min_8bit_size": plan["min_8bit_size"],
                      "eight_bit_up_to_dp": plan.get("eight_bit_up_to_dp"),
                      "decided_on": plan.get("decided_on", "partition")})
    return found


def announce_precision(optimizer: Any) -> None:
    """Log each group's 8-bit/fp32 plan (INFO) and, once, a WARNING naming the groups an 8-bit optimizer keeps in
    fp32 because they are below ``min_8bit_size``, when that is a surprise: a group that fewer ranks would keep 8-bit
    (ZeRO split it below the threshold), or fp32 state for most of the optimizer's elements (a small model, a LoRA
    adapter). The biases of a large model, fp32 under bitsandbytes' own per-tensor rule too, stay at INFO.
    Call on the rank that logs (rank 0); local."""
    plans = [optimizer.state_precision(index) for index in range(optimizer.num_groups)]
    for index, plan in enumerate(plans):
        if plan is None:
            continue
        limit = plan["eight_bit_up_to_dp"]
        logger.info(
            "zero_bnb: group %d: partition of %d elements at DP=%d -> %s state (optim_bits=%d, "
            "min_8bit_size=%d is decided per partition; %s)",
            index, plan["partition_numel"], optimizer.dp_size,
            "8-bit" if plan["eight_bit"] else "fp32", plan["optim_bits"], plan["min_8bit_size"],
            f"8-bit while DP <= {limit}" if limit is not None else
            "decided on the whole parameter: the same at every DP size" if plan.get("decided_on")
            else "fp32 at every DP size",
        )
    small = below_min_8bit_size(optimizer, plans)
    eight_bit_numel = sum(optimizer.geometry(index).numel for index, plan in enumerate(plans)
                          if plan is not None and plan["optim_bits"] == 8)
    fp32_numel = sum(record["numel"] for record in small)
    split_by_zero = any(record["eight_bit_up_to_dp"] for record in small)
    if split_by_zero or 2 * fp32_numel > eight_bit_numel:
        logger.warning("zero_bnb: %s", _describe(small, optimizer.dp_size, fp32_numel, eight_bit_numel))


def _describe(small: list[dict[str, Any]], dp_size: int, fp32_numel: int, eight_bit_numel: int) -> str:
    whole = small[0]["decided_on"] == "whole parameter"
    size = "numel" if whole else "partition_numel"  # what bitsandbytes compares with min_8bit_size
    unit = "parameter" if whole else f"partition at DP={dp_size}"
    named = ", ".join(f"group {record['group']} ({record[size]} elements a {unit}"
                      + (f"; 8-bit while DP <= {record['eight_bit_up_to_dp']}" if record["eight_bit_up_to_dp"] else "")
                      + ")" for record in small[:_NAMED_GROUPS])
    more = f" and {len(small) - _NAMED_GROUPS} more" if len(small) > _NAMED_GROUPS else ""
    threshold = small[0]["min_8bit_size"]
    smallest = max(1, min(record[size] for record in small))
    where = ("bitsandbytes decides per tensor, and here the tensors are small" if whole else
             "under ZeRO stages 1 and 2 the tensor bitsandbytes sees is each rank's partition of a flat group")
    fewer = [record["eight_bit_up_to_dp"] for record in small if record["eight_bit_up_to_dp"]]
    return (f"the 8-bit optimizer keeps fp32 state (4 bytes per moment, not 1) for {fp32_numel} of its "
            f"{eight_bit_numel} elements: {named}{more} {'are' if len(small) > 1 else 'is'} below bitsandbytes' "
            f"min_8bit_size={threshold} ({where}). To keep them 8-bit pass a smaller min_8bit_size to the optimizer, "
            f"e.g. bnb.optim.AdamW8bit(params, lr=..., min_8bit_size={smallest})"
            + ("" if whole else " (partitions shrink as DP grows: it holds at this DP size or fewer)")
            + (f", or train at DP <= {max(fewer)}" if fewer and not whole else "")
            + "; zero_bnb.describe(engine)['below_min_8bit_size'] lists them")
