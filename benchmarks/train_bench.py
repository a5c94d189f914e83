"""Training throughput, memory and checkpoint cost: stock DeepSpeed + AdamW, stock + Adam8bit, zero_bnb + Adam8bit.

Reproduce (from the repository root, after ``bash scripts/setup.sh``):

    python benchmarks/train_bench.py --mode cpu                     # quick: 2 ranks, gloo, fp32, a few minutes
    python benchmarks/train_bench.py --mode gpu --models gpt-125m gpt-350m gpt-1.3b   # 1 GPU, DP=1, bf16

Variants, same model, data, DP size and precision, interleaved round by round in rotating order
(1 2 3, 2 3 1, 3 1 2, ...) so that drift and position effects hit all alike:

1. ``stock-adamw``: ``deepspeed.initialize`` + ``torch.optim.AdamW`` (fused);
2. ``stock-adam8bit``: ``deepspeed.initialize`` + ``bnb.optim.Adam8bit`` (fixed DP size only);
3. ``zero_bnb``: ``zero_bnb.initialize`` + ``bnb.optim.Adam8bit``.

Per variant: step time (median, p10-p90 over timed steps after warm-up), samples/s, the base
optimizer's ``step()`` alone, memory per rank (GPU: peak allocated; CPU: RSS growth while the
engine lives), the peak allocated in each phase (construction, first step, steady steps, save, load; GPU: CUDA's
allocator; CPU: PyTorch's allocator events in a separate, untimed launch per variant), the load average beside
each round, optimizer-state bytes per rank, checkpoint bytes on disk (and per parameter), save
time (median of a save every round), load time at the same DP, and resume time at another DP size:
DeepSpeed's own path for variant 1 (``ds_to_universal`` + ``checkpoint.load_universal``), a direct
load for variant 3, "not possible" for variant 2. On GPU also the optimizer step's achieved memory bandwidth against the
device's copy bandwidth measured in the same run.

Writes ``benchmarks/results/<mode>.json`` (with machine, versions, date), ``<mode>.md`` and ``<mode>.png``
(``<mode>-<precision>.*`` when ``--precision`` is not the mode's default).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_save import save_stall
from models import GPT, PRESETS, batch
from report import machine, summarise, versions, write_reports

from zero_bnb.core.config import ZeroBnbConfig

VARIANTS = ("stock-adamw", "stock-adam8bit", "zero_bnb")
LR = 1e-4
#: Bytes read + written per parameter by one optimizer step (fp32 master, grad, states).
STEP_BYTES_PER_PARAM = {"stock-adamw": 4 * 2 + 4 + 4 * 2 * 2, "stock-adam8bit": 4 * 2 + 4 + 1 * 2 * 2,
                        "zero_bnb": 4 * 2 + 4 + 1 * 2 * 2}


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _ds_config(args, world: int, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.micro_batch * world,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        **extra,
    }
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _build(variant: str, args, world: int, **extra):
    import bitsandbytes as bnb
    import deepspeed

    import zero_bnb

    if _device().type == "cpu":
        # The CPU model's activations and gradients drift into fp32 denormals after ~14 steps, and on x86 each
        # denormal operand takes a microcode assist: a step of every variant (stock's too) grew from 0.2 s to 1.7 s
        # over 24 steps (2026-11-27, this project's 2-core Xeon), which the later rounds and the saves' baselines
        # then measured instead of the optimizers. GPUs compute denormals at full speed; flushing them here keeps
        # the CPU steps at 0.2 s throughout (measured the same way).
        torch.set_flush_denormal(True)
    torch.manual_seed(0)
    model = GPT(PRESETS[args.model]).to(_device())
    if variant == "stock-adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    else:
        optimizer = bnb.optim.Adam8bit(model.parameters(), lr=LR)
    initialize = zero_bnb.initialize if variant == "zero_bnb" else deepspeed.initialize
    if variant == "zero_bnb" and getattr(args, "zero_gpu_update", None):
        extra = {"zero_gpu_update": args.zero_gpu_update, **extra}
    engine, *_ = initialize(model=model, optimizer=optimizer, config=_ds_config(args, world, **extra))
    return engine


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _state_bytes(engine) -> int:
    return sum(v.nbytes for state in engine.optimizer.optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def _copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write) of a 1 GiB tensor copy."""
    source = torch.empty(2**28, dtype=torch.float32, device=_device())
    target = torch.empty_like(source)
    target.copy_(source)
    _sync()
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    _sync()
    return 2 * source.nbytes * 10 / (time.perf_counter() - start)


def _train(engine, args, rank: int, first: int, count: int, optimizer_times: list[float] | None) -> list[float]:
    import torch.distributed as dist

    base = engine.optimizer.optimizer
    original = base.step

    def timed_step(*a, **k):
        _sync()
        start = time.perf_counter()
        result = original(*a, **k)
        _sync()
        if optimizer_times is not None:
            optimizer_times.append(time.perf_counter() - start)
        return result

    base.step = timed_step
    config = PRESETS[args.model]
    times = []
    try:
        for step in range(first, first + count):
            tokens = batch(config, args.micro_batch, step, rank, engine.device)
            dist.barrier()
            _sync()
            start = time.perf_counter()
            engine.backward(engine(tokens))
            engine.step()
            _sync()
            times.append(time.perf_counter() - start)
    finally:
        base.step = original
    return times


def _fresh_peak() -> int:
    """Collect garbage, empty CUDA's cache and restart its peak count; the bytes still allocated (0 on the CPU)."""
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def measure(rank, world, args, workdir, result_path):
    """One launch: every variant, interleaved over ``args.rounds`` rounds."""
    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results = {v: {"step_s": [], "optimizer_step_s": [], "memory_bytes": [], "state_bytes": None} for v in VARIANTS}
    if rank == 0 and torch.cuda.is_available():
        results["copy_bandwidth_bytes_per_s"] = _copy_bandwidth()
    cuda = torch.cuda.is_available()
    for round_index in range(args.rounds):
        # Rotate the order every round, so that no variant always runs first or last.
        for variant in VARIANTS[round_index % 3:] + VARIANTS[: round_index % 3]:
            record = results[variant]
            record.setdefault("loadavg", []).append(os.getloadavg())  # shared machines: how busy, beside each figure
            phases = record.setdefault("memory_bytes_by_phase", {})
            baseline = _fresh_peak()
            engine = _build(variant, args, world)
            if cuda:
                phases.setdefault("construction", []).append(torch.cuda.max_memory_allocated() - baseline)
                _fresh_peak()
            _train(engine, args, rank, 0, 1, None)
            if cuda:
                phases.setdefault("first_step", []).append(torch.cuda.max_memory_allocated() - baseline)
                _fresh_peak()
            _train(engine, args, rank, 1, max(args.warmup - 1, 0), None)
            record["step_s"] += _train(engine, args, rank, args.warmup, args.steps, record["optimizer_step_s"])
            if cuda:
                steady = torch.cuda.max_memory_allocated() - baseline
                phases.setdefault("steady_steps", []).append(steady)
                record["memory_bytes"].append(max(steady, *(phases[k][-1] for k in ("construction", "first_step"))))
            record["state_bytes"] = _state_bytes(engine)
            record["parameters"] = sum(p.numel() for p in engine.module.parameters())
            folder = os.path.join(workdir, variant)
            if rank == 0:  # the last round's is kept for the resume launch: each round times a new save, no replace
                shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
            _fresh_peak()
            seconds, record["checkpoint_bytes"] = timed_save(engine, folder)
            # Every round (the median is reported): stock's save is the asynchronous rows' baseline, and the saves
            # of one round differed 2x between two runs (0.05 s and 0.11 s at 5.3M parameters).
            record.setdefault("save_s", []).append(seconds)
            if round_index == 0:
                if cuda:
                    phases.setdefault("save", []).append(torch.cuda.max_memory_allocated() - baseline)
                    before_load = torch.cuda.memory_allocated()
                    _fresh_peak()
                start = time.perf_counter()
                engine.load_checkpoint(folder, tag="bench")
                dist.barrier()
                record["load_s"] = time.perf_counter() - start
                if cuda:
                    phases.setdefault("load", []).append(torch.cuda.max_memory_allocated() - baseline)
                    record["kept_after_load_bytes"] = torch.cuda.memory_allocated() - before_load
            if not args.resume_dp:  # kept for the resume launch; else one variant's checkpoint on disk at a time
                shutil.rmtree(folder, ignore_errors=True)
            if variant == "zero_bnb":  # the same engine saving asynchronously while it trains on
                engine.zero_bnb_config = dataclasses.replace(engine.zero_bnb_config, checkpoint_async=True)
                steps = itertools.count(args.warmup + args.steps)
                folder = os.path.join(workdir, "async")
                step = lambda engine=engine: _train(engine, args, rank, next(steps), 1, None)[0]  # noqa: E731
                # Each save's baseline is the median of the steps right before it (steps may drift as a model
                # trains: see the denormals in _build). The first save allocates the staging buffers; the second
                # reuses them, as every later save of a run does.
                first = save_stall(engine, folder, f"round{round_index}-first", step,
                                   statistics.median(step() for _ in range(4)))
                row = save_stall(engine, folder, f"round{round_index}", step,
                                 statistics.median(step() for _ in range(4)))
                record.setdefault("async_save", []).append(
                    {**row, "first_blocking_s": first["blocking_s"], "first_stall_s": first["stall_s"]})
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(folder, ignore_errors=True)
            # del does not free a DeepSpeed engine (ZeRO's per-parameter hooks hold the optimizer): every later
            # reading would include it. destroy() does; what is still allocated afterwards is recorded.
            engine.destroy()
            del engine
            if cuda:
                _fresh_peak()
                record.setdefault("left_after_destroy_bytes", []).append(torch.cuda.memory_allocated() - baseline)
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(results, handle)


def timed_save(engine, folder: str) -> tuple[float, int]:
    """Save ``engine`` under tag ``bench`` of ``folder`` on every rank; returns the seconds (barrier to barrier) and
    the bytes of the tag folder. Collective."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(folder, tag="bench")
    dist.barrier()
    return time.perf_counter() - start, _folder_bytes(os.path.join(folder, "bench"))


def timed_load(engine, folder: str, args, rank: int) -> float:
    """Load the ``bench`` tag of ``folder`` into ``engine`` on every rank, train one step on (a load must leave an
    engine that trains), drop the engine; returns the load's seconds (barrier to barrier). Collective."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    engine.load_checkpoint(folder, tag="bench")
    dist.barrier()
    seconds = time.perf_counter() - start
    _train(engine, args, rank, 10**6, 1, None)
    engine.destroy()  # del alone does not free a DeepSpeed engine
    del engine
    gc.collect()
    return seconds


def peak_memory(rank, world, args, variant, result_path, build=None):
    """A launch for one variant (CPU): peak RSS growth over the process's state after imports and setup.
    ``build(variant, args, world)`` makes the engine (default: this benchmark's variants)."""
    import resource

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    baseline = _rss()
    engine = (build or _build)(variant, args, world)
    _train(engine, args, rank, 0, args.warmup + 1, None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(peak, handle)


def _reconciled(timeline) -> None:
    """After a barrier (no collective in flight), close the blocks a gloo thread released unseen."""
    import torch.distributed as dist

    dist.barrier()
    timeline.reconcile()


def phase_peaks(rank, world, args, variant, workdir, result_path):
    """A launch for one variant (CPU): the peak bytes allocated in each phase (construction, first step, steady
    steps, save, load) over what was allocated before the engine, from PyTorch's allocator events
    (:class:`zero_bnb.testing.census.AllocationTimeline`, transient buffers included). Profiled, so not timed."""
    from zero_bnb.testing.census import AllocationTimeline

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    folder = os.path.join(workdir, f"phases-{variant}")
    with AllocationTimeline("cpu") as timeline:
        with timeline.phase("construction"):
            engine = _build(variant, args, world)
        _reconciled(timeline)
        with timeline.phase("first_step"):
            _train(engine, args, rank, 0, 1, None)
        _reconciled(timeline)
        with timeline.phase("steady_steps"):
            for step in range(1, 1 + max(args.warmup, 1)):
                _train(engine, args, rank, step, 1, None)
                _reconciled(timeline)
        with timeline.phase("save"):
            engine.save_checkpoint(folder, tag="bench")
        _reconciled(timeline)
        with timeline.phase("load"):
            engine.load_checkpoint(folder, tag="bench")
    torch.distributed.barrier()  # every rank has loaded before the folder goes
    engine.destroy()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        with open(result_path, "w") as handle:
            json.dump({name: [phase.peak_bytes] for name, phase in timeline.phases().items()}, handle)


def resume(rank, world, args, workdir, result_path):
    """A launch at another DP size: variant 1 from its universal conversion, variant 3 directly."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    times = {"stock-adamw": [], "zero_bnb": []}
    for _ in range(args.rounds):
        for variant, folder, extra in (
            ("stock-adamw", os.path.join(workdir, "universal"), {"checkpoint": {"load_universal": True}}),
            ("zero_bnb", os.path.join(workdir, "zero_bnb"), {}),
        ):
            times[variant].append(timed_load(_build(variant, args, world, **extra), folder, args, rank))
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(times, handle)


def convert_to_universal(workdir: str, variant: str = "stock-adamw") -> float:
    """DeepSpeed's own converter on ``variant``'s checkpoint (tag ``bench``) into ``workdir/universal``, in this
    process; returns seconds."""
    from deepspeed.checkpoint import ds_to_universal

    output = os.path.join(workdir, "universal", "bench")
    arguments = argparse.Namespace(input_folder=os.path.join(workdir, variant, "bench"), output_folder=output,
                                   num_extract_workers=2, num_merge_workers=2, keep_temp_folder=False, strict=True,
                                   inject_missing_state=True)  # non-Megatron models need it
    start = time.perf_counter()
    ds_to_universal.main(arguments)
    return time.perf_counter() - start


def run_model(args, model: str) -> dict:
    from zero_bnb.testing.launch import run_distributed

    args.model = model
    workdir = tempfile.mkdtemp(prefix="zero_bnb_bench_")
    try:
        result_path = os.path.join(workdir, "measure.json")
        # GPU mode: rank r on cuda:r with nccl; CPU mode: gloo ranks that see no GPU.
        run_distributed(measure, args.dp, args, workdir, result_path, device="cuda" if args.mode == "gpu" else "cpu")
        with open(result_path) as handle:
            raw = json.load(handle)
        if not torch.cuda.is_available():  # RSS cannot be attributed to one engine of several in a process
            for variant in VARIANTS:
                run_distributed(peak_memory, args.dp, args, variant, result_path)
                with open(result_path) as handle:
                    raw[variant]["memory_bytes"] = [json.load(handle)]
                run_distributed(phase_peaks, args.dp, args, variant, workdir, result_path)
                with open(result_path) as handle:
                    raw[variant]["memory_bytes_by_phase"] = json.load(handle)
        if args.resume_dp:
            convert_s = convert_to_universal(workdir)
            resume_path = os.path.join(workdir, "resume.json")
            run_distributed(resume, args.resume_dp, args, workdir, resume_path)
            with open(resume_path) as handle:
                loads = json.load(handle)
            raw["resume"] = {"dp": args.resume_dp, "convert_s": convert_s, "load_s": loads}
        return summarise(raw, model=model, config=PRESETS[model], args=vars(args),
                         step_bytes_per_param=STEP_BYTES_PER_PARAM)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--models", nargs="+", help="presets from benchmarks/models.py")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                        help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--zero-gpu-update", choices=("auto", "fused", "bitsandbytes"), default=None,
                        help="the zero_bnb variant's zero_gpu_update (default: unset, its default); 'fused' measures "
                             "zero_bnb's Triton 8-bit update against stock DeepSpeed + bitsandbytes' kernel")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    cpu = args.mode == "cpu"
    args.models = args.models or (["cpu-small"] if cpu else ["gpt-125m", "gpt-350m", "gpt-1.3b"])
    args.micro_batch = args.micro_batch or (4 if cpu else 8)
    args.precision = args.precision or ("fp32" if cpu else "bf16")
    args.dp = 2 if cpu else 1
    args.resume_dp = 1 if cpu else None  # one GPU: no other DP size to resume at
    if not cpu and not torch.cuda.is_available():
        parser.error("--mode gpu needs a CUDA device")

    rows = [run_model(args, model) for model in args.models]
    where = {**machine(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    report = {
        "benchmark": "training and checkpoint cost, three variants interleaved",
        "mode": args.mode,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": where,
        "versions": versions(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("model", "out")},
        # the zero_bnb variant's config keys: only zero_gpu_update may be set (--zero-gpu-update), so every other
        # zero_bnb key has its default (masters derived from the module weights, which stay in DeepSpeed's model file)
        "zero_bnb_config": dataclasses.asdict(ZeroBnbConfig(**({"gpu_update": args.zero_gpu_update}
                                                              if args.zero_gpu_update else {}))),
        "results": rows,
    }
    default_precision = "fp32" if cpu else "bf16"
    stem = args.mode if args.precision == default_precision else f"{args.mode}-{args.precision}"
    if args.zero_gpu_update:
        stem += f"-gpu-update-{args.zero_gpu_update}"
    markdown = write_reports(report, os.path.join(args.out, stem))
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
