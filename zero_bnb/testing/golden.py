"""Golden vectors: inputs of bitsandbytes' blockwise 8-bit update and its CUDA kernel's outputs, one file a case.

An independent reference for the fused CPU kernel (:mod:`zero_bnb.kernels.fused`) and its plain-torch
specification (:mod:`zero_bnb.kernels.reference`): ``benchmarks/gpu/golden_vectors.py`` runs
``bitsandbytes.functional.optimizer_update_8bit_blockwise`` on a GPU over the inputs :func:`golden_cases`
makes and writes each case with :func:`write_fixture`; ``tests/test_golden.py`` reads them back
(:func:`read_fixtures`) and checks both CPU implementations against them.

The fixture format: one safetensors file per case, ``<case>.safetensors``, holding the inputs under their
argument names (``p``, ``g``, ``state1``, ``absmax1``, ``qmap1`` and, for two-state families, ``state2``,
``absmax2``, ``qmap2``) and the kernel's results as ``out.<name>`` for every tensor it updates; the
safetensors metadata holds ``format`` (:data:`FORMAT`), ``hyper`` (the :class:`UpdateHyper` fields as
JSON), ``step``, ``device`` (the GPU's name), ``versions`` (JSON) and ``features`` (what the case
exercises). Every case has blocks of zeros (gradient and ``absmax`` 0), NaN and Inf gradients, values
on the quantization map's midpoints (ties) and, except AdEMAMix, a partial last block: its CUDA kernel reads
the slow moment's ``absmax`` at ``(n + i) / 256``, its own row only when ``n`` is a multiple of 256, as in
zero_bnb's block-aligned partitions.

Local: no collectives.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch

from zero_bnb.kernels.hyper import BLOCK, Family, UpdateHyper

__all__ = ["EXACT_TIES", "FORMAT", "TIES_BLOCK", "GoldenCase", "agreement", "golden_cases", "read_fixtures",
           "write_fixture"]

#: The fixture format's name and version (metadata ``format``).
FORMAT = "zero_bnb-golden-8bit-update/1"
#: Families whose first moment is exactly the gradient at step 1 with ``beta1 = 0`` (momentum without weight decay).
EXACT_TIES = ("adam", "adamw", "ademamix", "momentum")
#: The block of each case whose values sit on or next to the signed map's midpoints (see :func:`golden_cases`).
TIES_BLOCK = 4
#: Elements of each case: 12 whole blocks and a partial one of 77 (AdEMAMix: 12 whole blocks).
NUMEL = 12 * BLOCK + 77


@dataclass(frozen=True, slots=True)
class GoldenCase:
    """One update to run: its name, hyper-parameters, step and inputs (CPU tensors; the runner copies them)."""

    name: str
    hyper: UpdateHyper
    step: int
    inputs: dict[str, torch.Tensor]
    features: str


def _qmaps() -> tuple[torch.Tensor, torch.Tensor]:
    import bitsandbytes.functional as F

    return F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)


def _inputs(hyper: UpdateHyper, n: int, seed: int) -> dict[str, torch.Tensor]:
    """Random parameter, gradient and 8-bit state, with the special blocks of the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    qmap1, qmap2 = _qmaps()
    blocks, rows = -(-n // BLOCK), hyper.family.rows
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 0.01
    low = 127 if hyper.family.nonnegative else 0  # a moment that is never negative
    state1 = torch.randint(low, 256, (rows * n,), generator=gen, dtype=torch.uint8)
    absmax1 = torch.rand(rows * blocks, generator=gen) * 0.01
    state2 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    absmax2 = torch.rand(blocks, generator=gen) * 1e-4
    # Block 0: all zeros (gradient, absmax): a block whose new absmax may be 0.
    g[:BLOCK] = 0.0
    absmax1.view(rows, blocks)[:, 0] = 0.0
    absmax2[0] = 0.0
    # Block 1: one NaN gradient; block 2: one +Inf, block 3: one -Inf.
    g[BLOCK + 5], g[2 * BLOCK + 9], g[3 * BLOCK + 17] = float("nan"), float("inf"), float("-inf")
    # Block 4 (TIES_BLOCK): ties. State 1 starts at code 128 (0) with absmax 0 in every row, so with beta1 = 0 the new
    # moment is the (decayed) gradient; the gradient holds 1.0 (the block's absmax) and every midpoint of the signed map.
    start = TIES_BLOCK * BLOCK
    midpoints = (qmap1[1:] + qmap1[:-1]) / 2
    g[start:start + BLOCK] = 0.0
    g[start] = 1.0
    g[start + 1:start + 1 + min(BLOCK - 1, midpoints.numel())] = midpoints[: BLOCK - 1]
    state1.view(rows, n)[:, start:start + BLOCK] = 128
    absmax1.view(rows, blocks)[:, TIES_BLOCK] = 0.0
    inputs = {"p": p, "g": g, "state1": state1, "absmax1": absmax1, "qmap1": qmap1}
    if hyper.family.two_state:
        inputs.update(state2=state2, absmax2=absmax2, qmap2=qmap2)
    return inputs


def golden_cases() -> list[GoldenCase]:
    """The cases of every fixture: each family at a later step with its usual hyper-parameters (AdamW: Adam with
    decoupled weight decay), and each family once more with ``beta1 = 0`` at step 1, where the first moment of
    :data:`EXACT_TIES` is the gradient, so their ties block quantizes exact midpoints."""
    usual = {
        "adam": UpdateHyper(name="adam", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8),
        "adamw": UpdateHyper(name="adam", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
        "ademamix": UpdateHyper(name="ademamix", lr=1e-3, beta1=0.9, beta2=0.999, beta3=0.9999, alpha=5.0, eps=1e-8),
        "momentum": UpdateHyper(name="momentum", lr=1e-2, beta1=0.9, weight_decay=0.01),
        "lion": UpdateHyper(name="lion", lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1),
        "rmsprop": UpdateHyper(name="rmsprop", lr=1e-3, beta1=0.99, eps=1e-8),
        "adagrad": UpdateHyper(name="adagrad", lr=1e-2, eps=1e-10),
    }
    cases = []
    for index, (name, hyper) in enumerate(usual.items()):
        n = NUMEL - NUMEL % BLOCK if hyper.family is Family.ADEMAMIX else NUMEL
        features = "zero block, NaN/+Inf/-Inf gradients, ties block" + ("" if n % BLOCK == 0 else ", partial last block")
        cases.append(GoldenCase(f"{name}-step7", hyper, 7, _inputs(hyper, n, seed=100 + index), features))
        tie = dataclasses.replace(hyper, beta1=0.0, weight_decay=0.0 if name == "momentum" else hyper.weight_decay)
        cases.append(GoldenCase(f"{name}-beta1-0-step1", tie, 1, _inputs(tie, n, seed=200 + index),
                                features + "; beta1 = 0 at step 1" + (
                                    ": the first moment is the gradient, exact midpoints in the ties block"
                                    if name in EXACT_TIES else "")))
    return cases


def write_fixture(folder: str, case: GoldenCase, outputs: dict[str, torch.Tensor], device: str,
                  versions: dict[str, str]) -> str:
    """Write ``case`` and the kernel's ``outputs`` (the updated tensors by argument name) to
    ``folder/<case>.safetensors``; its path."""
    from safetensors.torch import save_file

    tensors = {name: value.detach().cpu().contiguous() for name, value in case.inputs.items()}
    tensors.update({f"out.{name}": value.detach().cpu().contiguous() for name, value in outputs.items()})
    metadata = {"format": FORMAT, "hyper": json.dumps(dataclasses.asdict(case.hyper)), "step": str(case.step),
                "device": device, "versions": json.dumps(versions, sort_keys=True), "features": case.features}
    path = os.path.join(folder, f"{case.name}.safetensors")
    save_file(tensors, path, metadata=metadata)
    return path


def read_fixtures(folder: str) -> list[tuple[GoldenCase, dict[str, torch.Tensor], dict[str, str]]]:
    """Every fixture in ``folder``: the case, the kernel's outputs (by argument name) and the metadata.

    Raises:
        ValueError: a file in the folder is not a fixture of :data:`FORMAT` (named, with what it holds).
    """
    from safetensors import safe_open

    found = []
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not entry.endswith(".safetensors"):
            continue
        path = os.path.join(folder, entry)
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ValueError(f"{path} is not a golden-vector fixture: its metadata format is "
                                 f"{metadata.get('format')!r}, expected {FORMAT!r}")
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        try:
            hyper = UpdateHyper(**json.loads(metadata["hyper"]))
            step = int(metadata["step"])
        except (KeyError, TypeError, ValueError) as error:  # a stranger's file: named, not a traceback
            raise ValueError(f"{path} is a golden-vector fixture with unreadable metadata ({type(error).__name__}: "
                             f"{error}); write it again with benchmarks/gpu/golden_vectors.py") from error
        inputs = {k: v for k, v in tensors.items() if not k.startswith("out.")}
        outputs = {k[len("out."):]: v for k, v in tensors.items() if k.startswith("out.")}
        found.append((GoldenCase(entry[: -len(".safetensors")], hyper, step, inputs,
                                 metadata.get("features", "")), outputs, metadata))
    return found


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in float32 units in the last place between finite values (0 where both are NaN, or equal)."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    both_nan = torch.isnan(got) & torch.isnan(want)
    distance = (ordered(got) - ordered(want)).abs()
    return torch.where(both_nan, torch.zeros_like(distance), distance)


def agreement(case: GoldenCase, outputs: dict[str, torch.Tensor], update) -> dict[str, float]:
    """Run ``update`` (:func:`~zero_bnb.kernels.fused.fused_update` or the reference) on a copy of ``case``'s
    inputs and measure how it differs from the GPU's ``outputs``.

    Returns:
        ``codes``: codes that differ (of ``codes_compared``), ``codes_outside_ties``: those outside the ties block
        (:data:`TIES_BLOCK`, whose near-midpoint values are where CUDA's ``__fdividef`` may round to the other
        code), ``code_distance``: the largest difference of two codes, ``absmax_ulps``: the largest ulp distance
        of an absmax, ``p_ulps``: the largest parameter difference in ulps of the larger of the parameter before
        and after the step (a step far below one ulp of the parameter rounds to either neighbour), and
        ``nan_mismatches``: elements NaN on one side only.
    """
    from zero_bnb.kernels.hyper import step_scalars

    tensors = {name: value.clone() for name, value in case.inputs.items()}
    update(case.hyper, step_scalars(case.hyper, case.step), **tensors)
    n = case.inputs["p"].numel()
    report = {"codes": 0, "codes_outside_ties": 0, "codes_compared": 0, "code_distance": 0, "absmax_ulps": 0,
              "p_ulps": 0.0, "nan_mismatches": 0}
    for name, want in outputs.items():
        got = tensors[name]
        if want.dtype == torch.uint8:
            distance = (got.to(torch.int16) - want.to(torch.int16)).abs()
            differ = (distance != 0).nonzero().flatten() % n // BLOCK
            report["codes"] += differ.numel()
            report["codes_outside_ties"] += int((differ != TIES_BLOCK).sum())
            report["codes_compared"] += want.numel()
            report["code_distance"] = max(report["code_distance"], int(distance.max()))
            continue
        report["nan_mismatches"] += int((torch.isnan(got) != torch.isnan(want)).sum())
        if name != "p":
            report["absmax_ulps"] = max(report["absmax_ulps"], int(_ulps(got, want).max()))
            continue
        start = case.inputs["p"]
        finite = torch.isfinite(got) & torch.isfinite(want) & torch.isfinite(start)
        magnitude = torch.maximum(start.abs(), want.abs())
        ulp = torch.nextafter(magnitude, torch.tensor(float("inf"))) - magnitude
        report["p_ulps"] = max(report["p_ulps"],
                               float(torch.where(finite, (got - want).abs() / ulp, torch.zeros_like(ulp)).max()))
    return report
