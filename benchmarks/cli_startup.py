"""Start-up time of ``zero-bnb verify`` / ``inspect``: this tree against a git revision, side by side.

Reproduce (CPU, from the repository root, after `bash scripts/setup.sh`):

    python benchmarks/cli_startup.py --compare-ref 7dd3135 --rounds 5

Writes a DP=1 toy checkpoint, extracts ``zero_bnb`` of ``--compare-ref`` with ``git archive``, then
runs ``python -m zero_bnb verify|inspect CKPT`` for both trees in alternating order (``PYTHONPATH``
pointing at each, from a neutral working directory) and prints the median wall time and whether
DeepSpeed and bitsandbytes were imported. Writes ``benchmarks/results/cli_startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_PROBE = ("import sys; from zero_bnb.cli import main; code = main([sys.argv[1], sys.argv[2]]); "
          "print(sorted(m for m in ('deepspeed', 'bitsandbytes') if m in sys.modules)); sys.exit(code)")


def _write_checkpoint(rank, world, folder):
    import bitsandbytes as bnb

    from zero_bnb.testing.toy import DEFAULT_RUN, build_engine, train_steps

    engine = build_engine(world, bnb.optim.Adam8bit)
    train_steps(engine, DEFAULT_RUN, 0, 1)
    engine.save_checkpoint(folder, tag="A")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare-ref", required=True, help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "cli_startup.json"))
    args = parser.parse_args(argv)
    from revisions import ROOT, alternating, extract_package

    from zero_bnb.testing.launch import run_distributed

    scratch = tempfile.mkdtemp(prefix="zero_bnb_startup_")
    checkpoint = os.path.join(scratch, "ckpt")
    run_distributed(_write_checkpoint, 1, checkpoint)
    trees = {f"baseline ({args.compare_ref})": extract_package(args.compare_ref, os.path.join(scratch, "baseline")),
             "this tree": ROOT}
    times: dict[str, dict[str, list[float]]] = {name: {"verify": [], "inspect": []} for name in trees}
    imported: dict[str, dict[str, str]] = {name: {} for name in trees}
    for round_index in range(args.rounds):
        for name in alternating(list(trees), round_index):
            for command in ("verify", "inspect"):
                start = time.perf_counter()
                done = subprocess.run([sys.executable, "-c", _PROBE, command, checkpoint], cwd=scratch,
                                      env={**os.environ, "PYTHONPATH": trees[name]}, capture_output=True, text=True)
                times[name][command].append(time.perf_counter() - start)
                if done.returncode != 0:
                    raise SystemExit(f"{name} {command} failed: {done.stderr[-2000:]}")
                imported[name][command] = done.stdout.strip().splitlines()[-1]
    shutil.rmtree(scratch, ignore_errors=True)
    report = {"benchmark": "zero-bnb verify/inspect start-up", "rounds": args.rounds, "results": {
        name: {command: {"median_s": statistics.median(values), "runs_s": values, "imported": imported[name][command]}
               for command, values in by_command.items()} for name, by_command in times.items()}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print("| tree | verify (median s) | inspect (median s) | DeepSpeed/bitsandbytes imported |")
    print("|---|---|---|---|")
    for name, by_command in report["results"].items():
        print(f"| {name} | {by_command['verify']['median_s']:.2f} | {by_command['inspect']['median_s']:.2f} | "
              f"{by_command['verify']['imported']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
