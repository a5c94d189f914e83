"""Gather a zero_bnb engine's partitioned optimizer state (ZeRO-1/2, BF16_Optimizer) into whole, per-parameter tensors.

For inspection and verification (the demo and the tests compare a resumed engine against
the one that saved). It reads the live partitions only, not checkpoint files, and uses zero_bnb's own
geometry, state classification and dequantization: the tests also compare through an independent path,
bitsandbytes' ``dequantize_blockwise`` of each rank's partition (``tests/optimizer_scenarios.py``). It gathers
everything on one rank, so it is meant for models that fit in that rank's memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero_bnb.core import quant
from zero_bnb.core.state_spec import StateKind, classify_state
from zero_bnb.ds.aligned import BlockAligned

__all__ = ["consolidated_state", "state_differences"]


def consolidated_state(engine, dst: int = 0) -> dict[str, Any] | None:
    """Whole optimizer state of ``engine`` on rank ``dst`` (``None`` on the other ranks).

    Collective: all ranks of the data-parallel group must call it.

    Returns:
        ``{"params": {name: {"fp32": master weights, "<state key>": values}}, "counters":
        [{key: value} per group], "raw": [{key: tensor} per group]}``. Element-wise 8-bit
        codes appear in ``"params"`` dequantized (as the optimizer sees them) and, with their
        ``absmax``, unchanged in ``"raw"`` (real elements and blocks only, padding removed).
    """
    optimizer: BlockAligned = engine.optimizer
    spec = optimizer.zero_bnb_spec
    local = []
    for index in range(optimizer.num_groups):
        state = optimizer.optimizer.state.get(optimizer.master_partition(index), {})
        local.append({
            "master": optimizer.master_partition(index).detach().cpu().clone(),
            "state": {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()},
        })
    gathered: list[Any] = [None] * optimizer.dp_size if optimizer.dp_rank == dst else None
    dist.gather_object(local, gathered, dst=dst, group=optimizer.dp_process_group)
    if optimizer.dp_rank != dst:
        return None

    result: dict[str, Any] = {"params": {}, "counters": [], "raw": []}
    for index in range(optimizer.num_groups):
        geometry = optimizer.geometry(index)
        parts = [ranks[index] for ranks in gathered]
        master = torch.cat([p["master"] for p in parts])[: geometry.numel]
        state0 = parts[0]["state"]
        counters, raw = {}, {}
        for key, value in state0.items():
            kind = classify_state(
                key, value, spec=spec, rule=optimizer.zero_bnb_rule, partition_numel=geometry.partition_numel
            ).kind
            if kind is StateKind.ELEMENTWISE:
                raw[key] = torch.cat([p["state"][key] for p in parts], dim=-1)[..., : geometry.numel]
            elif kind is StateKind.BLOCKWISE:
                raw[key] = torch.cat([p["state"][key] for p in parts], dim=-1)[..., : geometry.num_blocks]
            elif kind is StateKind.REPLICATED:
                raw[key] = value
            else:
                counters[key] = _agreed([p["state"].get(key) for p in parts], f"group {index}'s {key!r}")
        values = {}
        for key, tensor in raw.items():
            triple = spec.triple_for(key)
            if triple is not None and key == triple.codes and tensor.dtype == torch.uint8:
                values[key] = quant.state_values(raw, key, triple, geometry.block_size)
            elif triple is None and tensor.shape[-1:] == (geometry.numel,) or triple is not None and key == triple.codes:
                values[key] = tensor
        for entry in optimizer.param_entries(index, engine.param_names):
            window = slice(entry.offset, entry.offset + entry.numel)
            result["params"][entry.name] = {
                "fp32": master[window].view(entry.shape),
                **{key: v[..., window].reshape(*v.shape[:-1], *entry.shape) for key, v in values.items()},
            }
        result["counters"].append(counters)
        result["raw"].append(raw)
    return result


def _agreed(values: list[Any], what: str) -> Any:
    """The value every rank holds (a step counter, a scalar hyper-parameter); a rank that differs is an error. A rank
    without the key (``None``: its partition of the group is empty, so the optimizer never made its state) is
    skipped."""
    values = [value for value in values if value is not None]
    first = values[0]

    def same(value: Any) -> bool:
        if torch.is_tensor(value) or torch.is_tensor(first):
            return torch.is_tensor(value) and torch.is_tensor(first) and torch.equal(value, first)
        return value == first

    if not all(map(same, values)):
        raise ValueError(f"{what} differs between the data-parallel ranks: {values}")
    return first


def state_differences(saved: dict[str, Any], loaded: dict[str, Any]) -> tuple[int, list[str]]:
    """Compare two :func:`consolidated_state` results bit for bit.

    Returns:
        How many per-parameter tensors were compared, and a description of each difference
        (a tensor that differs or is missing, or differing counters); empty when identical.
    """
    checked, different = 0, []
    for name, tensors in saved["params"].items():
        other = loaded["params"].get(name, {})
        if other.keys() != tensors.keys():
            different.append(f"{name}: keys {sorted(tensors)} != {sorted(other)}")
        for key, value in tensors.items():
            checked += 1
            if key in other and not torch.equal(value, other[key]):
                different.append(f"{name}.{key}")
    if saved["params"].keys() != loaded["params"].keys():
        different.append(f"parameters {sorted(saved['params'])} != {sorted(loaded['params'])}")
    if saved["counters"] != loaded["counters"]:
        different.append(f"counters {saved['counters']} != {loaded['counters']}")
    return checked, different
