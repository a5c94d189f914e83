"""Command line: ``python -m zero_bnb <command>`` (also installed as ``zero-bnb``)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from zero_bnb.cli import tools
from zero_bnb.cli.pipes import quiet_on_broken_pipe

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit code (141, quietly, when standard output's reader
    went away: ``zero-bnb inspect CKPT | head``, see :mod:`zero_bnb.cli.pipes`)."""
    return quiet_on_broken_pipe(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="zero-bnb", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train at DP=2, checkpoint, resume at DP=3 and compare (CPU)")
    demo.add_argument("--out", default="demo_output", help="folder for the checkpoint, table and plot")
    demo.add_argument("--steps-before", type=int, default=12, help="optimizer steps before the checkpoint")
    demo.add_argument("--steps-after", type=int, default=12, help="optimizer steps after it")
    demo.add_argument("--save-dp", type=int, default=2, help="DP size of the first run")
    demo.add_argument("--resume-dp", type=int, default=3, help="DP size of the resumed run")
    demo.add_argument("--loss-bound", type=float, default=None,
                      help="largest relative difference of a resumed loss from the uninterrupted run (exit 1 above; "
                           "default: zero_bnb.cli.demo.LOSS_BOUND, measured in docs/bounds.md)")
    kernels = commands.add_parser(
        "build-kernels", help="compile the fused CPU 8-bit optimizer update now and print its path and quantizer",
        description="Compiles zero_bnb's fused CPU 8-bit optimizer update (otherwise built on first use) into the "
                    "kernel cache ($ZERO_BNB_KERNEL_DIR, default ~/.cache/zero_bnb/kernels) with the C++ compiler "
                    "$CXX (default c++) for -march=$ZERO_BNB_KERNEL_MARCH (default native). Exit 0, the library's path "
                    "and the quantizer path it takes (permute, gather, avx2 or scalar), or 1 and the reason.")
    kernels.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    tools.add_commands(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # `timeout`, `kill`, SLURM: clean up like Ctrl-C
        signal.signal(signal.SIGTERM, tools.terminate)
    if args.command == "demo":
        from zero_bnb.cli.demo import LOSS_BOUND, run_demo

        bound = LOSS_BOUND if args.loss_bound is None else args.loss_bound
        return run_demo(args.out, args.steps_before, args.steps_after, args.save_dp, args.resume_dp, bound)
    if args.command == "build-kernels":
        from zero_bnb.kernels.build import prebuild

        return prebuild(force=args.force)
    return tools.run(args)


if __name__ == "__main__":
    sys.exit(main())
