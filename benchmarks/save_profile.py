"""Where a checkpoint save's time goes: stock DeepSpeed + Adam8bit vs zero_bnb + Adam8bit, phase by phase.

Reproduce (CPU, from the repository root, after ``bash scripts/setup.sh``):

    PYTHONPATH=$PWD python benchmarks/save_profile.py                       # 67M and 151M, DP 1 and 2, fp32 and bf16
    PYTHONPATH=$PWD python benchmarks/save_profile.py --layers 4 --dp 1 --precision bf16 --rounds 3 --name quick
    python benchmarks/save_profile.py --compare before.json after.json   # a table of several reports, side by side
    PYTHONPATH=$PWD python benchmarks/save_profile.py --configs 4:1:bf16 --conditions quiet --ablate   # + speed-ups undone
    PYTHONPATH=$PWD python benchmarks/save_profile.py --configs 4:1:bf16 --conditions quiet --floor   # + the disk's floor

For each model size (an MLP of ``--layers`` 4096x4096 linear layers: 4 -> 67M parameters, 9 -> 151M), DP size
(1: one process; 2: two gloo processes through ``zero_bnb.testing.launch.run_distributed``) and precision, every
rank builds both engines, ZeRO-1, ``bnb.optim.Adam8bit``: ``deepspeed.initialize`` (stock) and
``zero_bnb.initialize``, with default settings, and takes one training step with each. Then, per condition
(``quiet``: nothing else started; ``disk``: a background ``dd`` rewriting 1 GiB with ``conv=fdatasync`` in a loop on
the same file system, stopped afterwards), ``--rounds`` rounds save each engine once under a fresh tag, the two in
alternating order. Between saves (untimed) the previous folders are removed and ``os.sync()`` flushes what the
previous save left dirty, so each save starts with the same clean page cache.

Each save is timed barrier to barrier (wall) and in process CPU time, and broken into phases by wrapping, in the
ranks' processes only, the functions zero_bnb's save calls (names below) and the I/O calls of
``zero_bnb.format.durable``; a phase's time excludes the phases nested in it (so the phases add up to the total):

* ``verify replicated`` (``verify_replicated_state``), ``non-finite scan`` (``find_non_finite``),
* ``masters: plan`` (``plan_masters`` itself), ``masters: rounding check`` (``rounds_to``), ``masters: residual split``
  (``split_bf16``), ``digest (module pieces)`` (``piece_digest``: the weights the masters are split against),
* ``device copy`` (``.to("cpu")`` of the saved state, ``checkpoint.save._valid_slice``),
* ``serialise`` (``torch.save`` itself: pickling, zip framing, CRC-32 when on), ``digest (files)`` (BLAKE3, or SHA-256), ``write``
  (``write`` calls on the file), ``fsync`` (files and folders), ``rename``,
* ``collectives`` (``all_gather_object``, ``broadcast_object_list``, ``barrier``, ``all_reduce``, ``broadcast``:
  mostly waiting for the other rank), ``begin``/``commit``/``manifest``/``shard files``/``model file`` (their own
  code), and ``other`` (DeepSpeed's and Python's code outside every wrapped call).

For stock DeepSpeed only ``serialise+write`` (its ``torch.save`` to a path: pickling, CRC-32 and the write, which
its C++ writer does), ``collectives`` and ``other`` exist. Work done in a helper thread is reported beside the
phases as ``... [thread]`` (it overlaps the main thread's phases; not part of the sum).

Writes ``benchmarks/results/<--name>.json`` and ``.md`` (machine, versions, load average at each save).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import machine, versions

WIDTH = 4096
VARIANTS = ("stock", "zero_bnb")
#: With --ablate: zero_bnb's engine saving with this branch's speed-ups undone (zip CRC-32 on, file hashing inline,
#: SHA-256 instead of BLAKE3, bf16 rounding check and residual split as two functions, module pieces hashed after
#: them), in the same processes.
ABLATED = "zero_bnb-undone"
#: With --floor: no engine; each rank writes its share of the bytes of zero_bnb's checkpoint from memory (8 MiB writes
#: of random bytes) and fsyncs the file and its folder. What making that many bytes durable costs on this disk with no
#: serialisation, split or hashing: where it exceeds stock's (not durable) save, no durable save can be <= 1.0x there.
FLOOR = "durable floor"


@contextmanager
def undone_speedups():
    """Undo, for the block, this branch's save speed-ups (benchmark processes only; see :data:`ABLATED`)."""
    import zero_bnb.checkpoint.masters as cmasters
    import zero_bnb.format.digests as digests
    import zero_bnb.format.durable as durable
    from zero_bnb.core.residual import rounds_to, split_bf16

    saved = (durable.without_zip_crc32, durable._PARALLEL_HASH_BYTES, cmasters.split_rounded_bf16,
             getattr(cmasters, "_HASH_BESIDE_SPLIT", False), digests.writing_algorithm)

    @contextmanager
    def crc_on():
        yield

    durable.without_zip_crc32 = crc_on
    durable._PARALLEL_HASH_BYTES = 1 << 62
    cmasters._HASH_BESIDE_SPLIT = False
    digests.writing_algorithm = lambda: digests.SHA256
    cmasters.split_rounded_bf16 = lambda master, weight: split_bf16(master, weight) if rounds_to(master, weight) else None
    try:
        yield
    finally:
        (durable.without_zip_crc32, durable._PARALLEL_HASH_BYTES, cmasters.split_rounded_bf16,
         cmasters._HASH_BESIDE_SPLIT, digests.writing_algorithm) = saved
CONDITIONS = ("quiet", "disk")


class PhaseProfile:
    """Exclusive wall and process-CPU time per named phase, of the main thread; helper threads' time apart."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.thread_wall: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._mark = (0.0, 0.0)
        self._main = threading.get_ident()
        self.active = False

    def _charge(self) -> None:
        now = (time.perf_counter(), time.process_time())
        if self._stack:
            self.wall[self._stack[-1]] += now[0] - self._mark[0]
            self.cpu[self._stack[-1]] += now[1] - self._mark[1]
        self._mark = now

    @contextmanager
    def phase(self, name: str):
        if not self.active:
            yield
            return
        if threading.get_ident() != self._main:
            start = time.perf_counter()
            try:
                yield
            finally:
                self.thread_wall[f"{name} [thread]"] += time.perf_counter() - start
            return
        self._charge()
        self._stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        timed.__wrapped_by_profile__ = True
        return timed

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.thread_wall.clear()


class _TimedHash:
    def __init__(self, profile: PhaseProfile, inner) -> None:
        self._profile, self._inner = profile, inner

    def update(self, data) -> None:
        with self._profile.phase("digest (files)"):
            self._inner.update(data)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _TimedFile:
    def __init__(self, profile: PhaseProfile, inner) -> None:
        self._profile, self._inner = profile, inner

    def write(self, data):
        with self._profile.phase("write"):
            return self._inner.write(data)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Proxy:
    """A module stand-in: the given overrides, everything else from ``module``."""

    def __init__(self, module, **overrides) -> None:
        self._module, self._overrides = module, overrides

    def __getattr__(self, name):
        return self._overrides[name] if name in self._overrides else getattr(self._module, name)


def install(profile: PhaseProfile) -> None:
    """Wrap the functions a save calls (in this process only: a benchmark rank)."""
    import torch.distributed as dist

    import zero_bnb.checkpoint.commit as commit
    import zero_bnb.checkpoint.masters as cmasters
    import zero_bnb.checkpoint.save as save
    import zero_bnb.ds.engine as engine
    import zero_bnb.format.digests as digests
    import zero_bnb.format.durable as durable
    import zero_bnb.format.masters as fmasters

    def patch(owner, attribute: str, name: str) -> None:
        if hasattr(owner, attribute):
            setattr(owner, attribute, profile.wrap(name, getattr(owner, attribute)))

    patch(engine, "verify_replicated_state", "verify replicated")
    patch(engine, "find_non_finite", "non-finite scan")
    patch(engine, "plan_masters", "masters: plan")  # before the one save path (issue 43): the synchronous save's
    if importlib.util.find_spec("zero_bnb.checkpoint.staged") is not None:  # since: both saves decide there
        staged = importlib.import_module("zero_bnb.checkpoint.staged")
        patch(staged, "decide_masters", "masters: plan")  # before the split beside DeepSpeed's files (issue 43)
        patch(staged, "agree_masters", "masters: plan")  # since: the split on a helper thread, the agreement here
        patch(staged, "derive_local_masters", "masters: derive")
    patch(engine, "stage_local_payload", "shard files")  # the copies; the writes are timed by the I/O phases
    patch(save.LocalPayload, "write", "shard files")
    patch(engine, "manifest_draft", "manifest")
    patch(cmasters, "rounds_to", "masters: rounding check")
    patch(cmasters, "derive", "masters: plan")
    patch(fmasters, "split_bf16", "masters: residual split")
    patch(cmasters, "split_rounded_bf16", "masters: residual split")  # rounding check and split in one pass
    patch(fmasters, "piece_digest", "digest (module pieces)")
    patch(save, "copy_to_cpu", "device copy")
    patch(importlib.import_module("zero_bnb.ds.checkpoint_engine").DurableCheckpointEngine, "save", "model file")
    patch(commit.SaveTransaction, "begin", "begin")
    patch(commit.SaveTransaction, "commit", "commit")
    for name in ("all_gather_object", "broadcast_object_list", "barrier", "all_reduce", "broadcast"):
        patch(dist, name, "collectives")
    torch.save = profile.wrap("serialise", torch.save)
    raw_fdopen = os.fdopen
    overrides = {
        "fdopen": lambda *a, **k: _TimedFile(profile, raw_fdopen(*a, **k)),
        "write": profile.wrap("write", os.write),
        "fsync": profile.wrap("fsync", os.fsync),
        "fdatasync": profile.wrap("fsync", os.fdatasync),
        "rename": profile.wrap("rename", os.rename),
        "replace": profile.wrap("rename", os.replace),
    }
    durable.os = _Proxy(os, **overrides)
    commit.os = _Proxy(os, rename=overrides["rename"])
    durable.digests = _Proxy(digests, new=lambda *a, **k: _TimedHash(profile, digests.new(*a, **k)))


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _engine(variant: str, layers: int, precision: str, world: int):
    import bitsandbytes as bnb
    import deepspeed

    import zero_bnb

    model = _model(layers)
    optimizer = bnb.optim.Adam8bit(model.parameters(), lr=1e-4)
    config = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "steps_per_print": 10**9, "bf16": {"enabled": precision == "bf16"},
              "zero_allow_untested_optimizer": True}
    initialize = zero_bnb.initialize if variant == "zero_bnb" else deepspeed.initialize
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    loss = engine(torch.randn(2, WIDTH, dtype=dtype)).float().square().mean()
    engine.backward(loss)
    engine.step()
    return engine


@contextmanager
def _nothing():
    yield


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


@contextmanager
def _disk_writer(folder: str, enabled: bool):
    """A background ``dd`` rewriting 1 GiB in ``folder`` with fdatasync, in a loop, while the block runs."""
    if not enabled:
        yield
        return
    target = os.path.join(folder, "dd-contention.bin")
    process = subprocess.Popen(
        ["bash", "-c", f"while true; do dd if=/dev/zero of={target} bs=1M count=1024 conv=fdatasync status=none; done"],
        start_new_session=True)
    time.sleep(3)  # let it reach steady writing
    try:
        yield
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
        if os.path.exists(target):
            os.remove(target)


def _write_floor(folder: str, payload: bytes, size: int) -> None:
    """``size`` bytes (``payload`` repeated) into a new file in the new ``folder``, fsynced with the folder (see
    :data:`FLOOR`)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"floor-{os.getpid()}.bin")
    with open(path, "wb", buffering=0) as handle:
        for start in range(0, size, len(payload)):
            handle.write(memoryview(payload)[: min(len(payload), size - start)])
        os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def measure(rank, world, layers, precision, rounds, conditions, workdir, result_path, variants=VARIANTS):
    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    logging.getLogger("deepspeed").setLevel(logging.WARNING)
    profile = PhaseProfile()
    install(profile)
    engines = {variant: _engine(variant, layers, precision, world) for variant in VARIANTS}
    if ABLATED in variants:
        engines[ABLATED] = engines["zero_bnb"]
    parameters = sum(p.numel() for p in engines["stock"].module.parameters())
    for variant in variants:  # untimed: the first save of a process pays one-off costs (imports, page faults)
        if variant != FLOOR:
            engines[variant].save_checkpoint(os.path.join(workdir, variant), tag="warmup")
    share = [_folder_bytes(os.path.join(workdir, "zero_bnb", "warmup")) // world]
    dist.broadcast_object_list(share, src=0)  # rank 0's count of the whole checkpoint, split evenly
    payload = os.urandom(8 << 20)
    records = []
    for condition in conditions:
        dist.barrier()
        with _disk_writer(workdir, condition == "disk" and rank == 0):
            dist.barrier()
            for round_index in range(rounds):
                shift = round_index % len(variants)  # rotating order: 1 2 3, 2 3 1, 3 1 2
                order = variants[shift:] + variants[:shift]
                for variant in order:
                    folder = os.path.join(workdir, variant)
                    tag = f"r{round_index}-{condition}"
                    dist.barrier()
                    if rank == 0:
                        for name in os.listdir(workdir):
                            if name in variants:
                                shutil.rmtree(os.path.join(workdir, name))
                        os.sync()
                    dist.barrier()
                    load = os.getloadavg()
                    profile.reset()
                    profile.active = True
                    start, start_cpu = time.perf_counter(), time.process_time()
                    with profile.phase("other"), (undone_speedups() if variant == ABLATED else _nothing()):
                        if variant == FLOOR:
                            _write_floor(os.path.join(folder, tag), payload, share[0])
                        else:
                            engines[variant].save_checkpoint(folder, tag=tag)
                        dist.barrier()
                    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
                    profile.active = False
                    mine = {"wall": wall, "cpu": cpu, "phases": {k: [profile.wall[k], profile.cpu[k]]
                                                                 for k in profile.wall},
                            "threads": dict(profile.thread_wall)}
                    parts: list = [None] * world
                    dist.all_gather_object(parts, mine)
                    if rank == 0:
                        records.append({"condition": condition, "round": round_index, "variant": variant,
                                        "load_average": load, "bytes": _folder_bytes(os.path.join(folder, tag)),
                                        "ranks": parts})
                        print(f"  {condition} round {round_index} {variant}: {wall:.2f} s", flush=True)
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump({"parameters": parameters, "records": records}, handle)


def _summary(records: list[dict], variant: str) -> dict:
    """Medians over rounds of: wall (rank 0, barrier to barrier), CPU summed over ranks, each phase (mean over
    ranks), and fsync's wall on the slowest rank."""
    mine = [r for r in records if r["variant"] == variant]
    names = sorted({name for r in mine for rank in r["ranks"] for name in rank["phases"]})
    threads = sorted({name for r in mine for rank in r["ranks"] for name in rank["threads"]})

    def med(values):
        return statistics.median(values)

    def phase(r, name, column):
        return statistics.mean(rank["phases"].get(name, [0.0, 0.0])[column] for rank in r["ranks"])

    fsync = [max(rank["phases"].get("fsync", [0.0, 0.0])[0] for rank in r["ranks"]) for r in mine]
    walls = [r["ranks"][0]["wall"] for r in mine]
    return {
        "wall_s": med(walls), "wall_all_s": walls,
        "cpu_s": med([sum(rank["cpu"] for rank in r["ranks"]) for r in mine]),
        "fsync_wall_s": med(fsync),
        "wall_minus_fsync_s": med([w - f for w, f in zip(walls, fsync)]),
        "bytes": mine[0]["bytes"],
        "load_average_1min": [r["load_average"][0] for r in mine],
        "phases": {name: {"wall_s": med([phase(r, name, 0) for r in mine]), "cpu_s": med([phase(r, name, 1) for r in mine])}
                   for name in names},
        "threads": {name: med([statistics.mean(rank["threads"].get(name, 0.0) for rank in r["ranks"]) for r in mine])
                    for name in threads},
    }


def _markdown(report: dict) -> str:
    lines = [f"# {report['benchmark']}", "", f"zero_bnb: {report['zero_bnb_path']} {report['settings']['label']}", "",
             f"Machine: {report['machine']['processor']}, {report['machine']['cpus']} CPUs ({report['machine']['platform']}); "
             f"{report['date']}; versions {report['versions']}.", "",
             "Seconds per save, median of the rounds (wall: rank 0, barrier to barrier; CPU: summed over ranks). "
             "`- fsync`: the wall time less the slowest rank's fsync wait.", "",
             "| params | DP | precision | condition | load avg | stock wall | stock CPU | zero_bnb wall | zero_bnb CPU | "
             "zero_bnb fsync | zero_bnb - fsync | (zero_bnb - fsync) / stock | MB stock / zero_bnb |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["results"]:
        s, z = row["stock"], row["zero_bnb"]
        loads = s["load_average_1min"] + z["load_average_1min"]
        lines.append(f"| {row['parameters'] / 1e6:.0f}M | {row['dp']} | {row['precision']} | {row['condition']} | "
                     f"{min(loads):.1f}-{max(loads):.1f} | {s['wall_s']:.2f} | {s['cpu_s']:.2f} | {z['wall_s']:.2f} | "
                     f"{z['cpu_s']:.2f} | {z['fsync_wall_s']:.2f} | {z['wall_minus_fsync_s']:.2f} | "
                     f"{z['wall_minus_fsync_s'] / s['wall_s']:.2f}x | {s['bytes'] / 1e6:.0f} / {z['bytes'] / 1e6:.0f} |")
    variants = report["settings"].get("variants", VARIANTS)
    if ABLATED in variants:
        lines += ["", f"`{ABLATED}`: the same zero_bnb engine, saving with this branch's speed-ups undone, in the same "
                  "rounds (rotating order).", "",
                  "| params | DP | precision | condition | undone wall | undone CPU | undone - fsync | / stock | "
                  "zero_bnb CPU / undone CPU |", "|---|---|---|---|---|---|---|---|---|"]
        for row in report["results"]:
            s, z, u = row["stock"], row["zero_bnb"], row[ABLATED]
            lines.append(f"| {row['parameters'] / 1e6:.0f}M | {row['dp']} | {row['precision']} | {row['condition']} | "
                         f"{u['wall_s']:.2f} | {u['cpu_s']:.2f} | {u['wall_minus_fsync_s']:.2f} | "
                         f"{u['wall_minus_fsync_s'] / s['wall_s']:.2f}x | {z['cpu_s'] / u['cpu_s']:.2f} |")
    if FLOOR in variants:
        lines += ["", f"`{FLOOR}`: zero_bnb's bytes written from memory and fsynced, no engine, in the same rounds "
                  "(rotating order); each save's wall time, all rounds, and the medians' ratios.", "",
                  "| params | DP | precision | condition | stock walls | zero_bnb walls | floor walls | zero_bnb / stock | "
                  "floor / stock | zero_bnb / floor |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in report["results"]:
            s, z, f = row["stock"], row["zero_bnb"], row[FLOOR]

            def walls(summary):
                return " ".join(f"{w:.2f}" for w in summary["wall_all_s"])

            lines.append(f"| {row['parameters'] / 1e6:.0f}M | {row['dp']} | {row['precision']} | {row['condition']} | "
                         f"{walls(s)} | {walls(z)} | {walls(f)} | {z['wall_s'] / s['wall_s']:.2f}x | "
                         f"{f['wall_s'] / s['wall_s']:.2f}x | {z['wall_s'] / f['wall_s']:.2f}x |")
    names = sorted({name for row in report["results"] for v in variants for name in row[v]["phases"]})
    lines += ["", "zero_bnb's save by phase (wall s / CPU s, mean over ranks, median over rounds); stock's beside it.", ""]
    header = "| params | DP | precision | condition | variant | " + " | ".join(names) + " | threads |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for row in report["results"]:
        for variant in variants:
            p = row[variant]["phases"]
            cells = [f"{p[n]['wall_s']:.2f} / {p[n]['cpu_s']:.2f}" if n in p else "" for n in names]
            threads = ", ".join(f"{k} {v:.2f}" for k, v in row[variant]["threads"].items())
            lines.append(f"| {row['parameters'] / 1e6:.0f}M | {row['dp']} | {row['precision']} | {row['condition']} | "
                         f"{variant} | " + " | ".join(cells) + f" | {threads} |")
    return "\n".join(lines) + "\n"


def compare(paths: list[str]) -> str:
    """A markdown table of several reports of this benchmark (the same configs), one column group per report."""
    reports = []
    for path in paths:
        with open(path) as handle:
            reports.append(json.load(handle))
    header = "| params | DP | precision | condition | " + " | ".join(
        f"{r['settings']['label'] or r['settings']['name']}: stock wall / CPU | zero_bnb wall / CPU | - fsync | ratio"
        for r in reports) + " |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for index, row in enumerate(reports[0]["results"]):
        cells = []
        for report in reports:
            other = report["results"][index]
            s, z = other["stock"], other["zero_bnb"]
            cells.append(f"{s['wall_s']:.2f} / {s['cpu_s']:.2f} | {z['wall_s']:.2f} / {z['cpu_s']:.2f} | "
                         f"{z['wall_minus_fsync_s']:.2f} | {z['wall_minus_fsync_s'] / s['wall_s']:.2f}x")
        lines.append(f"| {row['parameters'] / 1e6:.0f}M | {row['dp']} | {row['precision']} | {row['condition']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from zero_bnb.testing.launch import run_distributed

    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--compare":
        print(compare(sys.argv[2:]))
        return 0

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 9], help="4096x4096 layers (4: 67M, 9: 151M)")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--configs", nargs="+", default=None, metavar="LAYERS:DP:PRECISION",
                        help="measure these instead of every combination of --layers, --dp and --precision")
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ablate", action="store_true",
                        help=f"also save zero_bnb's engine with this branch's speed-ups undone ({ABLATED!r})")
    parser.add_argument("--floor", action="store_true",
                        help=f"also time writing zero_bnb's bytes durably with no engine ({FLOOR!r})")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a new folder in /tmp)")
    parser.add_argument("--name", default="save_profile")
    parser.add_argument("--label", default="", help="what code this run measured (recorded in the report)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    import zero_bnb

    configs = [(int(c.split(":")[0]), int(c.split(":")[1]), c.split(":")[2]) for c in args.configs] if args.configs \
        else [(layers, dp, precision) for layers in args.layers for dp in args.dp for precision in args.precision]
    variants = (*VARIANTS, *((ABLATED,) if args.ablate else ()), *((FLOOR,) if args.floor else ()))
    args.variants = variants
    rows = []
    for layers, dp, precision in configs:
        workdir = tempfile.mkdtemp(prefix="zero_bnb_save_profile_", dir=args.workdir)
        try:
            print(f"{layers} layers, DP={dp}, {precision}", flush=True)
            result_path = os.path.join(workdir, "result.json")
            run_distributed(measure, dp, layers, precision, args.rounds, args.conditions, workdir, result_path,
                            variants)
            with open(result_path) as handle:
                raw = json.load(handle)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        for condition in args.conditions:
            records = [r for r in raw["records"] if r["condition"] == condition]
            rows.append({"parameters": raw["parameters"], "layers": layers, "dp": dp, "precision": precision,
                         "condition": condition, **{v: _summary(records, v) for v in variants},
                         "raw": records})
    report = {"benchmark": "checkpoint save by phase: stock DeepSpeed + Adam8bit vs zero_bnb + Adam8bit, ZeRO-1",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "versions": versions(), "zero_bnb_path": os.path.dirname(zero_bnb.__file__), "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
              "results": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as handle:
        json.dump(report, handle, indent=1)
    markdown = _markdown(report)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as handle:
        handle.write(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
