"""Drift of a migrated stock checkpoint, per resumed step: how far a stock DeepSpeed + Adam8bit run, migrated with
``zero-bnb convert --to zero_bnb`` and resumed under zero_bnb, moves from the stock run that never stopped.

Reproduce (CPU, from the repository root, after `bash scripts/setup.sh`):

    PYTHONPATH=. python benchmarks/migration_drift.py --seeds 0 1 2 3 4 --steps 3 --more 8

For each seed (the toy MLP's initialisation): stock DeepSpeed ZeRO-1 + ``bnb.optim.Adam8bit`` trains ``--steps``
steps at DP=2, saves, and goes on for ``--more`` steps (the reference); the checkpoint is migrated (stock partitions
are not on 256-element blocks, so the 8-bit moments are dequantized and requantized once on the aligned grid: the
error is printed as a relative RMS); zero_bnb resumes it at DP=2 and at DP=3 with bitsandbytes' CPU arithmetic
(``zero_cpu_update: "bitsandbytes"``, what the stock run steps with) for ``--more`` steps. Prints the relative loss
difference of every resumed step and writes ``benchmarks/results/migration_drift.json``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import tempfile
import time

import torch


def _cpu_model() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _stock(rank, world, workdir, seeds, steps, more):
    import bitsandbytes as bnb
    import deepspeed

    from zero_bnb.testing.toy import DEFAULT_RUN, LEARNING_RATE, build_model, param_groups, train_steps

    out = {}
    for seed in seeds:
        model = build_model(seed)
        optimizer = bnb.optim.Adam8bit(param_groups(model), lr=LEARNING_RATE)
        config = DEFAULT_RUN.ds_config(world, zero_allow_untested_optimizer=True)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        train_steps(engine, DEFAULT_RUN, 0, steps)
        engine.save_checkpoint(os.path.join(workdir, f"stock{seed}"), tag="s")
        out[seed] = train_steps(engine, DEFAULT_RUN, steps, more)
        engine.destroy()
    if rank == 0:
        torch.save(out, os.path.join(workdir, "stock.pt"))


def _resume(rank, world, workdir, seeds, steps, more):
    import bitsandbytes as bnb

    import zero_bnb
    from zero_bnb.testing.toy import DEFAULT_RUN, LEARNING_RATE, build_model, param_groups, train_steps

    out = {}
    for seed in seeds:
        model = build_model(seed)
        optimizer = bnb.optim.Adam8bit(param_groups(model), lr=LEARNING_RATE)
        config = DEFAULT_RUN.ds_config(world, zero_cpu_update="bitsandbytes")
        engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=config)
        engine.load_checkpoint(os.path.join(workdir, f"migrated{seed}"))
        out[seed] = train_steps(engine, DEFAULT_RUN, steps, more)
        engine.destroy()
    if rank == 0:
        torch.save(out, os.path.join(workdir, f"resumed{world}.pt"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=3, help="stock steps before the save")
    parser.add_argument("--more", type=int, default=8, help="steps after the save (resumed)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "migration_drift.json"))
    args = parser.parse_args(argv)

    from zero_bnb.testing.launch import run_distributed
    from zero_bnb.tools.convert import rescue_stock

    workdir = tempfile.mkdtemp(prefix="migration_drift_")
    run_distributed(_stock, 2, workdir, args.seeds, args.steps, args.more)
    rms = {}
    for seed in args.seeds:
        report = rescue_stock(os.path.join(workdir, f"stock{seed}"), os.path.join(workdir, f"migrated{seed}"))
        rms[seed] = report["relative_rms_error"]
    stock = torch.load(os.path.join(workdir, "stock.pt"))
    result = {"command": "python benchmarks/migration_drift.py " + " ".join(
                  ["--seeds", *map(str, args.seeds), "--steps", str(args.steps), "--more", str(args.more)]),
              "machine": f"{_cpu_model()}, {os.cpu_count()} cores",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "versions": {name: importlib.metadata.version(name) for name in ("torch", "deepspeed", "bitsandbytes")},
              "requantization_relative_rms": rms, "relative_loss_difference": {}}
    for world in (2, 3):
        run_distributed(_resume, world, workdir, args.seeds, args.steps, args.more)
        resumed = torch.load(os.path.join(workdir, f"resumed{world}.pt"))
        table = {seed: [abs(r - s) / abs(s) for r, s in zip(resumed[seed], stock[seed], strict=True)]
                 for seed in args.seeds}
        result["relative_loss_difference"][f"dp{world}"] = table
        print(f"resumed at DP={world}: relative loss difference per resumed step (rows: seeds)")
        for seed, row in table.items():
            print(f"  seed {seed}: " + " ".join(f"{value:.2e}" for value in row)
                  + f"   (requantization RMS {', '.join(f'{k} {v:.2%}' for k, v in rms[seed].items())})")
        worst = [max(row[i] for row in table.values()) for i in range(args.more)]
        print("  worst per step: " + " ".join(f"{value:.2e}" for value in worst))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
