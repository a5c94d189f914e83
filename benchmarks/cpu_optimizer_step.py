"""The optimizer step alone on the CPU: zero_bnb's fused 8-bit kernel against DeepSpeedCPUAdam, torch's fused
AdamW and bitsandbytes' own CPU 8-bit path (issue 19, item 6).

Reproduce (CPU, from the repository root; DeepSpeedCPUAdam is JIT-built by DeepSpeed on first use):

    PYTHONPATH=. python benchmarks/cpu_optimizer_step.py                  # 1M..256M parameters, 1 and 2 threads
    PYTHONPATH=. python benchmarks/cpu_optimizer_step.py --sizes 1 16 --threads 2 --repeats 3
    PYTHONPATH=. python benchmarks/cpu_optimizer_step.py --march x86-64-v3   # as on an AVX2-only machine
    PYTHONPATH=. python benchmarks/cpu_optimizer_step.py --ranks-per-node 8   # 1 thread and nproc // 8 threads

Every variant steps AdamW (lr 1e-3, weight decay 0.01) on one flat fp32 parameter of ``--sizes`` million
elements and its gradient (shared by all variants, as a ZeRO partition is): zero_bnb's fused kernel
(``bnb.optim.AdamW8bit`` with ``zero_cpu_update`` "fused"), ``deepspeed.ops.adam.DeepSpeedCPUAdam``
(fp32 moments), ``torch.optim.AdamW(fused=True)`` (fp32 moments) and ``bnb.optim.AdamW8bit`` on bitsandbytes'
CPU path (only up to ``--bnb-max-size`` million: it is slow). Rounds alternate the variants' order, so drift
and other load hit all alike; the median step is reported in ns/param (wall clock, and process CPU time over all threads:
steadier on a shared machine) and in GB/s of the bytes the step must
move (8-bit: 16 B/param, fp32 Adam: 28 B/param) against this machine's copy bandwidth (measured here at each
thread count). ``--march`` builds both zero_bnb's kernel and DeepSpeedCPUAdam for another x86-64 level than
this machine's (DeepSpeed's JIT build in a folder of its own). Threads: 1 (what ``torchrun`` gives each of several
processes on a node: ``OMP_NUM_THREADS=1``) and the cores a launcher that binds cores would give each of
``--ranks-per-node`` ranks (``nproc // ranks``), unless ``--threads`` names others. The results record the CPU's
model, its instruction-set flags (``/proc/cpuinfo``) and which path of zero_bnb's kernel ran. Memory: the optimizer's steady bytes per parameter (fp32 master + state) and the peak resident
growth during one step (Linux ``VmHWM`` reset through ``/proc/self/clear_refs``). Last, one step of
bitsandbytes' CPU path from the same inputs as the reference of bitsandbytes' CUDA kernel
(``zero_bnb.kernels.reference``): how many codes differ and how far the parameters are.

Writes ``benchmarks/results/cpu_optimizer_step.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cores_per_rank, cpu_features, kernel_path

from zero_bnb.kernels.build import MARCH_ENV
from zero_bnb.kernels.update import install_fused_update
from zero_bnb.kernels.hyper import UpdateHyper, step_scalars
from zero_bnb.kernels.reference import reference_update

LR, WEIGHT_DECAY = 1e-3, 0.01
BYTES = {"zero_bnb fused 8-bit": 16, "DeepSpeedCPUAdam": 28, "torch fused AdamW": 28, "bitsandbytes CPU 8-bit": 16}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: DeepSpeed's SIMD macro (``op_builder`` ``simd_width()``, which reads the CPU's flags) for each ``--march``.
DEEPSPEED_SIMD = {"x86-64-v2": "-D__SCALAR__", "x86-64-v3": "-D__AVX256__", "x86-64-v4": "-D__AVX512__"}


def build_for(march: str) -> None:
    """Make zero_bnb's kernel and DeepSpeedCPUAdam build for ``-march=march`` in this process. DeepSpeed takes
    ``-march=native`` and its SIMD width from the CPU, so its builder is patched; its JIT build goes to a folder
    of its own, leaving the default build alone."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    os.environ[MARCH_ENV] = march
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.expanduser(f"~/.cache/zero_bnb/torch_extensions-{march}")
    CPUAdamBuilder.cpu_arch = lambda self: f"-march={march}"
    CPUAdamBuilder.simd_width = lambda self: DEEPSPEED_SIMD[march]


def make_variant(name: str, param: torch.nn.Parameter) -> torch.optim.Optimizer:
    if name == "zero_bnb fused 8-bit":
        optimizer = bnb.optim.AdamW8bit([param], lr=LR, weight_decay=WEIGHT_DECAY)
        install_fused_update(optimizer, "fused")
        return optimizer
    if name == "bitsandbytes CPU 8-bit":
        return bnb.optim.AdamW8bit([param], lr=LR, weight_decay=WEIGHT_DECAY)
    if name == "DeepSpeedCPUAdam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam([param], lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    return torch.optim.AdamW([param], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor) and value.numel() > 1)


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as handle:
        line = next(line for line in handle if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def transient_bytes(optimizer: torch.optim.Optimizer) -> int | None:
    """Peak resident growth during one step (``None`` where the kernel cannot reset the peak)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as handle:
            handle.write("5")
    except OSError:
        return None
    before = _status("VmRSS")
    optimizer.step()
    return max(0, _status("VmHWM") - before)


def copy_bandwidth(threads: int, numel: int = 64 * 2**20, repeats: int = 5) -> float:
    """GB/s of ``dst.copy_(src)`` (read + write counted) at ``threads`` threads."""
    torch.set_num_threads(threads)
    src, dst = torch.ones(numel), torch.empty(numel)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * numel * 4 / best / 1e9


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _timed_both(function) -> tuple[float, float]:
    """Wall-clock and process CPU seconds (all threads) of one call: CPU time is not inflated by waiting for a
    core that other processes hold, so on a shared machine it is the steadier measure of the work done."""
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_size(millions: int, threads: list[int], repeats: int, bnb_max: int) -> list[dict]:
    numel = millions * 2**20
    param = torch.nn.Parameter(torch.randn(numel) * 0.02)
    param.grad = torch.randn(numel) * 1e-3
    names = [name for name in BYTES if name != "bitsandbytes CPU 8-bit" or millions <= bnb_max]
    variants = {name: make_variant(name, param) for name in names}
    rows = []
    for count in threads:
        torch.set_num_threads(count)
        for optimizer in variants.values():
            optimizer.step()  # state creation and warm-up
        times = {name: [] for name in names}
        cpu_times = {name: [] for name in names}
        for round_index in range(repeats):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                wall, cpu = _timed_both(variants[name].step)
                times[name].append(wall)
                cpu_times[name].append(cpu)
        bandwidth = copy_bandwidth(count)
        for name in names:
            seconds = statistics.median(times[name])
            rows.append({"variant": name, "millions": millions, "threads": count, "ns_per_param": seconds / numel * 1e9,
                         "cpu_ns_per_param": statistics.median(cpu_times[name]) / numel * 1e9,
                         "gb_per_s": BYTES[name] * numel / seconds / 1e9, "copy_gb_per_s": bandwidth,
                         "bandwidth_fraction": BYTES[name] * numel / seconds / 1e9 / bandwidth,
                         "samples_s": times[name], "cpu_samples_s": cpu_times[name]})
    for name, optimizer in variants.items():
        steady = (numel * 4 + state_bytes(optimizer)) / numel
        transient = transient_bytes(optimizer)
        for row in rows:
            if row["variant"] == name:
                row["steady_bytes_per_param"] = steady
                row["transient_bytes_per_param"] = None if transient is None else transient / numel
    return rows


def distance_from_reference(millions: int = 4, warmup: int = 10) -> dict:
    """One AdamW8bit step by bitsandbytes' CPU path and by the CUDA reference, from the same inputs."""
    numel = millions * 2**20
    gen = torch.Generator().manual_seed(0)
    hyper = UpdateHyper(name="adam", lr=LR, weight_decay=WEIGHT_DECAY)
    qmap1, qmap2 = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)
    p = torch.randn(numel, generator=gen) * 0.02
    state = {"state1": torch.full((numel,), 127, dtype=torch.uint8), "absmax1": torch.zeros(numel // 256),
             "state2": torch.zeros(numel, dtype=torch.uint8), "absmax2": torch.zeros(numel // 256)}
    for step in range(1, warmup + 1):  # a realistic state: the reference's own trajectory
        reference_update(hyper, step_scalars(hyper, step), p, torch.randn(numel, generator=gen) * 1e-3,
                         state["state1"], state["absmax1"], qmap1, state["state2"], state["absmax2"], qmap2)
    grad = torch.randn(numel, generator=gen) * 1e-3
    ours = {key: value.clone() for key, value in state.items()} | {"p": p.clone()}
    theirs = {key: value.clone() for key, value in state.items()} | {"p": p.clone()}
    step = warmup + 1
    reference_update(hyper, step_scalars(hyper, step), ours["p"], grad, ours["state1"], ours["absmax1"], qmap1,
                     ours["state2"], ours["absmax2"], qmap2)
    F.optimizer_update_8bit_blockwise("adam", grad, theirs["p"], theirs["state1"], theirs["state2"], 0.9, 0.999, 0.0,
                                      0.0, 1e-8, step, LR, qmap1, qmap2, theirs["absmax1"], theirs["absmax2"],
                                      WEIGHT_DECAY)
    update = (ours["p"] - p).abs()
    error = (theirs["p"] - ours["p"]).abs()
    return {
        "millions": millions, "steps_before": warmup,
        "state1_codes_differ": (ours["state1"] != theirs["state1"]).double().mean().item(),
        "state2_codes_differ": (ours["state2"] != theirs["state2"]).double().mean().item(),
        "absmax1_max_rel_diff": ((ours["absmax1"] - theirs["absmax1"]).abs() / ours["absmax1"].clamp_min(1e-30)).max().item(),
        "param_max_abs_error": error.max().item(),
        "param_error_over_mean_update": (error.mean() / update.mean()).item(),
    }


def quantizer_distance(numel: int = 2**20) -> dict:
    """bitsandbytes' CPU quantizer (its 65 536-bin lookup table) against quantize_2D's binary search, on
    normalized values spread evenly in log scale over [1e-6, 1] (each block's absmax is 1)."""
    from zero_bnb.kernels.reference import quantize_codes

    gen = torch.Generator().manual_seed(0)
    x = 10.0 ** (-6 * torch.rand(numel, generator=gen)) * torch.where(torch.rand(numel, generator=gen) < 0.5, -1, 1)
    x.view(-1, 256)[:, 0] = 1.0
    out = {}
    for label, signed in (("signed", True), ("unsigned", False)):
        values = x if signed else x.abs()
        qmap = F.create_dynamic_map(signed=signed)
        theirs, _ = torch.ops.bitsandbytes.quantize_blockwise(values, qmap, 256)
        ours = quantize_codes(values, qmap, signed)
        differ = theirs.long() != ours
        small = values.abs() < 1e-2
        out[label] = {"codes_differ": differ.double().mean().item(),
                      "codes_differ_below_1e-2": differ[small].double().mean().item()}
    return out


def machine(deepspeed_march: str) -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    import deepspeed

    return {"cpu": model, "cores": os.cpu_count(), "memory_gb": round(os.sysconf("SC_PAGE_SIZE")
            * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "load_average_at_start": os.getloadavg(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "bitsandbytes": bnb.__version__,
            "zero_bnb_march": os.environ.get(MARCH_ENV) or "native", "deepspeed_march": deepspeed_march,
            "cpu_flags": cpu_features()["flags"], "kernel": kernel_path(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def markdown(result: dict) -> str:
    info = result["machine"]
    lines = [f"CPU optimizer step alone (AdamW), {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
             f"deepspeed {info['deepspeed']}, bitsandbytes {info['bitsandbytes']}, {info['date']} (load average at "
             f"start {', '.join(f'{x:.1f}' for x in info['load_average_at_start'])}); built for -march="
             f"{info['zero_bnb_march']} (zero_bnb), -march={info['deepspeed_march']} (DeepSpeedCPUAdam); CPU flags: "
             f"{' '.join(info.get('cpu_flags', [])) or '-'}; zero_bnb's quantizer path: "
             f"{info.get('kernel', {}).get('quantizer') or '-'}.", "",
             "| params | threads | variant | ns/param | GB/s | of copy bandwidth | vs DeepSpeedCPUAdam | "
             "CPU ns/param (all threads) | CPU time vs DeepSpeedCPUAdam | memory B/param (steady / step peak) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        ds = next((r for r in result["rows"] if r["variant"] == "DeepSpeedCPUAdam" and r["millions"] == row["millions"]
                   and r["threads"] == row["threads"]), None)
        ratio = f"{row['ns_per_param'] / ds['ns_per_param']:.2f}x" if ds else "-"
        cpu_ratio = f"{row['cpu_ns_per_param'] / ds['cpu_ns_per_param']:.2f}x" if ds else "-"
        peak = row.get("transient_bytes_per_param")
        memory = f"{row['steady_bytes_per_param']:.2f} / " + ("-" if peak is None else
                                                            f"{row['steady_bytes_per_param'] + peak:.2f}")
        lines.append(f"| {row['millions']}M | {row['threads']} | {row['variant']} | {row['ns_per_param']:.2f} | "
                     f"{row['gb_per_s']:.1f} | {row['bandwidth_fraction']:.0%} | {ratio} | "
                     f"{row['cpu_ns_per_param']:.2f} | {cpu_ratio} | {memory} |")
    d = result["distance"]
    lines += ["", f"bitsandbytes' CPU path against the CUDA reference, one AdamW8bit step ({d['millions']}M params, "
              f"after {d['steps_before']} reference steps): {d['state1_codes_differ']:.1%} of state1 codes and "
              f"{d['state2_codes_differ']:.1%} of state2 codes differ; parameter error max {d['param_max_abs_error']:.2e}, "
              f"mean {d['param_error_over_mean_update']:.1%} of the mean update."]
    for label, q in result["quantizer"].items():
        lines.append(f"bitsandbytes' CPU quantizer, {label} map, normalized values log-uniform in [1e-6, 1]: "
                     f"{q['codes_differ']:.1%} of codes differ from the binary search's "
                     f"({q['codes_differ_below_1e-2']:.1%} of those below 1e-2).")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="millions of parameters")
    parser.add_argument("--threads", type=int, nargs="+",
                        help="thread counts (default: 1 and nproc // --ranks-per-node)")
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="processes a launcher would start on this machine (default 1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bnb-max-size", type=int, default=16, help="largest size for bitsandbytes' slow CPU path")
    parser.add_argument("--output", default=os.path.join(RESULTS, "cpu_optimizer_step"))
    parser.add_argument("--march", choices=sorted(DEEPSPEED_SIMD),
                        help="build zero_bnb's kernel and DeepSpeedCPUAdam for this x86-64 level (default: native, "
                             "or $ZERO_BNB_KERNEL_MARCH for zero_bnb's alone)")
    args = parser.parse_args()
    if args.ranks_per_node < 1:
        parser.error(f"--ranks-per-node must be at least 1, got {args.ranks_per_node}")
    if args.threads and min(args.threads) < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    threads = args.threads or sorted({1, cores_per_rank(args.ranks_per_node)})
    if args.march:
        build_for(args.march)
    result = {"machine": machine(args.march or "native"), "ranks_per_node": args.ranks_per_node, "rows": [],
              "distance": distance_from_reference(),
              "quantizer": quantizer_distance()}
    for millions in args.sizes:
        result["rows"] += bench_size(millions, threads, args.repeats, args.bnb_max_size)
        print(f"{millions}M done", flush=True)
    with open(args.output + ".json", "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    text = markdown(result)
    with open(args.output + ".md", "w", encoding="utf-8") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
