"""An offloaded training step: zero_bnb + Adam8bit against stock ZeRO-Offload + DeepSpeedCPUAdam.

Reproduce (from the repository root, after ``bash scripts/setup.sh``; DeepSpeedCPUAdam is JIT-built first,
about 30 s once, cached in ``~/.cache/torch_extensions``):

    python benchmarks/offload_bench.py                       # cpu-small GPT, DP=1, ZeRO-2, fp32, a few minutes
    python benchmarks/offload_bench.py --model gpt-125m --dp 2 --rounds 3
    python benchmarks/offload_bench.py --threads 1 4 8     # other thread counts per rank

Variants, same model, data, DP size, precision and ZeRO-2 with ``offload_optimizer: {"device": "cpu"}``,
interleaved round by round in rotating order:

1. ``stock-cpuadam``: ``deepspeed.initialize`` + ``DeepSpeedCPUAdam`` (what stock ZeRO-Offload uses, and what
   Accelerate and Trainer silently swap an 8-bit optimizer for);
2. ``stock-adam8bit``: ``deepspeed.initialize`` + ``bnb.optim.Adam8bit`` with ``zero_force_ds_cpu_optimizer: false``
   (runs, but resumes only at the DP size that saved);
3. ``zero_bnb``: ``zero_bnb.initialize`` + ``bnb.optim.Adam8bit`` (elastic checkpoints).

Per variant: step time (median, p10-p90 of the timed steps after warm-up), the base optimizer's
``step()`` alone (wall clock, and the process's CPU time, which a loaded machine inflates less), and the optimizer's CPU memory per rank counted tensor by tensor: the optimizer
state, and everything offload keeps on the CPU (fp32 master partition and its gradient, DeepSpeed's
16-bit staging buffer), in bytes per trained parameter. On a CPU-only machine "offload" still runs
DeepSpeed's offload code (separate fp32 partitions, gradient copies into them, the step on the CPU);
with a GPU the model trains on the GPU and the gradients and weights cross PCIe.

Threads: every variant is measured at 1 thread per rank (what ``torchrun`` and ``accelerate launch`` give each of
several processes on a node: ``OMP_NUM_THREADS=1``) and at the cores a launcher that binds cores gives each rank
(``nproc // ranks per node``, as the ``deepspeed`` launcher's ``--bind_cores_to_rank`` does), set in each rank with
``torch.set_num_threads`` (which DeepSpeedCPUAdam's OpenMP loops and zero_bnb's kernel both follow). The results
record the CPU's model, its instruction-set flags (``/proc/cpuinfo``) and which path of zero_bnb's kernel ran.

Writes ``benchmarks/results/offload-<model>-dp<N>.json`` and ``.md``: ``rows``/``ratios`` at the first thread count
(1 by default), ``by_threads`` at every one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, PRESETS
from report import cores_per_rank, cpu_features, kernel_path, versions
from train_bench import _device, _state_bytes, _train

VARIANTS = ("stock-cpuadam", "stock-adam8bit", "zero_bnb")
LR = 1e-4


def _config(args, world: int, variant: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.micro_batch * world,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    if variant == "stock-adam8bit":
        config["zero_force_ds_cpu_optimizer"] = False  # else DeepSpeed refuses the client optimizer
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _build(variant: str, args, world: int):
    import bitsandbytes as bnb
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    import zero_bnb

    torch.manual_seed(0)
    model = GPT(PRESETS[args.model]).to(_device())
    if variant == "stock-cpuadam":
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.0, adamw_mode=False)
    else:
        optimizer = bnb.optim.Adam8bit(model.parameters(), lr=LR)
    initialize = zero_bnb.initialize if variant == "zero_bnb" else deepspeed.initialize
    engine, *_ = initialize(model=model, optimizer=optimizer, config=_config(args, world, variant))
    if not engine.optimizer.cpu_offload:
        raise RuntimeError(f"{variant}: the optimizer is not offloaded")
    return engine


def _offload_bytes(engine) -> dict[str, int]:
    """CPU bytes held for the optimizer on this rank: its state, and the fp32 partition, gradient and staging buffer."""
    wrapper = engine.optimizer
    masters = wrapper.single_partition_of_fp32_groups
    partition = sum(t.nbytes for t in masters) + sum(t.grad.nbytes for t in masters if t.grad is not None)
    staging = sum(t.nbytes for t in wrapper.param_buffer_of_bit16_for_cpu_offload_groups)
    return {"state": _state_bytes(engine), "partition": partition + staging,
            "partition_numel": sum(t.numel() for t in masters)}


def _cpu_timed(engine, times: list[float]):
    """Record the CPU time of each base ``optimizer.step()`` into ``times``; returns the undo."""
    import time

    base = engine.optimizer.optimizer
    original = base.step

    def step(*a, **k):
        start = time.process_time()
        result = original(*a, **k)
        times.append(time.process_time() - start)
        return result

    base.step = step
    return lambda: setattr(base, "step", original)


def measure(rank, world, args, result_path):
    """One launch: for each of ``args.threads`` (threads per rank), the three variants interleaved over
    ``args.rounds`` rounds."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    by_threads = {}
    for count in args.threads:
        torch.set_num_threads(count)
        by_threads[str(count)] = _measure_threads(rank, world, args)
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(by_threads, handle)


def _measure_threads(rank, world, args) -> dict:
    """The three variants at this process's thread count, interleaved over ``args.rounds`` rounds."""
    import gc

    results = {v: {"step_s": [], "optimizer_step_s": [], "optimizer_cpu_s": []} for v in VARIANTS}
    for round_index in range(args.rounds):
        for variant in VARIANTS[round_index % 3:] + VARIANTS[: round_index % 3]:
            gc.collect()
            engine = _build(variant, args, world)
            _train(engine, args, rank, 0, args.warmup, None)
            record = results[variant]
            undo = _cpu_timed(engine, record["optimizer_cpu_s"])
            try:
                record["step_s"] += _train(engine, args, rank, args.warmup, args.steps, record["optimizer_step_s"])
            finally:
                undo()
            record.update(_offload_bytes(engine), optimizer=type(engine.optimizer.optimizer).__name__,
                          threads=torch.get_num_threads())
            engine.destroy()  # del alone does not free a DeepSpeed engine: later variants would share its memory
            del engine
    return results


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(raw: dict, args) -> tuple[dict, str]:
    rows = {}
    for variant in VARIANTS:
        record = raw[variant]
        numel = record["partition_numel"]
        rows[variant] = {
            "optimizer": record["optimizer"],
            "step_ms_median": 1e3 * statistics.median(record["step_s"]),
            "step_ms_p10_p90": [1e3 * _quantile(record["step_s"], 0.1), 1e3 * _quantile(record["step_s"], 0.9)],
            "optimizer_step_ms_median": 1e3 * statistics.median(record["optimizer_step_s"]),
            "optimizer_step_ns_per_param": 1e9 * statistics.median(record["optimizer_step_s"]) / numel,
            "optimizer_cpu_ms_median": 1e3 * statistics.median(record["optimizer_cpu_s"]),
            "optimizer_cpu_ns_per_param": 1e9 * statistics.median(record["optimizer_cpu_s"]) / numel,
            "state_bytes_per_param": record["state"] / numel,
            "offload_bytes_per_param": (record["state"] + record["partition"]) / numel,
            "partition_numel": numel,
        }
    base = rows["stock-cpuadam"]
    ratios = {variant: {"step": rows[variant]["step_ms_median"] / base["step_ms_median"],
                        "optimizer_step": rows[variant]["optimizer_step_ms_median"] / base["optimizer_step_ms_median"],
                        "optimizer_cpu": rows[variant]["optimizer_cpu_ms_median"] / base["optimizer_cpu_ms_median"],
                        "offload_bytes": rows[variant]["offload_bytes_per_param"] / base["offload_bytes_per_param"]}
              for variant in VARIANTS}
    lines = [f"**{args.model}**, DP={args.dp}, ZeRO-2, optimizer offloaded to the CPU, {args.precision}, "
             f"{args.rounds} rounds x {args.steps} timed steps (micro batch {args.micro_batch}), "
             f"{raw[VARIANTS[0]]['threads']} thread(s) per rank", "",
             "| figure | " + " | ".join(VARIANTS) + " |", "| --- |" + " --- |" * len(VARIANTS)]
    figures = (("optimizer", "base optimizer", "{}"), ("step_ms_median", "step time (median)", "{:.1f} ms"),
               ("optimizer_step_ms_median", "optimizer step alone", "{:.1f} ms"),
               ("optimizer_step_ns_per_param", "optimizer step per parameter", "{:.2f} ns"),
               ("optimizer_cpu_ms_median", "optimizer step alone, CPU time", "{:.1f} ms"),
               ("optimizer_cpu_ns_per_param", "optimizer step per parameter, CPU time", "{:.2f} ns"),
               ("state_bytes_per_param", "optimizer state, bytes/param", "{:.2f}"),
               ("offload_bytes_per_param", "CPU bytes/param held for the optimizer", "{:.2f}"))
    for key, label, fmt in figures:
        lines.append(f"| {label} | " + " | ".join(fmt.format(rows[v][key]) for v in VARIANTS) + " |")
    lines.append("| step time p10-p90 | " + " | ".join(
        "{:.1f} - {:.1f} ms".format(*rows[v]["step_ms_p10_p90"]) for v in VARIANTS) + " |")
    lines.append("| step time / stock-cpuadam | " + " | ".join(f"{ratios[v]['step']:.2f}x" for v in VARIANTS) + " |")
    lines.append("| optimizer step CPU time / stock-cpuadam | " + " | ".join(
        f"{ratios[v]['optimizer_cpu']:.2f}x" for v in VARIANTS) + " |")
    lines.append("| CPU bytes / stock-cpuadam | " + " | ".join(
        f"{ratios[v]['offload_bytes']:.2f}x" for v in VARIANTS) + " |")
    return {"rows": rows, "ratios": ratios}, "\n".join(lines) + "\n"


def _revision() -> str | None:
    """The git commit measured (with ``+dirty`` for uncommitted changes), when run from a checkout."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cpu-small", choices=sorted(PRESETS))
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant per round")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, nargs="+",
                        help="threads per rank (default: 1 and nproc // --ranks-per-node)")
    parser.add_argument("--ranks-per-node", type=int,
                        help="ranks a launcher would start on this machine (default: --dp, all ranks here)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        parser.error(f"--ranks-per-node must be at least 1, got {args.ranks_per_node}")
    if args.threads and min(args.threads) < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    launcher_threads = cores_per_rank(args.ranks_per_node or args.dp)
    args.threads = args.threads or sorted({1, launcher_threads})

    from deepspeed.ops.op_builder import CPUAdamBuilder

    from zero_bnb.testing.launch import run_distributed

    CPUAdamBuilder().load()  # JIT-build DeepSpeedCPUAdam once, outside the timed launch
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="zero_bnb_offload_bench_") as workdir:
        result_path = os.path.join(workdir, "measure.json")
        # The model on the GPUs where there is one per rank (nccl); else CPU ranks (gloo) that see no GPU.
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= args.dp else "cpu"
        run_distributed(measure, args.dp, args, result_path, device=device)
        with open(result_path) as handle:
            raw = json.load(handle)
    by_threads = {count: summarise(raw[count], args) for count in raw}
    summary, markdown = by_threads[str(args.threads[0])]
    for count in list(raw)[1:]:
        markdown += "\n" + by_threads[count][1]
    cpu, kernel = cpu_features(), kernel_path()
    report = {
        "benchmark": "offloaded training step: zero_bnb + Adam8bit vs stock ZeRO-Offload + DeepSpeedCPUAdam",
        "revision": _revision(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu": cpu["model"], "cpu_flags": cpu["flags"], "cpus": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "kernel": kernel,
        "launcher_threads_per_rank": launcher_threads,
        "versions": versions(),
        "settings": vars(args) | {"out": None},
        "raw": raw,
        **summary,
        "by_threads": {count: value[0] for count, value in by_threads.items()},
    }
    markdown += (f"\nCPU: {cpu['model']}, {os.cpu_count()} logical CPUs, flags {' '.join(cpu['flags']) or '-'}; "
                 f"zero_bnb's kernel built for -march={kernel['march']}, quantizer path "
                 f"{kernel['quantizer'] or 'none: ' + kernel.get('error', '')}; a launcher binding cores would give "
                 f"each of {args.ranks_per_node or args.dp} rank(s) here {launcher_threads} thread(s).\n")
    markdown += (f"\nLoad average (1, 5, 15 min) at start {', '.join(f'{x:.1f}' for x in load_start)}, at end "
                 f"{', '.join(f'{x:.1f}' for x in report['load_average_at_end'])}.\n")
    stem = os.path.join(args.out, f"offload-{args.model}-dp{args.dp}")
    with open(stem + ".json", "w") as handle:
        json.dump(report, handle, indent=1)
    with open(stem + ".md", "w") as handle:
        handle.write(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
