"""The checkpoint commands: ``inspect``, ``verify``, ``convert``, ``export``.

Each prints a readable result on stdout (``--json`` where a machine reads it) and returns an
exit code: 0 success, 1 a checkpoint that fails a check, 2 a usage error (bad arguments, an
output over its input or over an existing output without ``--force``, an output path through an
existing file, a reserved tag, a stock or universal checkpoint given to a command that reads
zero_bnb checkpoints), 130 interrupted (what it left is said), 141 stdout's reader went away
(``| head``; nothing more is printed). Errors are one line on stderr that names what was wrong and
what to do.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zero_bnb.core.state_spec import UNIVERSAL_TARGETS, UnsupportedOptimizerError
from zero_bnb.errors import CheckpointError, CheckpointUsageError
from zero_bnb.format.publish import Publication, noting_publications
from zero_bnb.format.reader import verify_checkpoint
from zero_bnb.tools import checkpoint_paths

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is so that every ``finally`` (staging folders, locks) runs."""


def terminate(signum: int, frame: Any) -> None:
    """SIGTERM handler of the command line (installed by :func:`zero_bnb.cli.main`)."""
    raise Terminated()

__all__ = ["add_commands", "run"]


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register the checkpoint commands on the ``zero-bnb`` parser."""
    inspect = commands.add_parser("inspect", help="summarise a zero_bnb checkpoint")
    inspect.add_argument("checkpoint", help="save folder (with 'latest') or tag folder")
    inspect.add_argument("--tag", help="tag to read instead of the one 'latest' names")
    inspect.add_argument("--json", action="store_true", help="print JSON for machines")
    verify = commands.add_parser("verify", help="run every consistency and checksum check; exit 0 or 1")
    verify.add_argument("checkpoint")
    verify.add_argument("--tag")
    conv = commands.add_parser(
        "convert", help="zero_bnb -> universal; universal or stock DeepSpeed -> zero_bnb",
        description="--to universal: OUT is the universal tag folder to create (as for DeepSpeed's ds_to_universal "
                    "--output_folder), and latest_universal in its parent names it. --to zero_bnb: OUT is a save "
                    "folder; the tag folder OUT/<tag> is created and OUT/latest names it. OUT must not overlap the "
                    "input; an existing output is replaced only with --force.")
    conv.add_argument("checkpoint", help="the checkpoint to read (save folder or tag folder)")
    conv.add_argument("--to", required=True, choices=("universal", "zero_bnb"), dest="target")
    conv.add_argument("out", help="--to universal: the tag folder to create; --to zero_bnb: the save folder to "
                                  "write into")
    conv.add_argument("--tag", help="tag to read")
    conv.add_argument("--out-tag", help="--to zero_bnb only: tag to write (default: the tag read)")
    conv.add_argument("--force", action="store_true", help="replace an existing output (kept until the new one is "
                                                           "complete)")
    conv.add_argument("--optimizer", default=None,
                      help=f"universal -> zero_bnb: the bitsandbytes optimizer to start, one of {list(UNIVERSAL_TARGETS)} "
                           f"(default AdamW8bit); stock -> zero_bnb: the class that wrote the checkpoint (needed for "
                           f"Lion8bit, SGD8bit, RMSprop8bit, Adagrad8bit; Adam and AdEMAMix are recognised)")
    export = commands.add_parser("export", help="consolidated fp32 weights (and moments) as safetensors or torch file")
    export.add_argument("checkpoint")
    export.add_argument("--to", required=True, choices=("fp32",), dest="target")
    export.add_argument("out", help="output file (outside the checkpoint): .safetensors, or .pt / .pth / .bin for "
                                    "torch.save of the state dict")
    export.add_argument("--tag")
    export.add_argument("--force", action="store_true", help="replace an existing output file")
    export.add_argument("--moments", action="store_true", help="also write <name>.exp_avg / <name>.exp_avg_sq")


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:,.0f} {unit}" if unit == "B" else f"{count:,.1f} {unit}"
        count /= 1024
    return ""


_MASTERS = {"fp32": "fp32 master weights in the shards",
            "module": "the fp32 module weights of DeepSpeed's model file",
            "module+low16": "the bf16 module weights of DeepSpeed's model file + 16-bit residuals in the shards"}


def _saved_at(saved_dp: int, stored_dp: int, migrated_from: dict[str, Any] | None) -> str:
    """``saved at DP=N``, and for a checkpoint migrated offline, from what and how it is stored (``verify``,
    ``inspect``)."""
    if not migrated_from:
        return f"saved at DP={saved_dp}"
    return (f"saved at DP={saved_dp} by {migrated_from.get('format', 'another writer')} (migrated offline into zero_bnb's "
            f"format, stored as DP={stored_dp}; it loads at any DP size)")


def _print_summary(summary: dict[str, Any]) -> None:
    print(f"checkpoint {summary['path']} (tag {summary['tag']}, format {summary['format_version']})")
    print(f"  {_saved_at(summary['saved_dp_size'], summary['stored_dp_size'], summary['migrated_from'])}, "
          f"block size {summary['block_size']}, "
          f"{summary['parameters']:,} parameters, {_size(summary['bytes'])} on disk in {len(summary['files'])} files")
    print("  bytes: " + ", ".join(f"{kind} {_size(count)}" for kind, count in summary["bytes_by_kind"].items()))
    print(f"  optimizer {summary['optimizer_class']} ({summary['optimizer_family']})")
    print("  versions " + ", ".join(f"{k} {v}" for k, v in sorted(summary["versions"].items())))
    if summary["non_finite"]:
        print(f"  WARNING: saved with NaN/Inf in {summary['non_finite']}")
    for index, group in enumerate(summary["groups"]):
        precision = "8-bit" if any(s["8bit"] for s in group["states"]) else "fp32"
        hyper = dict(group["hyperparameters"])
        plan = hyper.pop("state_precision", None)
        if isinstance(plan, dict) and all(isinstance(plan.get(k), int) for k in ("partition_numel", "min_8bit_size")):
            limit = plan.get("eight_bit_up_to_dp")
            if plan.get("decided_on") == "whole parameter":  # ZeRO stage 3
                precision += (f" (parameter {group['numel']:,} elements vs min_8bit_size {plan['min_8bit_size']:,}, "
                              f"optim_bits {plan.get('optim_bits')}; decided on the whole parameter: the same at "
                              f"every DP size)")
            else:
                precision += (f" (partition {plan['partition_numel']:,} elements vs min_8bit_size "
                              f"{plan['min_8bit_size']:,}, optim_bits {plan.get('optim_bits')}; "
                              + (f"8-bit while DP <= {limit})" if isinstance(limit, int) else "fp32 at every DP size)"))
        print(f"  group {index}: {group['numel']:,} elements, {len(group['parameters'])} parameters, "
              f"state {precision}, hyper-parameters {hyper}")
        for param in group["parameters"]:
            print(f"    {param['name']:<40} {tuple(param['shape'])!s:<18} offset {param['offset']:,}")
        masters = group["masters"]
        print(f"    masters {masters['storage']:<30} {_size(masters['bytes']):>14}  ("
              + _MASTERS.get(masters["storage"], "") + ")")
        for state in group["states"]:
            print(f"    state {state['key']:<10} {state['kind']:<13} {state['dtype']:<8} {_size(state['bytes']):>14}"
                  f"  ({state['reason']})")


def _print_report(report: dict[str, Any]) -> None:
    for key, value in report.items():
        print(f"{key}: {value}")


def run(args: argparse.Namespace) -> int:
    """Run one checkpoint command; returns the exit code."""
    with noting_publications() as published:
        try:
            return _run(args)
        except KeyboardInterrupt as interrupt:
            what = "terminated" if isinstance(interrupt, Terminated) else "interrupted"
            print(f"zero-bnb {args.command}: {what}{_interrupted_after(published)}", file=sys.stderr)
            return EXIT_INTERRUPTED


def _interrupted_after(published: list[Publication]) -> str:
    """What an interrupt left, told by the outputs published before it (see :func:`noting_publications`)."""
    if not published:
        return "; nothing was published and temporary files were removed"
    unsynced = [record.path for record in published if not record.durable]
    if unsynced:  # between the rename and the sync of its folder
        return (f" after {', '.join(unsynced)} was renamed into place: the new output is there and complete, but the "
                f"interrupt came before the folder naming it was synced to disk, so a power failure or crash of the "
                f"machine may still bring back the previous one. Run `sync` to make it durable")
    return (f" after {', '.join(record.path for record in published)} was published complete; only tidying after it "
            f"was cut short")


def _run(args: argparse.Namespace) -> int:
    # inspect and verify import neither DeepSpeed nor bitsandbytes: the other commands load them when they run.
    try:
        if args.command == "convert" and args.target == "universal" and args.out_tag is not None:
            raise CheckpointUsageError("--out-tag applies to --to zero_bnb; with --to universal, OUT itself is the tag "
                                       "folder to create (its last path component is the tag)")
        if args.command == "inspect":
            from zero_bnb.tools import views

            summary = views.inspect_checkpoint(args.checkpoint, args.tag)
            if args.json:
                print(json.dumps(summary, indent=1))
            else:
                _print_summary(summary)
        elif args.command == "verify":
            checkpoint, notes = checkpoint_paths.verify_target(args.checkpoint, args.tag)
            for note in notes:
                print(note)
            checkpoint_paths.require_zero_bnb(checkpoint, args.tag, "verify")
            save_dir, tag = checkpoint_paths.locate(checkpoint, args.tag)
            reader = verify_checkpoint(save_dir, tag, progress=True)
            folder, manifest = reader.tag_folder, reader.manifest
            print(f"OK: {folder}: {len(manifest.files)} files match their digests, manifest format "
                  f"{manifest.format_version}, "
                  f"{_saved_at(manifest.saved_dp_size, manifest.dp_world_size, manifest.migrated_from)}")
        elif args.command == "convert" and args.target == "universal":
            from zero_bnb.tools import convert

            _print_report(convert.to_universal(args.checkpoint, args.out, tag=args.tag, force=args.force,
                                               progress=True))
        elif args.command == "convert":
            _print_report(_to_zero_bnb(args))
        else:
            from zero_bnb.tools import views

            _print_report(views.export_fp32(args.checkpoint, args.out, tag=args.tag, moments_too=args.moments,
                                              force=args.force, progress=True))
    except BrokenPipeError:
        raise  # stdout's reader is gone (``| head``): zero_bnb.cli.main ends quietly, this is no checkpoint error
    except CheckpointUsageError as error:
        _print_error(args.command, error)
        return EXIT_USAGE
    except (CheckpointError, UnsupportedOptimizerError, OSError) as error:
        _print_error(args.command, error)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _print_error(command: str, error: Exception) -> None:
    text = " ".join(str(error).split())  # one line, whatever the message holds
    print(f"zero-bnb {command}: {type(error).__name__}: {text}", file=sys.stderr)


def _to_zero_bnb(args: argparse.Namespace) -> dict[str, Any]:
    from zero_bnb.tools import convert

    kind = checkpoint_paths.detect(args.checkpoint, args.tag)
    if kind == "universal":
        return convert.from_universal(args.checkpoint, args.out, tag=args.tag, out_tag=args.out_tag,
                                      optimizer=args.optimizer or "AdamW8bit", force=args.force, progress=True)
    if kind == "stock":
        return convert.rescue_stock(args.checkpoint, args.out, tag=args.tag, out_tag=args.out_tag, force=args.force,
                                    optimizer=args.optimizer)
    raise CheckpointUsageError(f"{args.checkpoint} is already a zero_bnb checkpoint; it loads at any DP size as it is")
