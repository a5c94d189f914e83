"""The oracle for requantized 8-bit moments: bitsandbytes' own blockwise quantizer, compared exactly.

zero_bnb quantizes 8-bit optimizer state again where it cannot copy its codes: a partition crossing bitsandbytes'
``min_8bit_size`` (fp32 state becoming 8-bit), a stage switch or a regrouping by parameter name, a stock DeepSpeed
checkpoint whose partitions are off the block grid, a universal checkpoint converted back. Each time the saved values
(8-bit codes dequantized with their own ``absmax`` and map, or fp32 state as it is) are quantized once on the new
256-element grid. That is deterministic, so the tests compare it bit for bit: the expected codes and ``absmax`` come
from ``bitsandbytes.functional.quantize_blockwise`` here (never from ``zero_bnb.core.quant``) and ``torch.equal``
decides. No near-midpoint ties arise: zero_bnb requantizes with that same bitsandbytes function (the ties of
``tests/test_golden.py`` are the fused update kernel's against bitsandbytes' CUDA kernel, another path).

The new grid: zero_bnb's partitions hold whole blocks (``zero_bnb/core/layout.py``, ``tests/test_layout.py``), so
every partition's blocks are those of its group (at ZeRO stage 3, of its parameter) counted from the first element, and
one call over the whole group gives every partition's codes. The relative RMS error of the requantization is a
figure, reported (:func:`report`), not a bound.

The states read here are ``zero_bnb.testing.consolidate.consolidated_state`` results: its ``"raw"`` holds each flat
group's codes, ``absmax`` and map as the partitions hold them (concatenated in rank order, padding removed), and its
``"params"`` lists the parameters group by group in flat order (:func:`group_names`).
"""

from __future__ import annotations

import os
import re

import bitsandbytes.functional as F
import torch

BLOCK = 256
#: codes key -> (absmax key, map key) of bitsandbytes' 8-bit optimizers
TRIPLES = {"state1": ("absmax1", "qmap1"), "state2": ("absmax2", "qmap2")}
#: the maps bitsandbytes' Adam family creates (``Optimizer2State``: "dynamic" for the first moment, "udynamic" for
#: the second)
ADAM_MAPS = {"state1": F.create_dynamic_map(signed=True), "state2": F.create_dynamic_map(signed=False)}


def dequantized(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' dequantization of 8-bit ``codes`` (blocks of 256 from the first element)."""
    return F.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=BLOCK)


def quantized(values: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' codes and per-block ``absmax`` of fp32 ``values`` (blocks of 256 from the first element)."""
    codes, state = F.quantize_blockwise(values.to(torch.float32).contiguous(), code=qmap, blocksize=BLOCK)
    return codes, state.absmax


def quantized_values(source: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """What ``source`` becomes once quantized by bitsandbytes on its 256-element grid and dequantized again."""
    return dequantized(*quantized(source, qmap), qmap)


def raw_values(raw: dict, key: str) -> torch.Tensor:
    """The fp32 values of state ``key`` of one consolidated group: 8-bit codes dequantized by bitsandbytes with the
    group's own ``absmax`` and map, fp32 state as it is."""
    tensor = raw[key]
    if tensor.dtype != torch.uint8:
        return tensor.to(torch.float32)
    absmax, qmap = TRIPLES[key]
    return dequantized(tensor, raw[absmax], raw[qmap])


def group_names(state: dict) -> list[list[str]]:
    """Each group's parameter names, in flat order, of a consolidated state."""
    names, groups = iter(state["params"]), []
    for raw in state["raw"]:
        left, members = raw["state1"].shape[-1], []
        while left > 0:
            members.append(next(names))
            left -= state["params"][members[-1]]["fp32"].numel()
        assert left == 0, (members, raw["state1"].shape)
        groups.append(members)
    assert next(names, None) is None
    return groups


def param_values(state: dict, key: str) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 values of ``key`` (flat), cut from its group's values (:func:`raw_values`)."""
    out = {}
    for raw, names in zip(state["raw"], group_names(state), strict=True):
        flat, offset = raw_values(raw, key), 0
        for name in names:
            numel = state["params"][name]["fp32"].numel()
            out[name] = flat[offset : offset + numel]
            offset += numel
    return out


def _assert_codes(label: str, raw: dict, key: str, codes: torch.Tensor, absmax: torch.Tensor,
                  qmap: torch.Tensor) -> None:
    got = raw[key]
    absmax_key, qmap_key = TRIPLES[key]
    assert torch.equal(raw[qmap_key], qmap), f"{label}: {qmap_key} is not the map quantized with"
    if not torch.equal(got, codes):
        assert got.shape == codes.shape, (label, key, got.shape, codes.shape)
        distance = (got.long() - codes.long()).abs()
        first = int(distance.nonzero()[0, 0])
        raise AssertionError(
            f"{label}: {int(distance.count_nonzero())} of {codes.numel()} codes of {key} differ from bitsandbytes' "
            f"quantize_blockwise on the 256-element grid (first at element {first}: {int(got[first])}, expected "
            f"{int(codes[first])}; largest distance {int(distance.max())})")
    assert torch.equal(raw[absmax_key], absmax), (
        f"{label}: {absmax_key} differs from bitsandbytes' (worst {(raw[absmax_key] - absmax).abs().max().item():.3g})"
        if raw[absmax_key].shape == absmax.shape else
        f"{label}: {absmax_key} has shape {tuple(raw[absmax_key].shape)}, bitsandbytes' {tuple(absmax.shape)}")


def assert_quantized_once(label: str, raw: dict, key: str, source: torch.Tensor, qmap: torch.Tensor) -> float:
    """The checkpoint holds ``source`` quantized once by bitsandbytes (map ``qmap``) on this group's grid, and the
    load took it as it is: 8-bit state holds exactly those codes and ``absmax``, fp32 state (a group below
    ``min_8bit_size`` at this DP size) exactly their dequantization. Returns the relative RMS error against
    ``source``."""
    codes, absmax = quantized(source, qmap)
    restored = dequantized(codes, absmax, qmap)
    if raw[key].dtype == torch.uint8:
        _assert_codes(label, raw, key, codes, absmax, qmap)
    else:
        assert torch.equal(raw[key], restored), f"{label}: fp32 {key} is not the dequantized requantization"
    return relative_rms(restored, source)


def assert_requantized_on_load(label: str, raw: dict, key: str, source: torch.Tensor, qmap: torch.Tensor) -> float:
    """The load quantized the saved values ``source`` once more (regrouped by name, or fp32 state becoming 8-bit):
    8-bit state holds exactly bitsandbytes' codes and ``absmax`` of ``source`` on this group's grid (map ``qmap``),
    fp32 state exactly ``source``. Returns the relative RMS error against ``source`` (0 for fp32 state)."""
    if raw[key].dtype != torch.uint8:
        assert torch.equal(raw[key], source), f"{label}: fp32 {key} is not the saved values"
        return 0.0
    return assert_quantized_once(label, raw, key, source, qmap)


def relative_rms(restored: torch.Tensor, original: torch.Tensor) -> float:
    norm = float(original.norm())
    return float((restored - original).norm()) / norm if norm > 0 else 0.0


def report(label: str, measured: float) -> None:
    """Print a figure that is reported, not bounded (with ``ZERO_BNB_BOUNDS_LOG=path`` also appended to ``path``,
    beside the bounded ones of ``scenarios.within``)."""
    line = f"[figure] {label}: measured {measured:.3g} (reported, not bounded)"
    print(line)
    if os.environ.get("ZERO_BNB_BOUNDS_LOG"):
        with open(os.environ["ZERO_BNB_BOUNDS_LOG"], "a") as log:
            log.write(line + "\n")


def stock_flat_values(tag_folder, key: str) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """A stock DeepSpeed ZeRO-1/2 checkpoint's state ``key`` of each flat group, read without zero_bnb: every rank's
    partition dequantized by bitsandbytes with that rank's own ``absmax`` and map (8-bit) or as it is (fp32),
    concatenated in rank order and cut to the group's elements. Returns the values and each group's map (``None``:
    the group's state is fp32)."""
    folder = str(tag_folder)
    files = sorted((name for name in os.listdir(folder) if name.endswith("_mp_rank_00_optim_states.pt")),
                   key=lambda name: int(re.search(r"zero_pp_rank_(\d+)_", name).group(1)))  # DP-rank order
    shapes = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), weights_only=False)["param_shapes"]
    ranks = []
    for name in files:
        rank_file = torch.load(os.path.join(folder, name), weights_only=False)
        base = rank_file["optimizer_state_dict"]["base_optimizer_state"]
        if isinstance(base, dict):  # the base optimizer's own state_dict: one index per flat group, in order
            states = [base["state"].get(i, {}) for group in base["param_groups"] for i in group["params"]]
        else:  # elastic layout: one dict per group
            states = list(base)
        ranks.append([{**s, **s.get("__bnb_optimizer_quant_state__", {})} for s in states])
    flats, maps = [], []
    for g, group_shapes in enumerate(shapes):
        numel = sum(shape.numel() for shape in group_shapes.values())
        flats.append(torch.cat([raw_values(states[g], key) for states in ranks])[:numel])
        eight_bit = ranks[0][g][key].dtype == torch.uint8
        maps.append(ranks[0][g][TRIPLES[key][1]] if eight_bit else None)
    return flats, maps
