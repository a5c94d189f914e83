"""The fused CPU 8-bit update against its plain-torch specification (bitsandbytes' CUDA kernel).

Property tests: for every family, sizes that are not multiples of 256, zero blocks, magnitudes from 1e-30
to 1e30, NaN/Inf gradients and every hyper-parameter, at step 1 and later, the kernel gives the
reference's parameters, codes and absmax bit for bit; it does not depend on the thread count; and it
is block-local (a partition split at any block boundary and updated in pieces gives the same bits, so
an elastic resume stays bit-identical). The quantizer alone is checked at every map midpoint, its float
neighbours and every bucket edge of the kernel's table. The kernel built for each x86-64 level (v2: plain loops,
v3: AVX2, v4: AVX-512 without VBMI) and natively passes the update and quantizer checks too (aarch64 builds:
tests/test_kernels_cross.py, under qemu-aarch64). The build and its cache (with a fake compiler that
copies this machine's build): a failing build is tried once per process, an unusable cache folder or a
cached library another user could have written is a KernelBuildError naming the fix, a damaged cached
library is rebuilt, and concurrent builders of one key compile once. The attacks on a shared cache folder: a
symbolic link, a hard link or a FIFO at the kernel's name is refused (never followed, never waited on), the
library loaded is the file that was checked even if the name is swapped before the loader opens it, a build lock
held by another process (or a stopped builder) makes a bounded wait that falls back or fails naming the lock
file, and a library at the kernel's name without the kernel's functions is rebuilt (or refused, when another
user owns it), never a traceback.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import fcntl
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import threading
import time

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_bnb import cli
from zero_bnb.kernels import build, update as cpu_update
from zero_bnb.kernels.build import KernelBuildError
from zero_bnb.kernels import residual as residual_kernels
from zero_bnb.kernels.residual import split_rounded_bf16 as split_compiled
from zero_bnb.core.residual import join_bf16, split_bf16
from zero_bnb.core.residual import split_rounded_bf16 as split_torch
from test_residual import _PATTERNS as _RESIDUAL_PATTERNS, _floats
from zero_bnb.kernels.update import install_fused_update
from zero_bnb.kernels.fused import fused_quantize, fused_update, quantizer_path
from zero_bnb.kernels.hyper import BLOCK, FAMILIES, TWO_STATE, UpdateHyper, step_scalars
from zero_bnb.kernels.reference import quantize_codes, reference_update, sign_fix

pytestmark = pytest.mark.launch

QMAP1 = F.create_dynamic_map(signed=True)
QMAP2 = F.create_dynamic_map(signed=False)
TINY_STEP = QMAP1.clone()
TINY_STEP[128] = 1e-35  # a step near 5e-36: too far below 1 for the permute quantizer's 30 exponent rows
#: maps other than bitsandbytes' two, (map, signed): the kernel takes any sorted 256-entry map
OTHER_MAPS = {"linear signed": (F.create_linear_map(signed=True), True),
              "linear unsigned": (F.create_linear_map(signed=False), False),
              "tiny step signed": (TINY_STEP, True)}
#: families whose state-1 moment is never negative (its codes sit in the upper half of the signed map)
NON_NEGATIVE = ("rmsprop", "adagrad")


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(FAMILIES)))
    hyper = UpdateHyper(
        name=name,
        lr=draw(st.sampled_from([1e-6, 1e-3, 0.1, 3.0])),
        beta1=draw(st.sampled_from([0.0, 0.5, 0.9, 0.99])),
        beta2=draw(st.sampled_from([0.0, 0.9, 0.999, 0.9999])),
        beta3=draw(st.sampled_from([0.0, 0.9999])) if name == "ademamix" else 0.0,
        alpha=draw(st.sampled_from([0.0, 5.0])) if name == "ademamix" else 0.0,
        eps=draw(st.sampled_from([0.0, 1e-8, 1e-3])),
        weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
        skip_zeros=draw(st.booleans()) and name not in TWO_STATE,
    )
    return dict(
        hyper=hyper,
        n=draw(st.integers(1, 4 * BLOCK + 3)),
        step=draw(st.integers(1, 20)),
        scale=10.0 ** draw(st.integers(-30, 30)),
        zero_blocks=draw(st.booleans()),
        nonfinite=draw(st.sampled_from(["none", "nan", "inf", "-inf"])),
        zeros=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_inputs(case) -> dict[str, torch.Tensor]:
    """A partition's parameter, gradient and 8-bit state for ``case`` (fresh tensors each call)."""
    hyper, n = case["hyper"], case["n"]
    gen = torch.Generator().manual_seed(case["seed"])
    blocks, rows = -(-n // BLOCK), 2 if hyper.name == "ademamix" else 1
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * case["scale"]
    low = 127 if hyper.name in NON_NEGATIVE else 0
    state1 = torch.randint(low, 256, (rows * n,), generator=gen, dtype=torch.uint8)
    absmax1 = torch.rand(rows * blocks, generator=gen) * case["scale"]
    state2 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    absmax2 = torch.rand(blocks, generator=gen) * case["scale"] ** 2
    if case["zeros"]:
        g[torch.rand(n, generator=gen) < 0.3] = 0.0
    if case["zero_blocks"]:
        g[:BLOCK] = 0.0
        absmax1.view(rows, blocks)[:, 0] = 0.0
        absmax2[0] = 0.0
    if case["nonfinite"] != "none":
        g[torch.randint(0, n, (max(1, n // 50),), generator=gen)] = float(case["nonfinite"])
    inputs = dict(p=p, g=g, state1=state1, absmax1=absmax1, qmap1=QMAP1.clone())
    if hyper.name in TWO_STATE:
        inputs.update(state2=state2, absmax2=absmax2, qmap2=QMAP2.clone())
    return inputs


def run(update, case, **extra) -> dict[str, torch.Tensor]:
    inputs = make_inputs(case)
    update(case["hyper"], step_scalars(case["hyper"], case["step"]), **inputs, **extra)
    return inputs


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Equal codes and floats (NaN sign bits and payloads aside, which CPUs and GPUs set differently)."""
    for key, value in want.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{key}: {m}")
        else:
            differ = (got[key] != value).nonzero().flatten()
            assert differ.numel() == 0, f"{key}: {differ.numel()} codes differ, first at {differ[:5].tolist()}"


@settings(max_examples=100, deadline=None)
@given(cases())
def test_kernel_gives_the_reference_bits(case):
    assert_same_bits(run(fused_update, case), run(reference_update, case))


@settings(max_examples=25, deadline=None)
@given(cases())
def test_kernel_does_not_depend_on_the_thread_count(case):
    one = run(fused_update, case, threads=1)
    for threads in (2, 3):
        assert_same_bits(run(fused_update, case, threads=threads), one)


@settings(max_examples=40, deadline=None)
@given(cases(), st.data())
def test_updating_pieces_split_at_block_boundaries_equals_updating_the_whole(case, data):
    """Block-local: what each rank computes for its partition does not depend on where partitions start."""
    whole = run(fused_update, case)
    inputs = make_inputs(case)
    n, hyper = case["n"], case["hyper"]
    rows, blocks = (2 if hyper.name == "ademamix" else 1), -(-n // BLOCK)
    cut = BLOCK * data.draw(st.integers(0, blocks), label="cut block")
    scalars = step_scalars(hyper, case["step"])
    for start, end in ((0, cut), (cut, n)):
        if end <= start:
            continue
        first, last = start // BLOCK, -(-end // BLOCK)
        piece = dict(p=inputs["p"][start:end].clone(), g=inputs["g"][start:end].clone(),
                     state1=inputs["state1"].view(rows, n)[:, start:end].clone(memory_format=torch.contiguous_format),
                     absmax1=inputs["absmax1"].view(rows, blocks)[:, first:last].clone(memory_format=torch.contiguous_format),
                     qmap1=QMAP1)
        if hyper.name in TWO_STATE:
            piece.update(state2=inputs["state2"][start:end].clone(), absmax2=inputs["absmax2"][first:last].clone(),
                         qmap2=QMAP2)
        fused_update(hyper, scalars, **piece)
        inputs["p"][start:end] = piece["p"]
        inputs["state1"].view(rows, n)[:, start:end] = piece["state1"].view(rows, -1)
        inputs["absmax1"].view(rows, blocks)[:, first:last] = piece["absmax1"].view(rows, -1)
        if hyper.name in TWO_STATE:
            inputs["state2"][start:end] = piece["state2"]
            inputs["absmax2"][first:last] = piece["absmax2"]
    assert_same_bits(inputs, whole)


def probe_values(qmap: torch.Tensor) -> torch.Tensor:
    """Every map value, every midpoint the search compares with and their float neighbours, and the
    first and last value of every 65 536-key bucket of the kernel's table (in [-1, 1])."""
    values = torch.cat([qmap, torch.tensor([-1.0, 0.0, 1.0])])
    mids = torch.cat([(values[:, None] + values[None, :]).flatten() * 0.5])
    points = torch.cat([values, mids])
    inf = torch.tensor(float("inf"))
    neighbours = torch.cat([points, torch.nextafter(points, inf), torch.nextafter(points, -inf)])
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    edges = torch.cat([top, top | 0xFFFF]).to(torch.int32).view(torch.float32)
    edges = edges[edges.isfinite() & (edges.abs() <= 1.0)]
    return torch.cat([neighbours, edges, torch.tensor([-0.0, float("nan"), 2.0, -2.0])])


@pytest.mark.parametrize("signed", [True, False], ids=["signed map", "unsigned map"])
def test_quantizer_gives_the_binary_search_code_at_every_midpoint_and_bucket_edge(signed):
    qmap = QMAP1 if signed else QMAP2
    x = probe_values(qmap)
    want = quantize_codes(x, qmap, signed)
    if signed:
        want = sign_fix(want, x, qmap)
    got = fused_quantize(x, qmap, signed).long()
    differ = (got != want).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} codes differ, e.g. x={x[differ[:5]].tolist()}"


def expected_codes(x: torch.Tensor, qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    want = quantize_codes(x, qmap, signed)
    return sign_fix(want, x, qmap) if signed else want


@pytest.mark.parametrize("name", sorted(OTHER_MAPS))
def test_quantizer_gives_the_binary_search_code_with_other_maps(name):
    qmap, signed = OTHER_MAPS[name]
    x = probe_values(qmap)
    got = fused_quantize(x, qmap, signed).long()
    differ = (got != expected_codes(x, qmap, signed)).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} codes differ, e.g. x={x[differ[:5]].tolist()}"


def _cpu_flags() -> set[str]:
    return set(build._cpu_flags().split(":", 1)[-1].split())


magnitudes = st.integers(0, 0x40000000)  # float bits of [0, 2]: zero, subnormals, every binade up to 2
any_bits = st.integers(0, 2**32 - 1)  # also NaN, Inf and huge values


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(magnitudes, magnitudes.map(lambda bits: bits | 0x80000000), any_bits),
                min_size=1, max_size=300), st.sampled_from(sorted(["dynamic signed", "dynamic unsigned",
                                                                   *OTHER_MAPS])))
def test_quantizer_gives_the_binary_search_code_for_any_float(bits, name):
    qmap, signed = {"dynamic signed": (QMAP1, True), "dynamic unsigned": (QMAP2, False), **OTHER_MAPS}[name]
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = fused_quantize(x, qmap, signed).long()
    differ = (got != expected_codes(x, qmap, signed)).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} codes differ, e.g. x={x[differ[:5]].tolist()}"


def test_a_midpoint_tie_keeps_the_searchs_even_pivot():
    """The documented tie rule: ``x`` exactly between two codes gets the even one (the search's pivot)."""
    mids = (QMAP1[100:110] + QMAP1[101:111]) * 0.5
    exact = mids[(mids * 2 == QMAP1[100:110] + QMAP1[101:111])]
    codes = quantize_codes(exact, QMAP1, signed=True)
    assert bool((codes % 2 == 0).all()), codes
    assert fused_quantize(exact, QMAP1, signed=True).long().tolist() == codes.tolist()


#: Builds for each x86-64 instruction-set level (``$ZERO_BNB_KERNEL_MARCH``), by the quantizer path they take for
#: bitsandbytes' maps: x86-64-v2 the plain loops, x86-64-v3 AVX2 gathers, x86-64-v4 AVX-512 without VBMI (Skylake-X)
#: and this machine's (native: the permute quantizer where the CPU has AVX512-VBMI).
MARCHES = {"x86-64-v2": "scalar", "x86-64-v3": "avx2", "x86-64-v4": "gather", "native": None}
#: What the CPU needs to run each x86-64 level's code (the psABI's levels, as /proc/cpuinfo names the flags).
LEVEL_FLAGS = {"x86-64-v2": {"sse4_2", "popcnt", "ssse3"},
               "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe"},
               "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}
X86 = platform.machine() in ("x86_64", "AMD64")


def native_path() -> str:
    if not X86:
        return "neon" if platform.machine() in ("aarch64", "arm64") else "scalar"
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vbmi"} <= flags:
        return "permute"
    return "gather" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "scalar"


@pytest.fixture(scope="module", params=sorted(MARCHES))
def march_kernel(request, tmp_path_factory):
    """``(march, library)``: the kernel built with ``-march=march``, in a private cache."""
    if request.param != "native" and not X86:
        pytest.skip(f"-march={request.param} is an x86-64 level; this machine is {platform.machine()}")
    missing = sorted(LEVEL_FLAGS.get(request.param, set()) - _cpu_flags())
    if missing:  # running that build here would die of SIGILL, taking the whole suite with it
        pytest.skip(f"this CPU cannot run -march={request.param} code (it lacks {', '.join(missing)}); the build runs "
                    f"where the CPU has them (AVX2-only and AVX-512 machines both occur here)")
    folder = str(tmp_path_factory.mktemp(f"kernel-{request.param}"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.CACHE_ENV, folder)
        patch.setenv(build.MARCH_ENV, request.param)
        patch.delenv("CXX", raising=False)
        path = build.build_library()
    assert path.startswith(folder)
    return request.param, build.bind(path)


def test_each_build_takes_its_quantizer_path(march_kernel):
    """bitsandbytes' two maps take the build's fastest path; a map whose steps reach far below 1 leaves only the
    permute quantizer (for the 16-bit table's gathers). All give the binary search's codes (tests below)."""
    march, library = march_kernel
    fast = MARCHES[march] or native_path()
    assert quantizer_path(QMAP1, True, library=library) == fast
    assert quantizer_path(QMAP2, False, library=library) == fast
    assert quantizer_path(TINY_STEP, True, library=library) == {"permute": "gather", "neon": "scalar"}.get(fast, fast)


@settings(max_examples=30, deadline=None)
@given(cases())
def test_each_build_gives_the_reference_bits(march_kernel, case):
    assert_same_bits(run(fused_update, case, library=march_kernel[1]), run(reference_update, case))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(magnitudes, magnitudes.map(lambda bits: bits | 0x80000000), any_bits),
                min_size=1, max_size=300), st.sampled_from(sorted(["dynamic signed", "dynamic unsigned"])))
def test_each_build_quantizes_any_float_as_the_binary_search(march_kernel, bits, name):
    qmap, signed = (QMAP1, True) if name == "dynamic signed" else (QMAP2, False)
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = fused_quantize(x, qmap, signed, library=march_kernel[1]).long()
    differ = (got != expected_codes(x, qmap, signed)).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} codes differ, e.g. x={x[differ[:5]].tolist()}"


@pytest.mark.parametrize("name", sorted(["dynamic signed", "dynamic unsigned", *OTHER_MAPS]))
def test_each_build_quantizes_every_midpoint_and_bucket_edge_as_the_binary_search(march_kernel, name):
    qmap, signed = {"dynamic signed": (QMAP1, True), "dynamic unsigned": (QMAP2, False), **OTHER_MAPS}[name]
    x = probe_values(qmap)
    got = fused_quantize(x, qmap, signed, library=march_kernel[1]).long()
    differ = (got != expected_codes(x, qmap, signed)).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} codes differ, e.g. x={x[differ[:5]].tolist()}"


def _same_residual(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (torch.equal(a.low, b.low) and torch.equal(a.index, b.index)
            and torch.equal(a.value.view(torch.int32), b.value.view(torch.int32)))


@settings(max_examples=60, deadline=None)
@given(st.lists(_RESIDUAL_PATTERNS, min_size=0, max_size=9000), st.lists(st.integers(0, 8999), max_size=3))
def test_each_build_splits_bf16_masters_as_the_torch_version(march_kernel, bits, wrong):
    """The compiled bf16 residual split gives torch's split for every bit pattern (ties, NaN, Inf, denormals; more
    than one 4096-element span) whose weight is its rounding, and None when one weight is not."""
    master = _floats(bits)
    weight = master.to(torch.bfloat16)
    assert _same_residual(split_compiled(master, weight, library=march_kernel[1]), split_torch(master, weight))
    for at in (i for i in wrong if i < len(bits)):
        weight.view(torch.int16)[at] ^= 1
    got = split_compiled(master, weight, library=march_kernel[1])
    nan = torch.isnan(master)  # beside a NaN master any NaN weight is the rounding (torch's casts differ)
    rounding = torch.equal(master[~nan].to(torch.bfloat16).view(torch.int16), weight[~nan].view(torch.int16)) \
        and bool(torch.isnan(weight[nan]).all())
    assert (got is None) == (not rounding)
    assert got is None or _same_residual(got, split_bf16(master, weight))


def test_the_compiled_split_lists_more_exceptions_than_it_first_makes_room_for():
    """Every element a tie that carried (each one an exception): the count exceeds the first call's room and a
    second call lists them all; a NaN weight beside a NaN master, whatever NaN, is the rounding."""
    n = 3 * 4096 + 5
    hi = torch.arange(n, dtype=torch.int32) % 0x3F00 | 1  # odd top halves: each tie carries
    master = (hi << 16 | 0x8000).view(torch.float32)
    weight = master.to(torch.bfloat16)
    residual = split_compiled(master, weight)
    assert residual.index.tolist() == list(range(n)) and _same_residual(residual, split_torch(master, weight))
    master[7], master[9000] = float("nan"), float("nan")
    weight = master.to(torch.bfloat16)
    weight.view(torch.int16)[7] = 0x7FC0  # torch's scalar NaN beside its vectorised one (0xFFFF)
    assert split_torch(master, weight) is None  # torch's check compares the NaN's bits: it stores these masters whole
    residual = split_compiled(master, weight)
    assert residual is not None and 9000 in residual.index.tolist()  # 7's weight and bottom half join back as it
    assert torch.equal(join_bf16(weight, residual).view(torch.int32), master.view(torch.int32))


def test_the_split_runs_in_torch_where_the_kernel_cannot_be_built(fake_cxx):
    fake_cxx(fail=True)
    master = torch.randn(10_000)
    weight = master.to(torch.bfloat16)
    assert residual_kernels.compiled_split() is None
    assert _same_residual(split_compiled(master, weight), split_torch(master, weight))


ONE_STATE = sorted(set(FAMILIES) - set(TWO_STATE))


@pytest.mark.parametrize("bad", ["nan", "-nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ONE_STATE)
def test_a_nonfinite_gradient_in_a_one_state_family_does_what_the_cuda_kernel_does(name, bad):
    """1-state kernels do not special-case NaN/Inf gradients (kernels.cu 1153-1322): kernel and reference agree
    over three steps (bad gradient at step 2, weight decay on and off), and the documented effects hold: a NaN
    stays in its element and its moment gets code 255 whatever its sign bit (the GPU's canonical NaN is
    positive); an Inf makes its block's absmax Inf and poisons the block at the next step (moments NaN or
    Inf; parameters too, except Lion's: sgn(NaN) is 0)."""
    value = -float(bad[1:]) if bad.startswith("-") else float(bad)  # negation sets a NaN's sign bit too
    assert bool(torch.tensor(value).signbit()) == bad.startswith("-")
    n, where = 3 * BLOCK - 40, 5
    for weight_decay in (0.0, 0.01):
        hyper = UpdateHyper(name=name, lr=0.1, weight_decay=weight_decay)
        results = []
        for update in (fused_update, reference_update):
            gen = torch.Generator().manual_seed(7)
            p = torch.randn(n, generator=gen)
            state1, absmax1 = torch.full((n,), 127, dtype=torch.uint8), torch.zeros(3)
            snapshots = []
            for step in (1, 2, 3):
                g = torch.randn(n, generator=gen)
                if step == 2:
                    g[where] = value
                update(hyper, step_scalars(hyper, step), p, g, state1, absmax1, QMAP1.clone())
                snapshots.append(dict(p=p.clone(), state1=state1.clone(), absmax1=absmax1.clone()))
            results.append(snapshots)
        for got, want in zip(*results):
            assert_same_bits(got, want)
        after_bad, after_next = results[0][1], results[0][2]
        others = after_bad["p"][BLOCK:]
        assert bool(others.isfinite().all()), "a bad gradient reached another block"
        if bad.endswith("nan"):
            assert after_bad["absmax1"].isfinite().all(), after_bad["absmax1"]
            assert after_bad["state1"][where].item() == 255
            assert after_bad["p"][where].isnan().item() == (name != "lion")
            assert int(after_next["p"][:BLOCK].isnan().sum()) == (name != "lion")
        else:
            assert after_bad["absmax1"][0].item() == float("inf") and after_bad["absmax1"][1:].isfinite().all()
            # Inf again, or -FLT_MAX where every moment of the block became NaN (fmaxf's start value)
            assert after_next["absmax1"][0].item() in (float("inf"), -torch.finfo(torch.float32).max)
            if name != "lion":  # Lion moves by sgn(direction): 0 for NaN, so its parameters stay finite
                assert not bool(after_next["p"][:BLOCK].isfinite().all()), "the Inf block kept finite parameters"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_blocks_whose_absmax_is_zero_give_the_reference_bits(name):
    """Blocks of all-zero moments (rows no batch has touched; their x = 0/0 is NaN for every element, which the
    kernel searches once per run of equal bits): all +0, all -0, alternating +-0 and +-0 with a NaN gradient
    (a 1-state moment turns NaN, absmax still 0), next to an ordinary block and a zero partial block, 3 steps."""
    n = 5 * BLOCK + 7
    hyper = UpdateHyper(name=name, lr=1e-3, beta1=0.9, beta2=0.999, beta3=0.9999 if name == "ademamix" else 0.0,
                        alpha=5.0 if name == "ademamix" else 0.0, eps=1e-8)  # no decay: the zero blocks stay zero
    gen = torch.Generator().manual_seed(7)
    rows, blocks = (2 if name == "ademamix" else 1), 6
    g = torch.zeros(n)
    g[BLOCK:2 * BLOCK] = -0.0
    g[2 * BLOCK:3 * BLOCK:2] = -0.0
    g[3 * BLOCK:4 * BLOCK] = -0.0
    g[3 * BLOCK + 5] = float("nan")
    g[4 * BLOCK:5 * BLOCK] = torch.randn(BLOCK, generator=gen)
    low = 127 if name in NON_NEGATIVE else 0
    absmax1 = torch.zeros(rows, blocks)
    absmax1[:, 4] = 0.5
    absmax2 = torch.zeros(blocks)
    absmax2[4] = 0.25
    inputs = dict(p=torch.randn(n, generator=gen), g=g,
                  state1=torch.randint(low, 256, (rows * n,), generator=gen, dtype=torch.uint8),
                  absmax1=absmax1.flatten(), qmap1=QMAP1.clone())
    if name in TWO_STATE:
        inputs.update(state2=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8), absmax2=absmax2,
                      qmap2=QMAP2.clone())
    kernel = {key: value.clone() for key, value in inputs.items()}
    for step in (1, 2, 3):
        scalars = step_scalars(hyper, step)
        fused_update(hyper, scalars, **kernel)
        reference_update(hyper, scalars, **inputs)
        assert_same_bits(kernel, inputs)
    assert (kernel["absmax1"].view(rows, blocks)[:, :4] == 0).all(), "the zero blocks stayed zero"


# Build and cache robustness: a fake ``CXX`` logs each compile and either fails or copies this machine's real
# build (so no test here compiles anything).


@pytest.fixture
def fake_cxx(monkeypatch, tmp_path):
    """``make(fail=..., delay=...)`` installs a fake compiler; ``count()`` is how many compiles it ran."""
    real = build.build_library()
    log = tmp_path / "cxx.log"
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_update, "_warned", False)
    build.forget()

    def make(fail: bool = False, delay: float = 0.0) -> None:
        fake = tmp_path / "fakecxx"
        action = "exit 1" if fail else f'sleep {delay}; for last; do :; done; cp "{real}" "$last"'
        fake.write_text(f'#!/bin/sh\ncase "$1" in --version) echo fake 1.0; exit 0;; esac\n'
                        f'echo build >> "{log}"\n{action}\n')
        fake.chmod(0o755)
        monkeypatch.setenv("CXX", str(fake))

    make.count = lambda: len(log.read_text().splitlines()) if log.exists() else 0
    yield make
    build.forget()


def test_a_failing_compiler_is_tried_once_per_process_not_at_every_update(fake_cxx, caplog):
    fake_cxx(fail=True)
    params = [torch.nn.Parameter(torch.randn(5000)) for _ in range(4)]
    optimizer = bnb.optim.Adam8bit(params, lr=1e-3)
    install_fused_update(optimizer, "auto")
    with caplog.at_level(logging.WARNING, logger="zero_bnb.kernels.update"):
        for _ in range(3):
            for p in params:
                p.grad = torch.ones_like(p)
            optimizer.step()
    assert fake_cxx.count() == 1 and optimizer.update_step.fused_steps == 0
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    with pytest.raises(KernelBuildError, match=r"zero_cpu_update is \"fused\".*failed \(exit 1\)"):
        install_fused_update(bnb.optim.Adam8bit(params, lr=1e-3), "fused")  # "fused" still raises, no new build
    assert fake_cxx.count() == 1


@pytest.mark.parametrize("where", ["a file", "inside a file"])
def test_an_unusable_cache_folder_is_a_build_error_naming_it_and_the_fix(fake_cxx, monkeypatch, tmp_path, where,
                                                                         caplog):
    """The fix is the folder's, not a compiler's: neither the warning nor "fused" mode's error advises installing one."""
    fake_cxx()
    (tmp_path / "afile").write_text("x")
    folder = tmp_path / "afile" if where == "a file" else tmp_path / "afile" / "cache"
    monkeypatch.setenv(build.CACHE_ENV, str(folder))
    with pytest.raises(build.KernelCacheError, match=rf"kernel cache folder {folder}: .*set ZERO_BNB_KERNEL_DIR to a "
                                                     rf"writable folder"):
        build.load_library()
    with caplog.at_level(logging.WARNING, logger="zero_bnb.kernels.update"):
        assert not cpu_update._fused_available("auto")  # "auto" falls back (with its one warning)
    [warning] = [record.getMessage() for record in caplog.records]
    assert "set ZERO_BNB_KERNEL_DIR to a writable folder" in warning and "compiler" not in warning, warning
    with pytest.raises(build.KernelCacheError) as refused:
        cpu_update._fused_available("fused")
    assert "ZERO_BNB_KERNEL_DIR" in str(refused.value) and "compiler" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize("damage", [0, 100])
def test_a_damaged_cached_library_is_rebuilt_and_build_kernels_checks_that_it_loads(fake_cxx, monkeypatch, tmp_path,
                                                                                    capsys, damage):
    """Damaged: empty or truncated (a full disk, a cut copy). Each path is loaded at most once in this process
    (the dynamic loader hands a loaded path's old handle back), hence two cache folders."""
    fake_cxx()
    path = build.build_library()
    with open(path, "r+b") as handle:
        handle.truncate(damage)
    assert build.prebuild() == 0 and capsys.readouterr().out.splitlines()[0] == path
    assert fake_cxx.count() == 2 and os.path.getsize(path) > damage
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "other-cache"))
    path = build.build_library()
    with open(path, "r+b") as handle:
        handle.truncate(damage)
    assert build.load_library().zero_bnb_blockwise_update.restype is ctypes.c_int
    assert fake_cxx.count() == 4 and os.path.getsize(path) > damage


def test_concurrent_builders_of_one_key_compile_once(fake_cxx):
    fake_cxx(delay=1.0)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # flock excludes separate open files, threads too
        paths = list(pool.map(lambda _: build.build_library(), range(3)))
    assert len(set(paths)) == 1 and fake_cxx.count() == 1


@pytest.mark.parametrize("what", ["file writable by others", "folder writable by others", "file of another user"])
def test_a_cached_library_someone_else_could_have_written_is_refused(fake_cxx, monkeypatch, what):
    fake_cxx()
    path = build.build_library()
    if what == "file writable by others":
        os.chmod(path, 0o666)
    elif what == "folder writable by others":
        os.chmod(os.path.dirname(path), 0o777)
    elif os.getuid() == 0:
        os.chown(path, 12345, -1)
    else:  # not root: this process pretends to be another user
        monkeypatch.setattr(os, "getuid", lambda: 12345)
    with pytest.raises(KernelBuildError, match=rf"refusing to load the cached kernel {path}: .*(others|uid).*"
                                               rf"ZERO_BNB_KERNEL_DIR to a folder only you can write"):
        build.load_library()
    os.chmod(os.path.dirname(path), 0o1777)  # a sticky folder (like /tmp) keeps others from replacing it
    if what == "folder writable by others":
        build.forget()
        assert build.load_library().zero_bnb_blockwise_update.restype is ctypes.c_int


def _foreign_library() -> str:
    """A valid shared library that is not the kernel: one of Python's extension modules."""
    import importlib

    for name in ("_json", "_csv", "_bisect", "_ctypes"):
        found = getattr(importlib.import_module(name), "__file__", None)
        if found and found.endswith(".so"):
            return found
    pytest.skip("no shared-library extension module to stand in for a foreign library")


def _plant(source: str, path: str) -> None:
    """Put a copy of ``source`` at ``path`` as a new file (a new inode: the loader never takes it for a loaded one)."""
    scratch = f"{path}.planted"
    shutil.copyfile(source, scratch)
    os.chmod(scratch, 0o755)
    os.replace(scratch, path)


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _falls_back_and_fused_fails(caplog, names: str, compiler_fix: bool = False) -> None:
    """"auto" falls back with one warning containing ``names``; "fused" is an error containing it. Only a compiler
    problem (``compiler_fix``) gets advice about a compiler."""
    with caplog.at_level(logging.WARNING, logger="zero_bnb.kernels.update"):
        assert not cpu_update._fused_available("auto")
        assert not cpu_update._fused_available("auto")
    warnings = [record.getMessage() for record in caplog.records if record.name == "zero_bnb.kernels.update"]
    assert len(warnings) == 1 and names in warnings[0] and ("install a C++ compiler" in warnings[0]) == compiler_fix, \
        warnings
    with pytest.raises(KernelBuildError, match=r"zero_cpu_update is \"fused\"") as refused:
        cpu_update._fused_available("fused")
    assert names in str(refused.value), str(refused.value)


@pytest.mark.parametrize("folder_mode", [0o1777, 0o755], ids=["sticky shared folder", "private folder"])
def test_a_symbolic_link_at_the_kernels_name_is_refused_never_followed(fake_cxx, tmp_path, capsys, caplog,
                                                                       folder_mode):
    """B4: another user's link at the kernel's name to a library this user or root owns passed the trust check
    (which followed it) and was loaded; repointing the link later ran that user's code in this process."""
    fake_cxx()
    path = build.build_library()
    elsewhere = tmp_path / "elsewhere.so"
    os.replace(path, elsewhere)
    os.symlink(elsewhere, path)
    os.chmod(os.path.dirname(path), folder_mode)
    refusal = rf"refusing to load the cached kernel {re.escape(path)}: it is a symbolic link"
    with pytest.raises(build.KernelCacheError, match=refusal + r".*set ZERO_BNB_KERNEL_DIR to a folder only you can"):
        build.load_library()
    assert cli.main(["build-kernels"]) == 1 and re.search(refusal, _one_line_error(capsys))
    assert cli.main(["build-kernels", "--force"]) == 1  # nor does --force replace a link zero_bnb did not make
    assert re.search(rf"cannot rebuild the cached kernel {re.escape(path)} .*: it is a symbolic link",
                     _one_line_error(capsys))
    _falls_back_and_fused_fails(caplog, path)
    assert os.readlink(path) == str(elsewhere) and fake_cxx.count() == 1, "the link was replaced or followed"


def test_a_hard_link_at_the_kernels_name_in_a_shared_folder_is_refused(fake_cxx, tmp_path):
    """A hard link is not a symbolic link (O_NOFOLLOW opens it): in a folder others can write, another user may have
    linked any file of root's there, so a library with more than one link is refused."""
    fake_cxx()
    path = build.build_library()
    elsewhere = tmp_path / "elsewhere.so"
    os.replace(path, elsewhere)
    os.link(elsewhere, path)
    os.chmod(os.path.dirname(path), 0o1777)
    with pytest.raises(build.KernelCacheError, match=rf"{re.escape(path)}: it has 2 hard links"):
        build.load_library()
    os.chmod(os.path.dirname(path), 0o755)  # in a folder only its owner writes, a hard link is the owner's doing
    build.forget()
    assert build.load_library().zero_bnb_blockwise_update.restype is ctypes.c_int


def test_a_fifo_at_the_kernels_name_is_refused_without_waiting_for_a_writer(fake_cxx):
    """Opening a FIFO for reading waits for a writer: the loader hung on one. (After 15 s a child process plays the
    writer again and again, so the old code fails instead of hanging; a thread could not: dlopen holds the GIL.)"""
    fake_cxx()
    path = build.build_library()
    os.unlink(path)
    os.mkfifo(path)
    writer = subprocess.Popen([sys.executable, "-c", "import os, stat, sys, time\n"
                               "time.sleep(15)\n"
                               "while True:\n"
                               "    try:\n"
                               "        if stat.S_ISFIFO(os.lstat(sys.argv[1]).st_mode):\n"
                               "            os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))\n"
                               "    except OSError:\n"
                               "        pass\n"
                               "    time.sleep(0.2)\n", path])
    try:
        with pytest.raises(build.KernelCacheError, match=rf"{re.escape(path)}: it is not a regular file"):
            build.load_library()
    finally:
        writer.kill()
        writer.wait()
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and fake_cxx.count() == 1, "the FIFO was replaced"


@pytest.mark.parametrize("proc", ["/proc/self/fd", "no /proc"])
def test_the_library_loaded_is_the_file_that_was_checked_even_if_its_name_is_swapped(fake_cxx, monkeypatch, tmp_path,
                                                                                      proc):
    """The check and the load must see one file: the name is swapped for a foreign library right before the
    dynamic loader opens what it was given; the kernel is still what gets loaded (its descriptor, or where /proc
    is missing, a private copy of the checked bytes), and the swapped-in file is left where it is."""
    fake_cxx()
    path = build.build_library()
    if proc == "no /proc":
        from zero_bnb.kernels import cache

        monkeypatch.setattr(cache, "_PROC_FD", str(tmp_path / "no-proc"))
    real_cdll, handed = ctypes.CDLL, []

    def swap_then_load(name, *args, **kwargs):
        if not handed:
            _plant(_foreign_library(), path)
        handed.append(str(name))
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", swap_then_load)
    assert build.load_library().zero_bnb_blockwise_update.restype is ctypes.c_int
    assert path not in handed, f"the loader was handed the name {path}: {handed}"
    assert open(path, "rb").read() == open(_foreign_library(), "rb").read()
    if proc == "no /proc":
        assert sorted(os.listdir(os.path.dirname(path))) == sorted(
            [os.path.basename(path), os.path.basename(path)[:-3] + ".lock"]), "the private copy was left behind"


def test_the_compiler_writes_only_into_a_private_folder(fake_cxx, tmp_path):
    """A linker removes and recreates its output: in a folder others can write (sticky), a link planted at that name
    in between would make it write through the link. The output goes to a folder only this user can enter."""
    fake_cxx()
    log = tmp_path / "outputs.log"
    fake = tmp_path / "fakecxx"
    record = f'for last; do :; done; stat -c "%a %u" "$(dirname "$last")" >> "{log}"; echo build >>'
    fake.write_text(fake.read_text().replace("echo build >>", record))
    os.makedirs(os.environ[build.CACHE_ENV], mode=0o755)
    os.chmod(os.environ[build.CACHE_ENV], 0o1777)
    build.build_library()
    assert log.read_text().split() == ["700", str(os.getuid())], log.read_text()


@pytest.fixture
def held_lock(fake_cxx, monkeypatch):
    """An empty cache whose build lock another open file holds (released by a timer after 20 s: the old code's
    endless wait ends and the test fails instead of hanging); the lock timeout is 0.3 s."""
    fake_cxx()
    path = build.build_library()
    os.unlink(path)
    build.forget()
    lock = path[: -len(".so")] + ".lock"
    descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    monkeypatch.setenv("ZERO_BNB_KERNEL_LOCK_TIMEOUT", "0.3")
    timer = threading.Timer(20, fcntl.flock, [descriptor, fcntl.LOCK_UN])
    timer.start()
    yield path, lock, descriptor
    timer.cancel()
    os.close(descriptor)


def test_a_build_lock_not_granted_in_time_is_an_error_naming_it_and_auto_falls_back(held_lock, fake_cxx, capsys,
                                                                                    caplog):
    """B5: a lock held by another user's process made `zero-bnb build-kernels` and "auto" steps wait forever."""
    path, lock, descriptor = held_lock
    started = time.monotonic()
    refusal = (rf"the kernel build lock {re.escape(lock)} was not granted within 0.3 s: it is held by pid "
               rf"{os.getpid()} .*ZERO_BNB_KERNEL_LOCK_TIMEOUT")
    with pytest.raises(KernelBuildError, match=refusal) as timeout:
        build.build_library()
    assert time.monotonic() - started < 10 and isinstance(timeout.value, build.KernelLockTimeout)
    assert cli.main(["build-kernels"]) == 1 and lock in _one_line_error(capsys)
    build.forget()
    _falls_back_and_fused_fails(caplog, lock)
    assert fake_cxx.count() == 1 and not os.path.exists(path)
    fcntl.flock(descriptor, fcntl.LOCK_UN)  # released: the next process builds
    build.forget()
    assert build.load_library().zero_bnb_blockwise_update.restype is ctypes.c_int and fake_cxx.count() == 2


def test_a_stopped_builder_holding_the_lock_is_named_with_its_state(held_lock, fake_cxx):
    """B5: a builder of ours stopped by SIGSTOP holds the lock until it exits; the error names it from /proc/locks."""
    path, lock, descriptor = held_lock
    fcntl.flock(descriptor, fcntl.LOCK_UN)
    child = subprocess.Popen([sys.executable, "-c", "import fcntl, os, signal, sys\n"
                              "descriptor = os.open(sys.argv[1], os.O_RDWR)\n"
                              "fcntl.flock(descriptor, fcntl.LOCK_EX)\n"
                              "print('locked', flush=True)\n"
                              "os.kill(os.getpid(), signal.SIGSTOP)\n", lock], stdout=subprocess.PIPE, text=True)
    killer = threading.Timer(20, child.kill)
    killer.start()
    try:
        assert child.stdout.readline().strip() == "locked"
        for _ in range(200):
            if open(f"/proc/{child.pid}/status").read().count("State:\tT"):
                break
            time.sleep(0.05)
        named = rf"{re.escape(lock)} was not granted within 0.3 s: it is held by pid {child.pid} \([^,]+, state T "
        with pytest.raises(KernelBuildError, match=named + rf"\(stopped\), uid {os.getuid()}\)"):
            build.build_library()
    finally:
        killer.cancel()
        child.kill()
        child.wait()
        child.stdout.close()
    assert fake_cxx.count() == 1


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_an_invalid_lock_timeout_is_an_error_naming_the_variable(fake_cxx, monkeypatch, capsys, value):
    fake_cxx()
    monkeypatch.setenv("ZERO_BNB_KERNEL_LOCK_TIMEOUT", value)
    assert cli.main(["build-kernels"]) == 1
    line = _one_line_error(capsys)
    assert f"ZERO_BNB_KERNEL_LOCK_TIMEOUT={value!r} is not" in line and "default 60" in line, line


@pytest.mark.parametrize("how", ["build-kernels", "auto"])
def test_a_cached_library_without_the_kernels_functions_is_rebuilt(fake_cxx, capsys, caplog, how):
    """B9: any valid library at the kernel's name: `build-kernels` printed an AttributeError traceback and an
    "auto" step crashed."""
    fake_cxx()
    path = build.build_library()
    _plant(_foreign_library(), path)
    with caplog.at_level(logging.WARNING, logger="zero_bnb.kernels.build"):
        if how == "build-kernels":
            assert cli.main(["build-kernels"]) == 0
            captured = capsys.readouterr()
            assert captured.out.splitlines()[0] == path and "Traceback" not in captured.err, captured.err
        else:
            assert cpu_update._fused_available("auto")
            assert build.load_library().zero_bnb_quantizer_path.restype is ctypes.c_int
    [warning] = [record.getMessage() for record in caplog.records if record.name == "zero_bnb.kernels.build"]
    assert f"{path}: it lacks the kernel's functions zero_bnb_blockwise_update" in warning and "rebuilding" in warning
    assert fake_cxx.count() == 2 and build.bind(path).zero_bnb_quantize.restype is None


def test_a_cached_library_without_the_kernels_functions_falls_back_when_the_rebuild_fails(fake_cxx, capsys, caplog):
    fake_cxx()
    path = build.build_library()
    _plant(_foreign_library(), path)
    fake_cxx(fail=True)
    assert cli.main(["build-kernels"]) == 1
    assert "failed (exit 1)" in _one_line_error(capsys)
    build.forget()
    _falls_back_and_fused_fails(caplog, "failed (exit 1)", compiler_fix=True)


def test_a_file_without_the_kernels_functions_that_is_not_ours_is_refused_not_replaced(fake_cxx, monkeypatch,
                                                                                     capsys, caplog):
    """zero_bnb replaces only its own files: a root-owned library at the name loads (root is trusted) but is not
    this user's to replace (as root the test pretends to be uid 12345; as another user the file is refused)."""
    fake_cxx()
    path = build.build_library()
    _plant(_foreign_library(), path)
    monkeypatch.setattr(os, "getuid", lambda: 12345)
    assert cli.main(["build-kernels"]) == 1
    line = _one_line_error(capsys)
    assert path in line and "uid" in line and "ZERO_BNB_KERNEL_DIR" in line, line
    build.forget()
    _falls_back_and_fused_fails(caplog, path)
    assert open(path, "rb").read() == open(_foreign_library(), "rb").read() and fake_cxx.count() == 1


# Which library a run loaded (issue 34, point 10): the cache is reused silently otherwise.


def _announced(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zero_bnb.kernels.build" and r.levelno == logging.INFO
            and r.getMessage().startswith("zero_bnb: fused CPU 8-bit optimizer update:")]


def test_the_first_fused_update_says_which_library_and_quantizer_path_it_loaded_once(fake_cxx, capsys, caplog):
    fake_cxx()
    params = [torch.nn.Parameter(torch.randn(5000)) for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="zero_bnb.kernels.build"):
        for announce in (False, True, True):  # another rank's optimizer, then rank 0's (twice: one line)
            optimizer = bnb.optim.Adam8bit(params, lr=1e-3)
            install_fused_update(optimizer, "auto", announce=announce)
            for _ in range(2):
                for p in params:
                    p.grad = torch.ones_like(p)
                optimizer.step()
            assert optimizer.update_step.fused_steps == 4
    assert build.prebuild() == 0
    path, quantizer = capsys.readouterr().out.splitlines()  # what `zero-bnb build-kernels` prints
    [said] = _announced(caplog)
    assert said == f"zero_bnb: fused CPU 8-bit optimizer update: built {path} ({quantizer})", said
    assert quantizer.removeprefix("quantizer: ") in build.QUANTIZER_PATHS and fake_cxx.count() == 1
    caplog.clear()
    build.forget()  # as a new process: the library comes from the cache
    with caplog.at_level(logging.INFO, logger="zero_bnb.kernels.build"):
        build.load_library(announce=True)
        build.load_library(announce=True)
    assert _announced(caplog) == [f"zero_bnb: fused CPU 8-bit optimizer update: loaded the cached build {path} "
                                  f"({quantizer})"] and fake_cxx.count() == 1


def test_only_rank_0_of_an_engine_says_which_kernel_library_it_loaded(tmp_path):
    import kernel_log_scenarios

    from zero_bnb.testing.launch import run_distributed

    run_distributed(kernel_log_scenarios.train_and_record, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # the first engine's 2 steps, each updating every 8-bit flat group of the rank once
    assert all(rank["eight_bit_groups"] >= 1 and rank["fused_steps"] == 2 * rank["eight_bit_groups"]
               for rank in ranks), ranks
    [said] = [m for m in ranks[0]["messages"] if m.startswith("zero_bnb: fused CPU 8-bit optimizer update:")]
    assert re.fullmatch(r"zero_bnb: fused CPU 8-bit optimizer update: (built|loaded the cached build) "
                        r"/\S+/zero_bnb_blockwise_update_[0-9a-f]{16}\.so \(quantizer: (scalar|gather|permute|avx2)\)",
                        said), said
    assert not [m for m in ranks[1]["messages"] if m.startswith("zero_bnb: fused CPU")], ranks[1]
    # issue 45: describe() and rank 0's initialize log say which kernel steps which group (the 8-bit ones: the fused
    # kernel unless zero_cpu_update says bitsandbytes; a group below min_8bit_size: bitsandbytes' 32-bit update)
    for rank in ranks:
        fused, plain = rank["kernels"]
        groups = sorted(g for kernel in plain.values() for g in kernel)
        assert list(plain) == ["bitsandbytes"] and groups == list(range(len(groups))), rank["kernels"]
        assert len(fused["zero_bnb fused CPU kernel"]) == rank["eight_bit_groups"], rank["kernels"]
        assert sorted(fused["zero_bnb fused CPU kernel"] + fused.get("bitsandbytes", [])) == groups, rank["kernels"]
    def named(groups):
        return f"group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))}"

    fused, plain = ranks[0]["kernels"]
    steps_by = [m for m in ranks[0]["messages"] if "optimizer steps by" in m]
    assert steps_by == [
        f"zero_bnb: optimizer steps by zero_bnb fused CPU kernel for {named(fused['zero_bnb fused CPU kernel'])}"
        + (f"; bitsandbytes for {named(fused['bitsandbytes'])}" if "bitsandbytes" in fused else "")
        + " (zero_cpu_update=auto, zero_gpu_update=auto)",
        f"zero_bnb: optimizer steps by bitsandbytes for {named(plain['bitsandbytes'])} "
        f"(zero_cpu_update=bitsandbytes, zero_gpu_update=fused)"], steps_by
    assert not [m for m in ranks[1]["messages"] if "optimizer steps by" in m], ranks[1]["messages"]


def test_the_family_table_numbers_each_family_as_the_compiled_kernel_does():
    """Issue 43: one table (``kernels.hyper.Family``) chooses the kernel family; its numbers are the C++ enum's."""
    import re

    from zero_bnb.kernels import hyper
    from zero_bnb.kernels.hyper import Family

    with open(os.path.join(os.path.dirname(hyper.__file__), "csrc", "blockwise_update.cpp")) as handle:
        source = handle.read()
    declared = dict(re.findall(r"(\w+) = (\d+)", re.search(r"enum Family \{([^}]*)\}", source).group(1)))
    assert {name: int(number) for name, number in declared.items()} == {f.name: f.kernel for f in Family}
    assert TWO_STATE == ("adam", "ademamix") and [f.rows for f in Family] == [1, 2, 1, 1, 1, 1]
