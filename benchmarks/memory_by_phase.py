"""Bytes per parameter by phase, stock DeepSpeed + Adam8bit vs zero_bnb + Adam8bit, with DeepSpeed's default
gradient buckets and with buckets sized to the model.

Reproduce (from the repository root, after ``bash scripts/setup.sh``; 20 minutes on 2 busy cores):

    PYTHONPATH=. python benchmarks/memory_by_phase.py

Per data-parallel size (``--dp``, default 1 and 2: one launch each), per case (precision x ZeRO stage x bucket
size), stock and zero_bnb one engine at a time (order alternating case by case), each measured from before its
model is built to after a load:

- **peak**: the most bytes allocated at any moment of the phase (construction, first step, steady steps = steps
  2-4, save, load), over what was allocated before the model was built, from PyTorch's allocator events
  (:class:`zero_bnb.testing.census.AllocationTimeline`): transient buffers included, on CPU as on GPU. On the
  CPU an untouched ``torch.empty`` costs address space, not resident memory; on a GPU it costs memory, and that
  is what this counts.
- **end**: what was still allocated when the phase ended (same source);
- **mapped**: the most bytes of memory-mapped checkpoint files open at once (zero_bnb's loads map its shard and
  DeepSpeed's model file: page cache, read where touched), apart from the peak;
- **live**: live tensor storage after the phase (:func:`zero_bnb.testing.census.live_storage_bytes`, after a
  barrier), the independent check of ``end``; the timeline is reconciled there and after every step (a block a
  communication thread released is otherwise never seen freed);
- the losses of every step (the bucket size must not change them) and ``os.getloadavg()`` beside every case
  (other work on a shared machine slows it down; it does not change a byte count).

Bucket sizes: ``default`` sets nothing (DeepSpeed 0.19.8: ``reduce_bucket_size`` and ``allgather_bucket_size``
5e8 elements); a number ``f`` sets both to ``f`` x the model's parameter count (rounded up to 512 elements).

Writes ``<out>/memory_by_phase.json`` (machine, versions, date, settings, every figure in bytes) and ``.md``
(bytes per parameter).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, PRESETS, batch
from report import machine, versions, write_json_and_markdown

PHASES = ("construction", "first_step", "steady_steps", "save", "load")
VARIANTS = ("stock", "zero_bnb")
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "bf16acc": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}}
STEADY_STEPS = 3


def cases(args) -> list[dict]:
    """Every (precision, stage, buckets) measured; ``bf16acc`` (DeepSpeed's BF16_Optimizer) exists at stage 1."""
    return [{"precision": precision, "stage": stage, "buckets": buckets}
            for precision in args.precision for stage in args.stages for buckets in args.buckets
            if not (precision == "bf16acc" and stage != 1)]


def _config(case: dict, args, world: int, parameters: int) -> dict:
    zero = {"stage": case["stage"]}
    if case["buckets"] != "default":
        size = 512 * math.ceil(float(case["buckets"]) * parameters / 512)
        zero.update(reduce_bucket_size=size, allgather_bucket_size=size)
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "train_batch_size": args.micro_batch * world, "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True, "zero_optimization": zero, **PRECISIONS[case["precision"]]}


def _held(timeline=None) -> int:
    """Live storage once every collective issued so far has completed; with ``timeline``, it is reconciled first
    (blocks a communication thread released unseen are closed)."""
    import torch.distributed as dist

    from zero_bnb.testing.census import live_storage_bytes

    dist.barrier()
    if timeline is not None:
        timeline.reconcile()
    return live_storage_bytes()


def _step(engine, args, rank: int, step: int, timeline) -> float:
    import torch.distributed as dist

    loss = engine(batch(PRESETS[args.model], args.micro_batch, step, rank, engine.device))
    engine.backward(loss)
    engine.step()
    dist.barrier()
    timeline.reconcile()  # between steps: a bucket a gloo thread released unseen must not add to the next step
    return loss.item()


def _one_engine(variant: str, case: dict, args, rank: int, world: int, folder: str) -> dict:
    import bitsandbytes as bnb
    import deepspeed

    import zero_bnb
    from zero_bnb.testing.census import AllocationTimeline

    initialize = zero_bnb.initialize if variant == "zero_bnb" else deepspeed.initialize
    record: dict = {"loadavg": os.getloadavg(), "live": {}, "losses": []}
    baseline = _held()
    with AllocationTimeline("cpu") as timeline:
        with timeline.phase("construction"):
            torch.manual_seed(0)
            model = GPT(PRESETS[args.model])
            parameters = sum(p.numel() for p in model.parameters())
            optimizer = bnb.optim.Adam8bit(model.parameters(), lr=1e-4)
            engine = initialize(model=model, optimizer=optimizer,
                                config=_config(case, args, world, parameters))[0]
            del model, optimizer  # the engine holds them; the rest of initialize's tuple would keep it alive
        record["live"]["construction"] = _held(timeline) - baseline
        with timeline.phase("first_step"):
            record["losses"].append(_step(engine, args, rank, 0, timeline))
        record["live"]["first_step"] = _held(timeline) - baseline
        with timeline.phase("steady_steps"):
            record["losses"] += [_step(engine, args, rank, step, timeline) for step in range(1, 1 + STEADY_STEPS)]
        record["live"]["steady_steps"] = _held(timeline) - baseline
        with timeline.phase("save"):
            engine.save_checkpoint(folder, tag="a")
        record["live"]["save"] = _held(timeline) - baseline
        with timeline.phase("load"):
            engine.load_checkpoint(folder, tag="a")
        record["live"]["load"] = _held(timeline) - baseline
    phases = timeline.phases()
    record["peak"] = {name: phases[name].peak_bytes for name in PHASES}
    record["end"] = {name: phases[name].end_bytes for name in PHASES}
    record["mapped_peak"] = {name: phases[name].mapped_peak_bytes for name in PHASES}
    record["parameters"] = parameters
    engine.destroy()  # del alone does not free a DeepSpeed engine
    del engine
    record["left_after_destroy"] = _held() - baseline
    shutil.rmtree(folder, ignore_errors=True)
    return record


def measure(rank: int, world: int, args, workdir: str, result_path: str) -> None:
    """One launch at ``world`` ranks: every case, stock and zero_bnb alternating which goes first."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    results = []
    for index, case in enumerate(cases(args)):
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
        records = {variant: _one_engine(variant, case, args, rank, world, os.path.join(workdir, variant))
                   for variant in order}
        results.append({**case, "dp": world, "variants": records})
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(results, handle)


def _markdown(report: dict) -> str:
    where = f"{report['machine']['processor']} ({report['machine']['cpus']} CPUs)"
    lines = [f"Memory by phase, {report['date']}, on {where}; "
             + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".",
             f"Model `{report['settings']['model']}`, micro-batch {report['settings']['micro_batch']}, Adam8bit. "
             "Bytes per parameter per rank over what was allocated before the model was built: the peak during "
             "the phase (PyTorch's allocator events) / live tensor storage after it (census). stock = "
             "`deepspeed.initialize`, ours = `zero_bnb.initialize`.", "",
             "\"load mapped\": checkpoint files mapped during the load (page cache, not in the peak). \"losses as "
             "default buckets\": the variant's 4 losses are bit-identical to its run with DeepSpeed's default buckets. "
             "\"allocator - census\": the largest difference, over the phases, between what the allocator events say "
             "is allocated at a phase's end and the live tensor storage counted then (the independent check).", "",
             "| DP | precision | stage | buckets | variant | " + " | ".join(PHASES)
             + " | load mapped | losses as default buckets | allocator - census | load avg |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in PHASES) + " | --- | --- | --- | --- |"]
    default = {(row["dp"], row["precision"], row["stage"], variant): row["variants"][variant]["losses"]
               for row in report["results"] if row["buckets"] == "default" for variant in VARIANTS}
    for row in report["results"]:
        for variant in VARIANTS:
            record = row["variants"][variant]
            params = record["parameters"]
            reference = default.get((row["dp"], row["precision"], row["stage"], variant))
            same = "-" if reference is None else "yes" if record["losses"] == reference else "**no**"
            cells = [f"{record['peak'][p] / params:.2f} / {record['live'][p] / params:.2f}" for p in PHASES]
            gap = max((abs(record["end"][p] - record["live"][p]) for p in PHASES)) / params
            lines.append(f"| {row['dp']} | {row['precision']} | {row['stage']} | {row['buckets']} | {variant} | "
                         + " | ".join(cells) + f" | {record['mapped_peak']['load'] / params:.2f} | {same} | "
                         + f"{gap:.3f} | " + ", ".join(f"{x:.1f}" for x in record["loadavg"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cpu-small", choices=sorted(PRESETS))
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--precision", nargs="+", choices=sorted(PRECISIONS), default=["fp32", "bf16", "bf16acc"])
    parser.add_argument("--stages", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    parser.add_argument("--buckets", nargs="+", default=["default", "1"],
                        help="'default' (DeepSpeed's 5e8 elements) or a fraction of the model's parameter count")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="memory_by_phase")
    args = parser.parse_args(argv)
    for buckets in args.buckets:
        if buckets != "default" and not (buckets.replace(".", "", 1).isdigit() and float(buckets) > 0):
            parser.error(f"--buckets {buckets!r}: give 'default' or a positive fraction of the parameter count")

    from zero_bnb.testing.launch import run_distributed

    results = []
    for dp in args.dp:
        workdir = tempfile.mkdtemp(prefix="zero_bnb_memory_")
        try:
            result_path = os.path.join(workdir, "result.json")
            run_distributed(measure, dp, args, workdir, result_path)
            with open(result_path) as handle:
                results += json.load(handle)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {"benchmark": "bytes per parameter by phase, stock DeepSpeed vs zero_bnb, Adam8bit",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "versions": versions(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "results": results}
    markdown = _markdown(report)
    write_json_and_markdown(report, markdown, os.path.join(args.out, args.name))
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
