"""The 8-bit Adam step alone on a GPU: zero_bnb's Triton kernel against bitsandbytes' CUDA kernel and fused AdamW.

    pip install bitsandbytes triton                                   # (PyTorch's CUDA builds ship triton)
    python benchmarks/gpu/triton_update.py OUT.json                   # on a machine with a CUDA device
    python benchmarks/gpu/triton_update.py OUT.json --dry-run         # no GPU: Triton's interpreter, tiny sizes

For each size (default 16M, 64M, 256M and 1G elements; a size that does not fit in free GPU memory is skipped and
said), the variants run interleaved, their order rotated every round, each timed with CUDA events over a few calls
after a warm-up: ``bitsandbytes`` (``optimizer_update_8bit_blockwise("adam", ...)``, what bitsandbytes' AdamW8bit
calls), ``triton`` (:func:`zero_bnb.kernels.triton_update.triton_update` on the same kind of state), ``fused-adamw``
(``torch.optim.AdamW(fused=True)``, fp32 state) and ``copy`` (a device-to-device copy: the bandwidth the others are
measured against). Rounds repeat until the spread (p10-p90 over rounds, relative to the median) of the triton /
bitsandbytes time ratio is under 2 %, or the size's time is spent; the spread is reported either way.

Bytes moved per element: 8-bit Adam 16 (parameter and gradient fp32 read, parameter written, two uint8 moments read and
written) plus ``absmax`` (2 x 8 / 256); fused AdamW 28 (parameter, gradient, two fp32 moments read; parameter and
moments written); copy 8. Reported: median time, bytes / time, that over the copy's bytes / time, the ratios with
their spread, and how many codes the Triton step and bitsandbytes' step give differently from the same state (a
sanity check: they differ only near quantization midpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SIZES = {"16M": 16 << 20, "64M": 64 << 20, "256M": 256 << 20, "1G": 1 << 30}
DRY_SIZES = {"64K": 64 << 10}
BYTES_PER_ELEMENT = {"bitsandbytes": 16 + 16 / 256, "triton": 16 + 16 / 256, "fused-adamw": 28.0, "copy": 8.0}
VARIANTS = tuple(BYTES_PER_ELEMENT)
TARGET_SPREAD = 0.02


def _state(n: int, device: str, seed: int = 0) -> dict:
    import bitsandbytes.functional as F
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = -(-n // 256)
    return {"p": torch.randn(n, device=device, generator=gen), "g": torch.randn(n, device=device, generator=gen) * 1e-2,
            "state1": torch.randint(0, 256, (n,), device=device, dtype=torch.uint8, generator=gen),
            "state2": torch.randint(0, 256, (n,), device=device, dtype=torch.uint8, generator=gen),
            "absmax1": torch.rand(blocks, device=device, generator=gen) * 1e-2,
            "absmax2": torch.rand(blocks, device=device, generator=gen) * 1e-4,
            "qmap1": F.create_dynamic_map(signed=True).to(device), "qmap2": F.create_dynamic_map(signed=False).to(device)}


def _callers(n: int, device: str) -> dict:
    """One call of each variant, on state of ``n`` elements (each variant its own, so they do not interfere)."""
    import bitsandbytes.functional as F
    import torch

    from zero_bnb.kernels.hyper import UpdateHyper, step_scalars
    from zero_bnb.kernels.triton_update import triton_update

    hyper = UpdateHyper(name="adam", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    scalars = step_scalars(hyper, 10)
    ours, theirs = _state(n, device), _state(n, device)

    def bnb_step():
        s = theirs
        F.optimizer_update_8bit_blockwise("adam", s["g"], s["p"], s["state1"], s["state2"], 0.9, 0.999, 0.0, 0.0, 1e-8,
                                          10, 1e-3, s["qmap1"], s["qmap2"], s["absmax1"], s["absmax2"], 0.01,
                                          gnorm_scale=1.0)

    def triton_step():
        s = ours
        triton_update(hyper, scalars, s["p"], s["g"], s["state1"], s["absmax1"], s["qmap1"], s["state2"], s["absmax2"],
                      s["qmap2"])

    param = torch.nn.Parameter(torch.randn(n, device=device))
    param.grad = torch.randn(n, device=device) * 1e-2
    adamw = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=device == "cuda")
    source, target = torch.empty(n, device=device), torch.empty(n, device=device)
    return {"bitsandbytes": bnb_step, "triton": triton_step, "fused-adamw": adamw.step,
            "copy": lambda: target.copy_(source)}


def _codes_differing(n: int, device: str) -> dict:
    """One step of each kernel from the same state: how many codes and parameters differ."""
    import bitsandbytes.functional as F

    from zero_bnb.kernels.hyper import UpdateHyper, step_scalars
    from zero_bnb.kernels.triton_update import triton_update

    ours, theirs = _state(n, device, seed=7), _state(n, device, seed=7)
    hyper = UpdateHyper(name="adam", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    triton_update(hyper, step_scalars(hyper, 10), ours["p"], ours["g"], ours["state1"], ours["absmax1"], ours["qmap1"],
                  ours["state2"], ours["absmax2"], ours["qmap2"])
    F.optimizer_update_8bit_blockwise("adam", theirs["g"], theirs["p"], theirs["state1"], theirs["state2"], 0.9, 0.999,
                                      0.0, 0.0, 1e-8, 10, 1e-3, theirs["qmap1"], theirs["qmap2"], theirs["absmax1"],
                                      theirs["absmax2"], 0.01, gnorm_scale=1.0)
    return {"codes_differing": int((ours["state1"] != theirs["state1"]).sum() + (ours["state2"] != theirs["state2"]).sum()),
            "codes": 2 * n, "params_differing": int((ours["p"] != theirs["p"]).sum())}


def _time(call, calls: int, device: str) -> float:
    """Seconds per call: CUDA events around ``calls`` calls (wall clock on the CPU)."""
    import torch

    if device != "cuda":
        started = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - started) / calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / calls


def _spread(values: list[float]) -> float:
    """p10-p90 over the median (0 for fewer than 2 values)."""
    if len(values) < 2:
        return 0.0
    ordered = sorted(values)
    low, high = ordered[int(0.1 * (len(ordered) - 1))], ordered[round(0.9 * (len(ordered) - 1))]
    return (high - low) / statistics.median(ordered)


def measure(name: str, n: int, device: str, seconds: float, calls: int, min_rounds: int) -> dict:
    import torch

    callers = _callers(n, device)
    for call in callers.values():  # warm-up: Triton's compilation, bitsandbytes' first launch, AdamW's state
        call()
    times = {variant: [] for variant in VARIANTS}
    ratios = []
    started = time.perf_counter()
    while True:
        rotation = len(ratios) % len(VARIANTS)
        for variant in VARIANTS[rotation:] + VARIANTS[:rotation]:
            times[variant].append(_time(callers[variant], calls, device))
        ratios.append(times["triton"][-1] / times["bitsandbytes"][-1])
        spent = time.perf_counter() - started
        if len(ratios) >= min_rounds and (_spread(ratios) < TARGET_SPREAD or spent > seconds):
            break
    median = {variant: statistics.median(values) for variant, values in times.items()}
    bandwidth = {variant: BYTES_PER_ELEMENT[variant] * n / median[variant] for variant in VARIANTS}
    del callers
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"size": name, "numel": n, "rounds": len(ratios), "calls_per_round": calls,
            "median_s": median, "bytes_per_s": bandwidth,
            "of_copy_bandwidth": {variant: bandwidth[variant] / bandwidth["copy"] for variant in VARIANTS},
            "triton_over_bitsandbytes": statistics.median(ratios), "ratio_spread_p10_p90": _spread(ratios),
            "triton_over_fused_adamw": median["triton"] / median["fused-adamw"],
            "agreement": _codes_differing(n, device)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON report to write")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: Triton's interpreter on CPU tensors, one tiny size")
    parser.add_argument("--sizes", nargs="*", default=None, help=f"default: {' '.join(SIZES)}")
    parser.add_argument("--seconds", type=float, default=15.0, help="the most time one size's rounds take")
    args = parser.parse_args(argv)
    if args.dry_run:  # Triton's own library first, compiled as usual; then the kernel's module, interpreted
        import importlib.util

        if importlib.util.find_spec("triton"):
            import triton  # noqa: F401
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("triton_update: no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    from zero_bnb.kernels.triton_update import interpreting, triton_missing

    if triton_missing():
        print(f"triton_update: {triton_missing()}", file=sys.stderr)
        return 2
    sizes = DRY_SIZES if args.dry_run else {name: SIZES[name] for name in (args.sizes or SIZES)}
    report = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "triton": __import__("triton").__version__, "sizes": [], "skipped": []}
    for name, n in sizes.items():
        # the variants' state at once: 10 B per element for each 8-bit step, 16 for AdamW, 8 for the copy (the
        # agreement check's 20 come after they are freed), with headroom
        need = 48 * n
        if device == "cuda" and torch.cuda.mem_get_info()[0] < need:
            report["skipped"].append(f"{name}: needs about {need / 2**30:.1f} GiB, "
                                     f"{torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB free")
            continue
        result = measure(name, n, device, 0.0 if args.dry_run else args.seconds, calls=1 if args.dry_run else 5,
                         min_rounds=3 if args.dry_run else 8)
        report["sizes"].append(result)
        with open(args.out, "w") as handle:  # after every size: a later one may be cut off by a time limit
            json.dump(report, handle, indent=1)
        print(f"{name}: " + ", ".join(f"{variant} {result['median_s'][variant] * 1e3:.3f} ms "
                                      f"({result['of_copy_bandwidth'][variant]:.2f} of copy)" for variant in VARIANTS)
              + f"; triton/bitsandbytes {result['triton_over_bitsandbytes']:.3f} (spread "
                f"{result['ratio_spread_p10_p90']:.1%} over {result['rounds']} rounds), triton/fused AdamW "
                f"{result['triton_over_fused_adamw']:.3f}; codes differing {result['agreement']['codes_differing']} "
                f"of {result['agreement']['codes']}", flush=True)
    report["interpreted"] = interpreting()
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    for line in report["skipped"]:
        print(f"skipped {line}")
    return 0 if report["sizes"] else 1


if __name__ == "__main__":
    sys.exit(main())
