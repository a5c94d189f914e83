"""Save and load time of zero_bnb checkpoints, and the cost of digest verification (BLAKE3, or SHA-256) on load.

Reproduce (CPU, from the repository root, after `bash scripts/setup.sh`):

    python benchmarks/checkpoint_verify.py --params 100e6 --dp 1 2 --repeats 5
    python benchmarks/checkpoint_verify.py --params 16e6 --dp 1 2 --precision fp32 bf16 --repeats 5 \
        --compare-ref bdc7123 --rounds 3 --name derived_masters

The second form compares the saver and loader of this working tree with those of git revision
``--compare-ref`` (extracted with ``git archive`` into a temporary folder): each round runs
both, in alternating order, as separate processes with ``PYTHONPATH`` pointing at their code;
each saves and loads its own checkpoint (formats may differ). Writes
``benchmarks/results/<--name>.json`` (default ``safe_loader``).

For each DP size and precision: trains one step of a ``--params``-parameter MLP with
``bnb.optim.Adam8bit`` under zero_bnb (ZeRO-1, gloo), then ``--repeats`` times saves it under a
new tag and loads it with checksum verification on and off (save, load on, load off, save, ...)
so that drift hits every figure alike; the previous tag is removed between repeats, untimed.
Size, presence and format checks run in both load variants; only the digest pass differs. Each save and load is
timed in wall-clock seconds and in process CPU seconds summed over the ranks (``time.process_time``, barriers
excluded), which other jobs on a shared machine inflate far less.
Writes ``benchmarks/results/checkpoint_verify.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import machine, versions

WIDTH = 4096


def _model(params: float) -> torch.nn.Module:
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _measure(rank, world, params, precision, repeats, workdir, result_path):
    import bitsandbytes as bnb
    import torch.distributed as dist

    import zero_bnb
    from zero_bnb.format.digests import writing_algorithm
    from zero_bnb.format.durable import digest_file

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    model = _model(params)
    optimizer = bnb.optim.Adam8bit(model.parameters(), lr=1e-4)
    config = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "steps_per_print": 10**9, "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=config)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    loss = engine(torch.randn(2, WIDTH, dtype=dtype)).float().square().mean()
    engine.backward(loss)
    engine.step()
    saves, timings = [], {True: [], False: []}
    cpu = {"save": [], True: [], False: []}  # process CPU time, summed over the ranks (robust to other jobs' load)

    def cpu_of_ranks(seconds: float) -> float:
        parts: list = [None] * world
        dist.all_gather_object(parts, seconds)
        return sum(parts)

    for index in range(repeats):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.save_checkpoint(workdir, tag=f"bench{index}")
        used = time.process_time() - start_cpu
        dist.barrier()
        saves.append(time.perf_counter() - start)
        cpu["save"].append(cpu_of_ranks(used))
        if rank == 0 and index:
            shutil.rmtree(os.path.join(workdir, f"bench{index - 1}"))
        for verify in (True, False):
            engine.zero_bnb_config = dataclasses.replace(engine.zero_bnb_config, checkpoint_verify=verify)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            engine.load_checkpoint(workdir)
            used = time.process_time() - start_cpu
            dist.barrier()
            timings[verify].append(time.perf_counter() - start)
            cpu[verify].append(cpu_of_ranks(used))
    if rank == 0:
        folder = os.path.join(workdir, f"bench{repeats - 1}")
        files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
        total = sum(os.path.getsize(path) for path in files)
        start = time.perf_counter()
        for path in files:
            digest_file(path, writing_algorithm())
        hash_s = time.perf_counter() - start
        on, off = statistics.median(timings[True]), statistics.median(timings[False])
        result = {
            "dp": world,
            "precision": precision,
            "parameters": sum(p.numel() for p in model.parameters()),
            "checkpoint_bytes": total,
            "save_all_s": saves,
            "save_s": statistics.median(saves),
            "load_verified_s": timings[True],
            "load_unverified_s": timings[False],
            "median_verified_s": on,
            "median_unverified_s": off,
            "verify_overhead_ratio": on / off,
            "save_cpu_s": statistics.median(cpu["save"]),
            "median_verified_cpu_s": statistics.median(cpu[True]),
            "median_unverified_cpu_s": statistics.median(cpu[False]),
            "digest_algorithm": writing_algorithm(),
            "digest_one_process_s": hash_s,
            "digest_gb_per_s": total / hash_s / 1e9,
        }
        with open(result_path, "w") as handle:
            json.dump(result, handle)


_FIGURES = ("save_s", "median_verified_s", "median_unverified_s")
#: The same three as process CPU seconds, summed over the ranks (other jobs' load inflates wall time, not these).
_CPU_FIGURES = ("save_cpu_s", "median_verified_cpu_s", "median_unverified_cpu_s")


def _compare(args) -> int:
    """Run this benchmark for the working tree and for git revision ``args.compare_ref``, alternating."""
    from revisions import ROOT, alternating, extract_package

    scratch = tempfile.mkdtemp(prefix="zero_bnb_loader_compare_")
    base = f"baseline ({args.compare_ref})"
    loads = []
    try:
        baseline = extract_package(args.compare_ref, os.path.join(scratch, "baseline"))
        trees = {base: baseline, "this tree": ROOT}
        runs: dict[str, list[list[dict]]] = {name: [] for name in trees}
        for round_index in range(args.rounds):
            for name in alternating(list(trees), round_index):
                out = os.path.join(scratch, "run.json")
                print(f"round {round_index + 1}/{args.rounds}: {name}", flush=True)
                loads.append(os.getloadavg()[0])
                subprocess.run([sys.executable, os.path.abspath(__file__), "--params", str(args.params), "--dp",
                                *map(str, args.dp), "--precision", *args.precision, "--repeats", str(args.repeats),
                                "--out", out], check=True, env={**os.environ, "PYTHONPATH": trees[name]},
                               stdout=subprocess.DEVNULL)
                with open(out) as handle:
                    runs[name].append(json.load(handle)["results"])
        loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for index, cell in enumerate(runs[base][0]):
        row = {"dp": cell["dp"], "precision": cell["precision"]}
        for name, rounds in runs.items():
            row[name] = {key: statistics.median(r[index][key] for r in rounds)
                         for key in (*_FIGURES, *_CPU_FIGURES, "checkpoint_bytes")}
            row[name]["per_round"] = {key: [r[index][key] for r in rounds] for key in (*_FIGURES, *_CPU_FIGURES)}
            row[name]["parameters"] = rounds[0][index]["parameters"]
        for key in (*_FIGURES, *_CPU_FIGURES):
            row[f"ratio_{key}"] = row["this tree"][key] / row[base][key]
        rows.append(row)
    report = {"benchmark": f"checkpoint save and load: this tree vs {args.compare_ref} (median of {args.rounds} "
                           f"alternating rounds, each the median of {args.repeats} saves and {args.repeats} loads "
                           "with and without verification, interleaved)",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "load_average_1min_at_each_run": loads,
              "settings": {"params": args.params, "dp": args.dp, "precision": args.precision,
                           "repeats": args.repeats, "rounds": args.rounds, "zero_stage": 1,
                           "optimizer": "bnb.optim.Adam8bit", "zero_bnb_config": "defaults"},
              "results": rows}
    out = os.path.join(os.path.dirname(args.out), f"{args.name}.json")
    with open(out, "w") as handle:
        json.dump(report, handle, indent=1)
    print("| DP | precision | checkpoint MB (base / this) | save s (base / this) | ratio | load verified s | ratio | "
          "load unverified s | ratio | save CPU s | ratio | load verified CPU s | ratio | load unverified CPU s | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        b, t = row[base], row["this tree"]
        cells = [f"{b[key]:.2f} / {t[key]:.2f} | {row[f'ratio_{key}']:.2f}x" for key in (*_FIGURES, *_CPU_FIGURES)]
        print(f"| {row['dp']} | {row['precision']} | {b['checkpoint_bytes'] / 1e6:.0f} / {t['checkpoint_bytes'] / 1e6:.0f} | "
              + " | ".join(cells) + " |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6, help="model size in parameters (default 100e6)")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2], help="DP sizes to measure (default 1 2)")
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32"],
                        help="training precisions to measure (default fp32)")
    parser.add_argument("--repeats", type=int, default=5, help="saves and loads per variant (default 5)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "checkpoint_verify.json"))
    parser.add_argument("--compare-ref", help="git revision whose saver and loader to compare with (see the module docstring)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds with --compare-ref (default 3)")
    parser.add_argument("--name", default="safe_loader", help="results file stem with --compare-ref (default safe_loader)")
    args = parser.parse_args(argv)
    if args.compare_ref:
        return _compare(args)

    from zero_bnb.testing.launch import run_distributed

    rows = []
    for dp in args.dp:
        for precision in args.precision:
            workdir = tempfile.mkdtemp(prefix="zero_bnb_verify_bench_")
            try:
                result_path = os.path.join(workdir, "result.json")
                run_distributed(_measure, dp, args.params, precision, args.repeats, os.path.join(workdir, "ckpt"),
                                result_path)
                with open(result_path) as handle:
                    rows.append(json.load(handle))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "benchmark": "checkpoint save, and load with and without digest verification",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_1min": os.getloadavg()[0],
        "versions": versions(),
        "results": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print("| DP | precision | parameters | checkpoint MB | save s | load, verified s | load, unverified s | ratio | "
          "digest GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['dp']} | {row['precision']} | {row['parameters'] / 1e6:.1f}M | {row['checkpoint_bytes'] / 1e6:.0f} | "
              f"{row['save_s']:.2f} | {row['median_verified_s']:.2f} | {row['median_unverified_s']:.2f} | "
              f"{row['verify_overhead_ratio']:.2f}x | {row['digest_gb_per_s']:.2f} ({row['digest_algorithm']}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
