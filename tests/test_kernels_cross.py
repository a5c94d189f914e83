"""The fused kernel built for another instruction set than this machine's: aarch64 (NEON), run under qemu-aarch64.

Python cannot load an aarch64 library, so ``tests/csrc/kernel_driver.cpp`` (the kernel's own source and a small
``main``) is cross-compiled with the kernel's flags (:data:`zero_bnb.kernels.build.FLAGS`, ``-march`` replaced)
and run under ``qemu-aarch64``: it reads calls of the kernel on stdin and writes their results. Here they are
compared bit for bit with :mod:`zero_bnb.kernels.reference`, computed on this machine: the quantizer at every map
midpoint, its float neighbours and every bucket edge, on random floats of any bits (NaN, Inf, subnormals, both
zeros, |x| >= 2) and with four maps (one the NEON tables cannot hold); the whole update of every family on seeded
random partitions (partial last blocks, zero blocks, NaN/Inf/signalling-NaN gradients, every hyper-parameter, 1 and
3 threads); the path each build reports; and the checkpoint's bf16 residual split (``csrc/bf16_split.h``, in the
same library) against its torch version. Two aarch64 builds: ``-march=armv8-a`` (NEON, every aarch64 CPU) and
``-march=armv9-a`` (SVE2, as Grace and Graviton 4 have, which the compiler may use for the portable loops). The same
driver built for this machine (``native``) runs without an emulator, so the driver itself is checked wherever a
compiler is.

Needs (Debian/Ubuntu): ``apt-get install g++-aarch64-linux-gnu qemu-user`` (or ``$ZERO_BNB_AARCH64_CXX`` naming
an aarch64 C++ compiler with OpenMP and a static libc, and ``qemu-aarch64`` or ``qemu-aarch64-static`` on PATH);
the aarch64 tests skip, naming that line, where they are absent. On an aarch64 machine the driver runs natively.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import shlex
import shutil
import struct
import subprocess

import pytest
import torch

from test_kernels import OTHER_MAPS, QMAP1, QMAP2, assert_same_bits, expected_codes, make_inputs, \
    probe_values
from zero_bnb.kernels import build
from zero_bnb.kernels.hyper import BLOCK, FAMILIES, TWO_STATE, StepScalars, UpdateHyper, step_scalars
from zero_bnb.kernels.reference import reference_update

pytestmark = pytest.mark.launch

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "kernel_driver.cpp")
INSTALL = "apt-get install g++-aarch64-linux-gnu qemu-user"
AARCH64 = platform.machine() in ("aarch64", "arm64")
#: build name -> the flags that replace -march (aarch64 builds: the path they must report for bitsandbytes' maps)
TARGETS = {"native": ("-march=native",), "aarch64 armv8-a": ("-march=armv8-a",),
           "aarch64 armv9-a": ("-march=armv9-a",)}
MAPS = {"dynamic signed": (QMAP1, True), "dynamic unsigned": (QMAP2, False), **OTHER_MAPS}
_SCALARS = struct.Struct("<15f2i")
_SCALAR_NAMES = ("beta1", "beta2", "beta3", "alpha", "eps", "lr", "weight_decay", "one_minus_beta1", "one_minus_beta2",
                 "one_minus_beta3", "correction1", "correction2", "step_size", "eps_hat", "decay")


def _aarch64_tools() -> tuple[list[str], list[str]]:
    """The aarch64 compiler and the command that runs its programs (empty on an aarch64 machine); skips when absent."""
    if AARCH64:
        return shlex.split(os.environ.get("CXX", "")) or ["c++"], []
    compiler = shlex.split(os.environ.get("ZERO_BNB_AARCH64_CXX", "")) or ["aarch64-linux-gnu-g++"]
    if shutil.which(compiler[0]) is None:
        pytest.skip(f"no aarch64 C++ compiler ({compiler[0]} not on PATH; set ZERO_BNB_AARCH64_CXX or run: {INSTALL})")
    emulator = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if emulator is None:
        pytest.skip(f"no qemu-aarch64 or qemu-aarch64-static on PATH to run aarch64 programs (run: {INSTALL})")
    return compiler, [emulator, "-cpu", "max"]


@pytest.fixture(scope="module", params=sorted(TARGETS))
def driver(request, tmp_path_factory) -> tuple[str, list[str]]:
    """``(target, command)``: the driver built for ``target``, and how to run it."""
    target = request.param
    cross = target.startswith("aarch64") and not AARCH64
    if target.startswith("aarch64"):
        compiler, runner = _aarch64_tools()
        if AARCH64 and target == "aarch64 armv9-a" and "sve2" not in build._cpu_flags().split():
            pytest.skip("an armv9-a (SVE2) build cannot run on this aarch64 CPU, which has no sve2")
    else:
        compiler, runner = shlex.split(os.environ.get("CXX", "")) or ["c++"], []
        if shutil.which(compiler[0]) is None:
            pytest.skip(f"no C++ compiler ({compiler[0]}): install one, e.g. apt-get install g++")
    flags = [flag for flag in build.FLAGS if flag not in ("-fPIC", "-shared") and not flag.startswith("-march=")]
    binary = str(tmp_path_factory.mktemp("driver") / "kernel_driver")
    command = [*compiler, *flags, *TARGETS[target], *(["-static"] if cross else []),
               "-I", os.path.dirname(build.SOURCE), DRIVER, "-o", binary]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    missing = [line for line in done.stderr.splitlines() if "cannot find -l" in line]
    if cross and done.returncode != 0 and missing:
        pytest.skip(f"{compiler[0]} cannot link a static aarch64 program ({missing[0].strip()}); run: {INSTALL}")
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-3000:]}"
    return target, [*runner, binary]


class Calls:
    """Calls of the kernel for the driver, and how to read each one's result."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.readers = []

    def quantize(self, x: torch.Tensor, qmap: torch.Tensor, signed: bool) -> None:
        x = x.to(torch.float32).contiguous()
        self.parts += [struct.pack("<iiq", 0, int(signed), x.numel()), _bytes(qmap), _bytes(x)]
        self.readers.append(lambda out: torch.frombuffer(bytearray(out.take(x.numel())), dtype=torch.uint8))

    def path(self, qmap: torch.Tensor, signed: bool) -> None:
        self.parts += [struct.pack("<ii", 2, int(signed)), _bytes(qmap)]
        self.readers.append(lambda out: build.QUANTIZER_PATHS[struct.unpack("<i", out.take(4))[0]])

    def widest(self) -> None:
        self.parts.append(struct.pack("<i", 3))
        self.readers.append(lambda out: build.QUANTIZER_PATHS[struct.unpack("<i", out.take(4))[0]])

    def split(self, master: torch.Tensor, weight: torch.Tensor, cap: int) -> None:
        """The bf16 residual split: (count, bottom halves, the first min(count, cap) exception indices)."""
        n = master.numel()
        self.parts += [struct.pack("<iqq", 4, n, cap), _bytes(master), _bytes(weight)]

        def read(out):
            count = struct.unpack("<q", out.take(8))[0]
            low = torch.frombuffer(bytearray(out.take(2 * n)), dtype=torch.int16) if n else \
                torch.empty(0, dtype=torch.int16)
            listed = max(0, min(count, cap))
            index = torch.frombuffer(bytearray(out.take(8 * listed)), dtype=torch.int64) if listed else \
                torch.empty(0, dtype=torch.int64)
            return count, low, index

        self.readers.append(read)

    def update(self, hyper: UpdateHyper, scalars: StepScalars, inputs: dict[str, torch.Tensor], threads: int) -> None:
        n, two = inputs["p"].numel(), hyper.name in TWO_STATE
        packed = _SCALARS.pack(*(getattr(scalars, name) for name in _SCALAR_NAMES), scalars.step, int(hyper.skip_zeros))
        self.parts += [struct.pack("<iiiq", 1, FAMILIES[hyper.name], threads, n), packed]
        keys = ["p", "g", "state1", "absmax1", "qmap1"] + (["state2", "absmax2", "qmap2"] if two else [])
        self.parts += [_bytes(inputs[key]) for key in keys]
        returned = ["p", "state1", "absmax1"] + (["state2", "absmax2"] if two else [])

        def read(out):
            status = struct.unpack("<i", out.take(4))[0]
            got = {key: torch.frombuffer(bytearray(out.take(inputs[key].numel() * inputs[key].element_size())),
                                         dtype=inputs[key].dtype) for key in returned}
            return status, got

        self.readers.append(read)

    def run(self, command: list[str]) -> list:
        done = subprocess.run(command, input=b"".join(self.parts), capture_output=True, timeout=900)
        assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}: {done.stderr.decode()[-2000:]}"
        out = _Reader(done.stdout)
        results = [read(out) for read in self.readers]
        assert out.offset == len(done.stdout), f"{len(done.stdout) - out.offset} bytes of output left unread"
        return results


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.offset = data, 0

    def take(self, count: int) -> bytes:
        assert self.offset + count <= len(self.data), "the driver's output is shorter than its calls' results"
        piece = self.data[self.offset:self.offset + count]
        self.offset += count
        return piece


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _expected_paths(target: str) -> dict[str, str]:
    """The quantizer path each map must take: aarch64 builds the NEON tables (none for a map they cannot hold);
    a native build what the kernel Python loads here reports."""
    if target.startswith("aarch64"):
        return {"widest": "neon"} | {name: "scalar" if name == "tiny step signed" else "neon" for name in MAPS}
    from zero_bnb.kernels.fused import quantizer_path

    widest = build.QUANTIZER_PATHS[build.load_library().zero_bnb_widest_path()]
    return {"widest": widest} | {name: quantizer_path(*MAPS[name]) for name in MAPS}


def test_each_build_reports_its_quantizer_path(driver):
    target, command = driver
    calls = Calls()
    calls.widest()
    for qmap, signed in MAPS.values():
        calls.path(qmap, signed)
    got = dict(zip(["widest", *MAPS], calls.run(command)))
    assert got == _expected_paths(target)


def _random_floats(rng: random.Random, count: int) -> torch.Tensor:
    """Float bits of [-2, 2] (every binade, subnormals, both zeros) and of anything (NaN, Inf, huge)."""
    bits = [rng.choice((rng.randrange(0, 0x40000001), rng.randrange(0, 0x40000001) | 0x80000000,
                        rng.randrange(0, 2**32))) for _ in range(count)]
    bits += [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7FA00000, 0x00000001,
             0x3F800000, 0xBF800000, 0x40000000, 0xC0000000]
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("name", sorted(MAPS))
def test_each_build_quantizes_every_midpoint_bucket_edge_and_any_float_as_the_binary_search(driver, name):
    qmap, signed = MAPS[name]
    rng = random.Random(f"quantize {name}")
    probes = probe_values(qmap)
    # partial last blocks: lengths that are not multiples of 256
    pieces = [probes, _random_floats(rng, 20_000), _random_floats(rng, 1), _random_floats(rng, 257)]
    calls = Calls()
    for x in pieces:
        calls.quantize(x, qmap, signed)
    for x, got in zip(pieces, calls.run(driver[1])):
        want = expected_codes(x, qmap, signed)
        differ = (got.long() != want).nonzero().flatten()
        assert differ.numel() == 0, (f"{driver[0]}: {differ.numel()} of {x.numel()} codes differ, e.g. "
                                     f"x={x[differ[:5]].tolist()} got {got[differ[:5]].tolist()} "
                                     f"want {want[differ[:5]].tolist()}")


def _case(rng: random.Random, name: str, nonfinite: str) -> dict:
    """A seeded case as tests/test_kernels.py's ``cases`` draws them."""
    hyper = UpdateHyper(
        name=name, lr=rng.choice([1e-6, 1e-3, 0.1, 3.0]), beta1=rng.choice([0.0, 0.5, 0.9, 0.99]),
        beta2=rng.choice([0.0, 0.9, 0.999, 0.9999]), beta3=rng.choice([0.0, 0.9999]) if name == "ademamix" else 0.0,
        alpha=rng.choice([0.0, 5.0]) if name == "ademamix" else 0.0, eps=rng.choice([0.0, 1e-8, 1e-3]),
        weight_decay=rng.choice([0.0, 1e-2, 0.5]), skip_zeros=rng.random() < 0.5 and name not in TWO_STATE)
    return dict(hyper=hyper, n=rng.randint(1, 4 * BLOCK + 3), step=rng.randint(1, 20),
                scale=10.0 ** rng.randint(-30, 30), zero_blocks=rng.random() < 0.5, nonfinite=nonfinite,
                zeros=rng.random() < 0.5, seed=rng.randrange(2**31))


def _cases(name: str) -> list[dict]:
    rng = random.Random(f"update {name}")
    cases = [_case(rng, name, nonfinite) for nonfinite in ("none", "nan", "inf", "-inf") for _ in range(3)]
    # a signalling NaN gradient taken as the moment without arithmetic (momentum's first step, no decay)
    signalling = _case(rng, name, "none")
    cases.append(dict(signalling, hyper=dataclasses.replace(signalling["hyper"], weight_decay=0.0), step=1, n=300,
                      signalling=True))
    cases.append(dict(_case(rng, name, "none"), n=BLOCK))  # one whole block, no partial one
    return cases


def _inputs(case: dict) -> dict[str, torch.Tensor]:
    inputs = make_inputs(case)
    if case.get("signalling"):
        inputs["g"].view(torch.int32)[[3, 260]] = 0x7FA00000
        inputs["g"].view(torch.int32)[7] = -0x00600000  # 0xffa00000: with its sign bit set
    return inputs


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_build_updates_as_the_reference_bit_for_bit(driver, name):
    cases = _cases(name)
    calls = Calls()
    for case in cases:
        for threads in (1, 3):
            calls.update(case["hyper"], step_scalars(case["hyper"], case["step"]), _inputs(case), threads)
    results = iter(calls.run(driver[1]))
    for case in cases:
        want = _inputs(case)
        reference_update(case["hyper"], step_scalars(case["hyper"], case["step"]), **want)
        for threads in (1, 3):
            status, got = next(results)
            assert status == 0, f"{driver[0]}: the kernel refused {name} (status {status})"
            try:
                assert_same_bits(got, {key: want[key] for key in got})
            except AssertionError as error:
                raise AssertionError(f"{driver[0]}, {threads} thread(s), case {case}: {error}") from None


def _split_cases(rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Masters of any bits beside their rounding (ties of both parities, NaN, Inf, subnormals; several 4096-element
    spans), the same with one weight off by one ulp, and every element a tie that carried (more exceptions than the
    first call's room)."""
    cases = []
    for n in (0, 1, 4095, 4097, 3 * 4096 + 77):
        bits = [rng.getrandbits(32) for _ in range(n)]
        for i in range(0, n, 7):
            bits[i] = (bits[i] & 0xFFFF0000) | rng.choice([0x8000, 0x7FFF, 0x8001, 0])
        for i, special in zip(range(3, n, 997), [0x7FC00000, 0x7F800000, 0x00000001, 0xFF800000, 0x7F7FFFFF]):
            bits[i] = special
        signed = [b - (1 << 32) if b >= 1 << 31 else b for b in bits]
        master = torch.tensor(signed, dtype=torch.int32).view(torch.float32)
        cases.append((master, master.to(torch.bfloat16)))
        if n:
            wrong = master.to(torch.bfloat16)
            wrong.view(torch.int16)[n // 2] ^= 1
            cases.append((master, wrong))
    ties = ((torch.arange(9000, dtype=torch.int32) % 0x3F00 | 1) << 16 | 0x8000).view(torch.float32)
    cases.append((ties, ties.to(torch.bfloat16)))
    return cases


def test_each_build_splits_bf16_masters_as_the_torch_version(driver):
    """The checkpoint's compiled bf16 split (csrc/bf16_split.h) gives the torch version's residual on every build."""
    from zero_bnb.core.residual import split_rounded_bf16

    target, command = driver
    cases, calls = _split_cases(random.Random(11)), Calls()
    for master, weight in cases:
        calls.split(master, weight, cap=64)
    for (master, weight), (count, low, index) in zip(cases, calls.run(command)):
        expected = split_rounded_bf16(master, weight)
        if expected is None:
            assert count == -1, (target, master.numel())
            continue
        assert count == expected.index.numel(), (target, master.numel(), count)
        assert torch.equal(low, expected.low), target
        assert index.tolist() == expected.index[:64].tolist(), target

