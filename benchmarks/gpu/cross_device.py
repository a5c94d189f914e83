"""Cross-device elastic check: save on the GPU at DP=1, load on CPU ranks at DP=3 and save again, load back on the GPU.

    python benchmarks/gpu/cross_device.py OUT.json            # on a machine with a CUDA device
    python benchmarks/gpu/cross_device.py OUT.json --dry-run  # CPU only: the "GPU" sides on a CPU rank, 3 cases

For every case (fp32/bf16/fp16 x ZeRO stages 1/2/3, optimizer offload, a paged optimizer over >= 1e5 elements,
and five of them saving asynchronously, training on while the checkpoint is written):
the GPU run trains, saves, records its whole optimizer state and trains on (the uninterrupted reference); 3 CPU
ranks (gloo) load that checkpoint, check the state, save it again; the GPU loads the CPU ranks' checkpoint and
trains on. Checked: the state on the CPU ranks and back on the GPU equals the saved one bit for bit, and the
resumed losses equal the uninterrupted ones (same device, same DP size, same state: expected bit-identical).
Three launches serve every case; one case that fails is recorded and the others go on. Writes OUT.json, prints a
table, exits 1 if any case is not bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from zero_bnb.testing.launch import run_distributed  # noqa: E402

BEFORE, AFTER = 4, 3
FP16 = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 2}
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
#: name -> (bitsandbytes optimizer class, extra config, model). "wide": group 0 holds 161,792 elements, so at DP=1 on
#: a GPU bitsandbytes pages the paged optimizers' state (>= 1e5 elements); on the CPU ranks it is plain.
CASES = {
    **{f"{precision}-zero{stage}": ("Adam8bit", {**section, "zero_optimization": {"stage": stage}}, "toy")
       for precision, section in (("fp32", {}), ("bf16", {"bf16": {"enabled": True}}), ("fp16", {"fp16": FP16}))
       for stage in (1, 2, 3)},
    "bf16-zero2-offload": ("AdamW8bit", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, **OFFLOAD}}, "toy"),
    "paged-fp32-zero1": ("PagedAdamW8bit", {"zero_optimization": {"stage": 1}}, "wide"),
    "paged-bf16-zero2": ("PagedLion8bit", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "wide"),
}
#: The same with asynchronous saves (``zero_checkpoint_async``): staged into pinned host buffers on the GPU, written
#: while the run trains on; the checkpoint must still hold the state at the call, bit for bit.
CASES.update({f"{case}-async": (optimizer, {**extra, "zero_checkpoint_async": True}, kind)
              for case, (optimizer, extra, kind) in list(CASES.items())
              if case in ("bf16-zero1", "fp16-zero2", "bf16-zero3", "bf16-zero2-offload", "paged-bf16-zero2")})
DRY_RUN_CASES = ("fp32-zero1", "fp16-zero2", "bf16-zero3", "bf16-zero1-async")


def _model(kind: str) -> torch.nn.Module:
    from zero_bnb.testing.toy import IN_FEATURES, build_model

    if kind == "toy":
        return build_model()
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 90))


def build_engine(dp: int, case: str, cases: dict | None = None):
    import bitsandbytes as bnb

    import zero_bnb
    from zero_bnb.testing.cpu_fp16 import allow_fp16_on_cpu
    from zero_bnb.testing.toy import DEFAULT_RUN, LEARNING_RATE, param_groups

    allow_fp16_on_cpu()  # fp16 checkpoints load on the CPU ranks too
    optimizer_name, extra, kind = (cases or CASES)[case]
    model = _model(kind)
    # min_8bit_size 2048: every group keeps one precision at DP=1 and DP=3 (bitsandbytes' default 4096 puts the toy's
    # last layer, 2,880 elements a rank at DP=3, in fp32 there, and the way back requantizes it: exact state is kept
    # only while a partition keeps its precision; the wide model's biases, 1,024 padded elements at DP=1, go fp32).
    optimizer = getattr(bnb.optim, optimizer_name)(param_groups(model), lr=LEARNING_RATE, min_8bit_size=2048)
    config = DEFAULT_RUN.ds_config(dp, **extra)
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _paged(engine) -> bool:
    state = engine.optimizer.optimizer.state
    return any(getattr(value, "is_paged", False) for entry in state.values() for value in entry.values())


def each_case(workdir: str, side: str, cases: list[str], body) -> None:
    """Run ``body(case)`` for every case; record its result or its error in ``workdir/<side>.pt`` (rank 0)."""
    import torch.distributed as dist

    results = {}
    for case in cases:
        started = time.perf_counter()
        try:
            results[case] = body(case)
        except Exception:  # noqa: BLE001 - recorded; the other cases go on
            results[case] = {"error": traceback.format_exc(limit=6)}
        results[case]["seconds"] = time.perf_counter() - started
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(workdir, f"{side}.pt"))


def gpu_save(rank: int, world: int, workdir: str, cases: list[str]) -> None:
    from zero_bnb.testing.consolidate import consolidated_state
    from zero_bnb.testing.toy import DEFAULT_RUN, train_steps

    def body(case):
        engine = build_engine(world, case)
        try:
            losses = train_steps(engine, DEFAULT_RUN, 0, BEFORE)
            engine.save_checkpoint(os.path.join(workdir, case), tag="gpu")
            saved = consolidated_state(engine)
            paged = _paged(engine)
            losses += train_steps(engine, DEFAULT_RUN, BEFORE, AFTER)
            engine.wait_for_checkpoint()  # an asynchronous save's failure is raised here, not "tag not found" later
            return {"saved": saved, "losses": losses, "paged": paged, "device": str(engine.device)}
        finally:
            engine.destroy()

    each_case(workdir, "gpu_save", cases, body)


def cpu_resave(rank: int, world: int, workdir: str, cases: list[str]) -> None:
    from zero_bnb.testing.consolidate import consolidated_state

    def body(case):
        engine = build_engine(world, case)
        try:
            engine.load_checkpoint(os.path.join(workdir, case), tag="gpu")
            loaded = consolidated_state(engine)
            engine.save_checkpoint(os.path.join(workdir, case), tag="cpu")
            engine.wait_for_checkpoint()
            return {"loaded": loaded, "device": str(engine.device)}
        finally:
            engine.destroy()

    each_case(workdir, "cpu_resave", cases, body)


def gpu_resume(rank: int, world: int, workdir: str, cases: list[str]) -> None:
    from zero_bnb.testing.consolidate import consolidated_state
    from zero_bnb.testing.toy import DEFAULT_RUN, train_steps

    def body(case):
        engine = build_engine(world, case)
        try:
            engine.load_checkpoint(os.path.join(workdir, case), tag="cpu")
            loaded = consolidated_state(engine)
            paged = _paged(engine)
            losses = train_steps(engine, DEFAULT_RUN, engine.global_steps, AFTER)
            return {"loaded": loaded, "losses": losses, "paged": paged, "device": str(engine.device)}
        finally:
            engine.destroy()

    each_case(workdir, "gpu_resume", cases, body)


def load_sides(workdir: str, names: tuple[str, ...]) -> dict:
    """The results each launch of ``names`` recorded (:func:`each_case`), of those that recorded any."""
    return {side: torch.load(os.path.join(workdir, f"{side}.pt"), weights_only=False)
            for side in names if os.path.exists(os.path.join(workdir, f"{side}.pt"))}


def case_entry(sides: dict, case: str, needed: int) -> dict:
    """A case's report entry: each side's seconds and device, and ``ok=False`` with ``errors`` where a side failed or
    fewer than ``needed`` sides ran."""
    entry = {side: {"seconds": round(results[case]["seconds"], 2), "device": results[case].get("device")}
             for side, results in sides.items() if case in results}
    errors = {side: results[case]["error"] for side, results in sides.items()
              if case in results and "error" in results[case]}
    if errors or len(sides) < needed:
        entry.update(ok=False, errors=errors or {"missing": f"sides run: {sorted(sides)}"})
    return entry


def verdicts(workdir: str, cases: list[str]) -> dict:
    """Per case: the state on the CPU ranks and back on the GPU vs the saved one, and the resumed losses."""
    from zero_bnb.testing.consolidate import state_differences

    sides = load_sides(workdir, ("gpu_save", "cpu_resave", "gpu_resume"))
    report = {}
    for case in cases:
        report[case] = entry = case_entry(sides, case, needed=3)
        if "errors" in entry:
            continue
        saved, cpu, back = sides["gpu_save"][case], sides["cpu_resave"][case], sides["gpu_resume"][case]
        checked, on_cpu = state_differences(saved["saved"], cpu["loaded"])
        _, on_gpu = state_differences(saved["saved"], back["loaded"])
        reference = saved["losses"][BEFORE:]
        worst = max(abs(r - u) / abs(u) for u, r in zip(reference, back["losses"]))
        entry.update(tensors=checked, cpu_state_differs=on_cpu, gpu_state_differs=on_gpu, paged_on_save=saved["paged"],
                     paged_on_resume=back["paged"], resumed_losses=back["losses"], uninterrupted_losses=reference,
                     worst_relative_loss_difference=worst,
                     ok=checked > 0 and not on_cpu and not on_gpu and worst == 0.0)
    return report


def arguments(argv: list[str] | None, doc: str, cases: dict, dry_run_cases: tuple[str, ...],
              dry_run_help: str) -> tuple[argparse.Namespace, list[str]]:
    """The command line of a case-by-case GPU check (this one, ``multi_rank.py``): OUT, ``--dry-run``, ``--cases``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON report to write")
    parser.add_argument("--dry-run", action="store_true", help=dry_run_help)
    parser.add_argument("--cases", nargs="*", default=None, help=f"default: all ({', '.join(cases)})")
    args = parser.parse_args(argv)
    chosen = args.cases or list(dry_run_cases if args.dry_run else cases)
    unknown = [case for case in chosen if case not in cases]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(cases)}")
    return args, chosen


def run_launches(name: str, launches: list[tuple], body: Callable[[str, dict], dict]) -> dict:
    """Run each ``(side, fn, world, device, extra args)`` launch in one scratch folder (its "pid" file lets check.sh
    remove it only once this process is gone); a launch that dies is named and the others go on. Returns
    ``body(folder, seconds per launch)`` (the report, made before the folder is removed)."""
    workdir = tempfile.mkdtemp(prefix="zero_bnb_cross_device_")
    with open(os.path.join(workdir, "pid"), "w") as handle:
        handle.write(str(os.getpid()))
    timings = {}
    try:
        for side, fn, world, where, extra in launches:
            started = time.perf_counter()
            try:
                run_distributed(fn, world, workdir, *extra, device=where)
            except Exception as error:  # noqa: BLE001 - the report names the side that died
                print(f"{name}: the {side} launch failed: {error}", file=sys.stderr)
            timings[side] = round(time.perf_counter() - started, 1)
        return body(workdir, timings)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args, cases = arguments(argv, __doc__, CASES, DRY_RUN_CASES, "no GPU: the GPU sides run on one CPU rank")
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("cross_device: no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    launches = [("gpu_save", gpu_save, 1, device, (cases,)), ("cpu_resave", cpu_resave, 3, "cpu", (cases,)),
                ("gpu_resume", gpu_resume, 1, device, (cases,))]
    report = run_launches("cross_device", launches, lambda workdir, timings: {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)", "launch_seconds": timings,
        "cases": verdicts(workdir, cases)})
    timings = report["launch_seconds"]
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    print(f"cross_device on {report['device']} (launches: {timings})")
    print(f"{'case':<22} {'ok':<4} {'tensors':>7} {'paged':>11} {'worst loss diff':>15}  seconds (save/cpu/resume)")
    for case, entry in report["cases"].items():
        paged = f"{entry.get('paged_on_save')}/{entry.get('paged_on_resume')}"
        seconds = "/".join(str(entry.get(side, {}).get("seconds")) for side in ("gpu_save", "cpu_resave", "gpu_resume"))
        print(f"{case:<22} {'yes' if entry['ok'] else 'NO':<4} {entry.get('tensors', '-'):>7} {paged:>11} "
              f"{entry.get('worst_relative_loss_difference', float('nan')):>15.3g}  {seconds}")
        print_problems(entry, ("cpu_state_differs", "gpu_state_differs"))
    return 0 if all(entry["ok"] for entry in report["cases"].values()) else 1


def print_problems(entry: dict, differs: tuple[str, ...]) -> None:
    """Print under a case's row the last line of each side's error and the first tensors that differ."""
    for side, text in entry.get("errors", {}).items():
        print(f"  {side}: {text.strip().splitlines()[-1]}")
    for key in differs:
        if entry.get(key):
            print(f"  {key}: {entry[key][:5]}")


if __name__ == "__main__":
    sys.exit(main())
