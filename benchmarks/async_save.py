"""How long a checkpoint save stalls training: stock DeepSpeed, zero_bnb's durable save, zero_bnb's asynchronous one.

Side by side in one run, interleaved rounds, one process per rank (CPU, gloo), an MLP of ``--params`` parameters
trained with bitsandbytes' Adam8bit under ZeRO-1. Per variant and round:

* **blocking**: the seconds ``save_checkpoint`` blocks (barrier to barrier);
* **stall**: blocking plus the extra time of the steps that overlap the background write (each step's time minus
  the median step time measured just before the save); for a synchronous save, the stall is the blocking time;
* **background**: the seconds from the call until the asynchronous save is committed;
* **first save**: the blocking and stall of the engine's first save, measured the same way; the other columns are
  its second save's, which reuses the staging buffers the first allocated, as every later save of a run does;
* **control**: the same count of steps run right after, with no save pending, summed the same way: the stall a
  noisy machine adds to as many steps by itself (scaled to the overlapped count; 0 for synchronous saves).

``--contention disk`` runs another process writing (and fsyncing) 64 MiB blocks to the same disk throughout, as
on a shared node. Results (with the machine's load average while it ran) go to ``--out``.

    python benchmarks/async_save.py --params 59e6 --precision bf16 --rounds 3 --contention none disk
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import write_json_and_markdown  # noqa: E402 - this script's folder, first on sys.path

VARIANTS = ("stock", "zero_bnb", "zero_bnb-async")
_STEPS_BEFORE = 4


def _model(params: float, width: int) -> torch.nn.Module:
    layers = max(1, round(params / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _config(args, world: int, variant: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
        "train_batch_size": args.micro_batch * world, "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
    }
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    if variant == "zero_bnb-async":
        config["zero_checkpoint_async"] = True
    return config


def _build(variant: str, args, world: int):
    import bitsandbytes as bnb
    import deepspeed

    import zero_bnb

    torch.manual_seed(0)
    model = _model(args.params, args.width).to(_device(args))
    optimizer = bnb.optim.Adam8bit(model.parameters(), lr=1e-4)
    initialize = deepspeed.initialize if variant == "stock" else zero_bnb.initialize
    engine, *_ = initialize(model=model, optimizer=optimizer, config=_config(args, world, variant))
    return engine


def _device(args) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def _step(engine, args) -> float:
    start = time.perf_counter()
    weight = engine.module[0].weight
    data = torch.randn(args.micro_batch, args.width, dtype=weight.dtype, device=weight.device)
    loss = engine(data).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    if weight.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank. Collective: the ranks must take the same number of steps (each step's
    collectives pair with the other ranks'), and their writers finish at slightly different moments."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def save_stall(engine, folder: str, tag: str, step, baseline: float, max_overlap_steps: int = 200) -> dict:
    """One save of ``engine`` while it trains: the seconds ``save_checkpoint`` blocks (barrier to barrier), the
    stall (that plus each overlapping ``step()``'s seconds beyond ``baseline``, the median step time), and the
    seconds until an asynchronous save was committed (the blocking seconds for a synchronous one). Collective."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(folder, tag=tag)
    dist.barrier()
    blocking = time.perf_counter() - start
    extra, overlapped = 0.0, 0
    saver = getattr(engine, "_zero_bnb_background", None)
    while saver is not None and overlapped < max_overlap_steps and _any_rank(saver.pending):
        extra += max(0.0, step() - baseline)  # a step slowed by the background writer
        overlapped += 1
    if saver is not None:
        engine.wait_for_checkpoint()
    background = saver.last_duration if saver is not None else blocking
    # The control: as many steps again with no save pending, counted the same way (the noise of the machine).
    control = sum(max(0.0, step() - baseline) for _ in range(max(overlapped, 4)))
    return {"blocking_s": blocking, "stall_s": blocking + extra, "background_s": background,
            "overlapped_steps": overlapped, "step_s": baseline,
            "control_extra_s": control * overlapped / max(overlapped, 4)}


def _measure(engine, variant: str, args, folder: str, tag: str) -> dict:
    """Two saves of ``engine`` while it trains: the first (an asynchronous save allocates its staging buffers there)
    and the second, which reuses them as every later save of a run does: its blocking, stall and background seconds,
    with the first's blocking and stall beside them. Collective."""
    step = lambda: _step(engine, args)  # noqa: E731
    baseline = statistics.median(step() for _ in range(_STEPS_BEFORE))
    first = save_stall(engine, folder, f"{tag}-first", step, baseline, args.max_overlap_steps)
    baseline = statistics.median(step() for _ in range(_STEPS_BEFORE))
    row = save_stall(engine, folder, tag, step, baseline, args.max_overlap_steps)
    return {**row, "first_blocking_s": first["blocking_s"], "first_stall_s": first["stall_s"]}


def copy_floor(nbytes: int, device: torch.device, repeats: int = 3) -> float | None:
    """Seconds one copy of ``nbytes`` takes from ``device`` memory into host memory reused between copies (pinned
    from a GPU), median of ``repeats`` after a first copy: the least an asynchronous save can stall training, since
    the state must be copied before training may change it (on a CPU the call itself copies it; on a GPU the copies
    are queued on the training stream). ``None`` where the two extra buffers do not fit. Local."""
    try:
        source = torch.empty(nbytes, dtype=torch.uint8, device=device)
        target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
        return None
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _writer(folder: str, stop) -> None:
    """Another process writing to the same disk: 64 MiB blocks, each fsynced, until ``stop`` is set."""
    block = os.urandom(2**20) * 64
    path = os.path.join(folder, "contention.bin")
    while not stop.is_set():
        with open(path, "wb") as handle:
            for _ in range(8):
                handle.write(block)
                handle.flush()
                os.fsync(handle.fileno())
                if stop.is_set():
                    break
    os.remove(path)


def run(rank: int, world: int, args, workdir: str, result_path: str) -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(max(1, args.threads))
    rows = []
    for contention in args.contention:
        stop = writer = None
        if contention == "disk" and rank == 0:
            stop = multiprocessing.get_context("fork").Event()
            writer = multiprocessing.get_context("fork").Process(target=_writer, args=(workdir, stop))
            writer.start()
        for round_index in range(args.rounds):
            for variant in VARIANTS:
                engine = _build(variant, args, world)
                folder = os.path.join(workdir, f"{variant}-{contention}-{round_index}")
                load_before = os.getloadavg()[0]
                row = _measure(engine, variant, args, folder, "bench")
                row.update(variant=variant, contention=contention, round=round_index, load_avg=load_before)
                saver = getattr(engine, "_zero_bnb_background", None)
                if saver is not None:
                    row["copy_floor_s"] = copy_floor(saver.pool.staged_bytes, engine.device)
                rows.append(row)
                engine.destroy()
                if rank == 0:
                    shutil.rmtree(folder, ignore_errors=True)
                    logging.getLogger(__name__).warning("%s", row)
        if writer is not None:
            stop.set()
            writer.join()
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(rows, handle)


def summarize(rows: list[dict], args) -> str:
    """A markdown table: per contention and variant, the medians, and the stall as a fraction of stock's save."""
    gpu = f"; GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    lines = [f"# Save stall, {args.params / 1e6:.0f}M parameters, {args.precision}, ZeRO-1, DP={args.dp}{gpu}", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
             f"({_cpu_model()}); torch {torch.__version__}; `{' '.join(sys.argv)}`; load average "
             f"{min(r['load_avg'] for r in rows):.1f}-{max(r['load_avg'] for r in rows):.1f} during the runs.", "",
             "| contention | variant | blocking s | stall s | control s | background s | stall / stock's save | "
             "first save: blocking / stall s | rounds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    floors = []
    for contention in args.contention:
        stock = statistics.median(r["stall_s"] for r in rows if r["contention"] == contention and r["variant"] == "stock")
        for variant in VARIANTS:
            mine = [r for r in rows if r["contention"] == contention and r["variant"] == variant]
            median = {key: statistics.median(r[key] for r in mine)
                      for key in ("blocking_s", "stall_s", "control_extra_s", "background_s", "first_blocking_s",
                                  "first_stall_s")}
            lines.append(f"| {contention} | {variant} | {median['blocking_s']:.2f} | {median['stall_s']:.2f} | "
                         f"{median['control_extra_s']:.2f} | {median['background_s']:.2f} | "
                         f"{median['stall_s'] / stock:.2f}x | {median['first_blocking_s']:.2f} / "
                         f"{median['first_stall_s']:.2f} | {len(mine)} |")
            if any(r.get("copy_floor_s") is not None for r in mine):
                floor = statistics.median(r["copy_floor_s"] for r in mine if r.get("copy_floor_s") is not None)
                floors.append(f"{contention}: {floor:.3f} s ({floor / stock:.2f}x of stock's save)")
    if floors:
        lines += ["", "The floor of an asynchronous save's stall: one copy of the bytes it stages, "
                  "alone, same conditions (median): " + "; ".join(floors) + "."]
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=59e6)
    parser.add_argument("--width", type=int, default=3840)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=(os.cpu_count() or 2) // 1)
    parser.add_argument("--max-overlap-steps", type=int, default=200)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: rank r on cuda:r (the staging is then pinned host memory)")
    parser.add_argument("--contention", nargs="+", choices=("none", "disk"), default=["none", "disk"])
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    from zero_bnb.testing.launch import run_distributed

    workdir = tempfile.mkdtemp(prefix="zero_bnb_async_bench_", dir=os.environ.get("ZERO_BNB_BENCH_DIR"))
    try:
        result_path = os.path.join(workdir, "rows.json")
        run_distributed(run, args.dp, args, workdir, result_path, device=args.device)
        with open(result_path) as handle:
            rows = json.load(handle)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    name = args.name or f"async_save-{args.params / 1e6:.0f}m-{args.precision}-dp{args.dp}"
    table = summarize(rows, args)
    write_json_and_markdown({"argv": sys.argv, "rows": rows}, table, os.path.join(args.out, name))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
