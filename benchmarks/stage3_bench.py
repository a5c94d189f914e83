"""ZeRO stage 3 with 8-bit state: zero_bnb stage 2 vs zero_bnb stage 3 vs stock DeepSpeed stage 3, side by side.

Reproduce (CPU, from the repository root, after ``bash scripts/setup.sh``; about 15 minutes on 2 busy cores):

    python benchmarks/stage3_bench.py --rounds 4 --steps 4

Variants, same model (``--model``, a preset of ``benchmarks/models.py``), data, DP size (2) and precision,
interleaved round by round in rotating order so that drift hits all alike:

1. ``zero_bnb-stage2``: ``zero_bnb.initialize`` + ``bnb.optim.Adam8bit``, ZeRO stage 2;
2. ``zero_bnb-stage3``: ``zero_bnb.initialize`` + ``bnb.optim.Adam8bit``, ZeRO stage 3;
3. ``stock-stage3-adam8bit``: ``deepspeed.initialize`` + ``bnb.optim.Adam8bit``, ZeRO stage 3 (resumes at the
   DP size it was saved at only);
4. ``stock-stage3-adamw``: ``deepspeed.initialize`` + ``torch.optim.AdamW``, ZeRO stage 3 (fp32 state; the stock
   way to resume at another DP size: ``ds_to_universal``, then ``checkpoint.load_universal``).

Per variant, at DP=2: step time (median and p10-p90 of the timed steps after warm-up, every round); the bytes
each rank holds after a step, counted tensor by tensor (storages counted once): module parameters (stage 3:
the rank's partitions and whatever DeepSpeed keeps gathered), fp32 master partitions (in fp32 at stage 3 DeepSpeed
steps the parameters' partitions themselves, so none beyond them), optimizer state, and the rest the ZeRO
optimizer holds (gradient partitions, buckets); the peak RSS growth of a rank in a launch of its
own; checkpoint bytes per parameter and save time. Then at DP=3: the time from the DP=2 checkpoint to a
trained-on engine's loaded state, zero_bnb loading directly and stock AdamW through ``ds_to_universal`` (timed
once, in this process) + ``load_universal``.

Writes ``benchmarks/results/stage3-<model>.json`` (machine, versions, settings, load average) and ``.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, PRESETS
from report import cell, machine, percentile, versions, write_json_and_markdown
from train_bench import LR, _train, convert_to_universal, peak_memory, timed_load, timed_save

__all__ = ["VARIANTS", "main"]


@dataclass(frozen=True)
class Variant:
    """How one variant builds its engine."""

    zero_bnb: bool
    stage: int
    optimizer: str  # "adam8bit" or "adamw"


VARIANTS = {
    "zero_bnb-stage2": Variant(True, 2, "adam8bit"),
    "zero_bnb-stage3": Variant(True, 3, "adam8bit"),
    "stock-stage3-adam8bit": Variant(False, 3, "adam8bit"),
    "stock-stage3-adamw": Variant(False, 3, "adamw"),
}
#: Variants resumed at the other DP size (stock Adam8bit cannot be).
RESUMED = ("zero_bnb-stage2", "zero_bnb-stage3", "stock-stage3-adamw")


def _config(args, variant: Variant, world: int, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "train_batch_size": args.micro_batch * world, "zero_optimization": {"stage": variant.stage},
              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True, **extra}
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _build(name: str, args, world: int, **extra):
    import bitsandbytes as bnb
    import deepspeed

    import zero_bnb

    variant = VARIANTS[name]
    torch.manual_seed(0)
    model = GPT(PRESETS[args.model])
    if variant.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        optimizer = bnb.optim.Adam8bit(model.parameters(), lr=LR)
    initialize = zero_bnb.initialize if variant.zero_bnb else deepspeed.initialize
    engine, *_ = initialize(model=model, optimizer=optimizer, config=_config(args, variant, world, **extra))
    return engine


def _tensors(value, depth: int = 0):
    """Tensors held by ``value`` (a tensor, or lists, tuples and dicts of them, three levels deep)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)


def held_bytes(engine) -> dict[str, int]:
    """Bytes this rank holds, by what for: each storage counted once, in the first category that reaches it."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(engine.module.parameters())
    base = engine.optimizer.optimizer
    masters = [p for group in base.param_groups for p in group["params"]]
    figures = {
        "parameters": count([p.data for p in params] + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]),
        "fp32_masters": count(masters),
        "optimizer_state": count(_tensors(list(base.state.values()))),
        "gradients_and_buffers": count([p.grad for p in params + masters if p.grad is not None]
                                       + list(_tensors(list(vars(engine.optimizer).values())))),
    }
    figures["total"] = sum(figures.values())
    return figures


def measure(rank, world, args, workdir, result_path):
    """One launch at DP=2: every variant, interleaved over ``args.rounds`` rounds; saves in the first round."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results = {name: {"step_s": []} for name in VARIANTS}
    names = list(VARIANTS)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            engine = _build(name, args, world)
            _train(engine, args, rank, 0, args.warmup, None)
            record = results[name]
            record["step_s"] += _train(engine, args, rank, args.warmup, args.steps, None)
            if round_index == 0:
                record["held_bytes"] = held_bytes(engine)
                record["parameters"] = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                           for p in engine.module.parameters())
                record["save_s"], record["checkpoint_bytes"] = timed_save(engine, os.path.join(workdir, name))
            engine.destroy()  # del alone does not free a DeepSpeed engine: later variants would share its memory
            del engine
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(results, handle)


def resume(rank, world, args, workdir, result_path):
    """A launch at the other DP size: each resumable variant loads the DP=2 checkpoint (stock AdamW its universal
    conversion) and trains one step, interleaved over ``args.rounds`` rounds."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    times: dict[str, list[float]] = {name: [] for name in RESUMED}
    for round_index in range(args.rounds):
        shift = round_index % len(RESUMED)
        for name in RESUMED[shift:] + RESUMED[:shift]:
            universal = not VARIANTS[name].zero_bnb
            extra = {"checkpoint": {"load_universal": True}} if universal else {}
            folder = os.path.join(workdir, "universal" if universal else name)
            times[name].append(timed_load(_build(name, args, world, **extra), folder, args, rank))
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(times, handle)


def summarise(raw: dict, args) -> dict:
    """Figures per variant, and ratios against stock stage 3 + Adam8bit and zero_bnb stage 2."""
    variants = {}
    for name in VARIANTS:
        record = raw[name]
        steps = record["step_s"]
        variants[name] = {
            "step_s": statistics.median(steps), "step_s_p10": percentile(steps, 0.1),
            "step_s_p90": percentile(steps, 0.9), "steps_timed": len(steps),
            "held_bytes_per_rank": record["held_bytes"], "peak_rss_growth_bytes": raw["rss"][name],
            "parameters": record["parameters"], "checkpoint_bytes": record["checkpoint_bytes"],
            "checkpoint_bytes_per_param": record["checkpoint_bytes"] / record["parameters"],
            "save_s": record["save_s"],
        }
    resume_raw = raw["resume"]
    for name in RESUMED:
        load = statistics.median(resume_raw["load_s"][name])
        variants[name]["resume_load_s"] = load
        variants[name]["resume_s"] = load + (resume_raw["convert_s"] if not VARIANTS[name].zero_bnb else 0.0)
    variants["stock-stage3-adamw"]["resume_convert_s"] = resume_raw["convert_s"]
    variants["stock-stage3-adam8bit"]["resume_s"] = "not possible"
    ours, stock8, stockw = (variants[n] for n in ("zero_bnb-stage3", "stock-stage3-adam8bit", "stock-stage3-adamw"))
    ratios = {
        "step_s vs stock stage 3 + Adam8bit": ours["step_s"] / stock8["step_s"],
        "step_s vs zero_bnb stage 2": ours["step_s"] / variants["zero_bnb-stage2"]["step_s"],
        "held bytes per rank vs stock stage 3 + Adam8bit": (ours["held_bytes_per_rank"]["total"]
                                                            / stock8["held_bytes_per_rank"]["total"]),
        "held bytes per rank vs zero_bnb stage 2": (ours["held_bytes_per_rank"]["total"]
                                                    / variants["zero_bnb-stage2"]["held_bytes_per_rank"]["total"]),
        "checkpoint bytes vs stock stage 3 + AdamW": ours["checkpoint_bytes"] / stockw["checkpoint_bytes"],
        "resume at DP=3 vs stock universal + AdamW": ours["resume_s"] / stockw["resume_s"],
    }
    return {"model": args.model, "dp": args.dp, "resume_dp": args.resume_dp, "variants": variants, "ratios": ratios}


def markdown(report: dict) -> str:
    """The results as a markdown table (what the README quotes)."""
    row = report["result"]
    names = list(VARIANTS)
    machine = report["machine"]
    lines = [f"Stage-3 benchmark, {report['date']}, {machine['processor']} ({machine['cpus']} CPUs, load average "
             f"{report['load_average_1min'][0]:.1f} at start, {report['load_average_1min'][1]:.1f} at end); "
             + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".", "",
             f"**{row['model']}** ({row['variants']['zero_bnb-stage3']['parameters'] / 1e6:,.1f}M parameters, "
             f"{report['settings']['precision']}, DP={row['dp']}, resume at DP={row['resume_dp']})", "",
             "| figure | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    held = [("parameters", "module parameters per rank"), ("fp32_masters", "fp32 master partitions per rank (when not the parameters' own storage)"),
            ("optimizer_state", "optimizer state per rank"), ("gradients_and_buffers", "gradients + ZeRO buffers per rank"),
            ("total", "**held in all per rank**")]
    figures = [("step time (median)", lambda v: cell(v["step_s"], "ms")),
               ("step time p10-p90", lambda v: f"{cell(v['step_s_p10'], 'ms')} - {cell(v['step_s_p90'], 'ms')}")]
    figures += [(label, lambda v, k=key: cell(v["held_bytes_per_rank"][k], "B")) for key, label in held]
    figures += [("peak RSS growth of rank 0 (own launch)", lambda v: cell(v["peak_rss_growth_bytes"], "B")),
                ("checkpoint bytes / parameter", lambda v: cell(v["checkpoint_bytes_per_param"], "")),
                ("save", lambda v: cell(v["save_s"], "s")),
                (f"resume at DP={row['resume_dp']} (convert + load)", lambda v: cell(v.get("resume_s"), "s"))]
    for label, of in figures:
        lines.append(f"| {label} | " + " | ".join(of(row["variants"][n]) for n in names) + " |")
    lines += ["", "| ratio (zero_bnb stage 3 / other) | value |", "| --- | --- |"]
    lines += [f"| {label} | {value:.2f}x |" for label, value in row["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cpu-small", help="preset from benchmarks/models.py (default cpu-small)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    args.dp, args.resume_dp = 2, 3
    from zero_bnb.testing.launch import run_distributed

    load_start = os.getloadavg()[0]
    workdir = tempfile.mkdtemp(prefix="zero_bnb_stage3_bench_")
    try:
        result_path = os.path.join(workdir, "measure.json")
        run_distributed(measure, args.dp, args, workdir, result_path)
        with open(result_path) as handle:
            raw = json.load(handle)
        raw["rss"] = {}
        for name in VARIANTS:
            run_distributed(peak_memory, args.dp, args, name, result_path, _build)
            with open(result_path) as handle:
                raw["rss"][name] = json.load(handle)
        convert_s = convert_to_universal(workdir, "stock-stage3-adamw")
        run_distributed(resume, args.resume_dp, args, workdir, result_path)
        with open(result_path) as handle:
            raw["resume"] = {"convert_s": convert_s, "load_s": json.load(handle)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "benchmark": "ZeRO stage 3 with 8-bit state, four variants interleaved",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_1min": [load_start, os.getloadavg()[0]],
        "versions": versions(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "raw": raw,
        "result": summarise(raw, args),
    }
    stem = os.path.join(args.out, f"stage3-{args.model}" + ("" if args.precision == "fp32" else f"-{args.precision}"))
    text = markdown(report)
    write_json_and_markdown(report, text, stem)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
