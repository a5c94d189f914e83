"""DP > 1 on a machine with one GPU (issue 45, point 5): every rank on ``cuda:0``, over gloo.

    python benchmarks/gpu/multi_rank.py OUT.json            # on a machine with a CUDA device
    python benchmarks/gpu/multi_rank.py OUT.json --dry-run  # no GPU: "GPU" ranks on the CPU, 1 case, no CPU load

NCCL refuses two ranks on one device; gloo takes CUDA tensors for some collectives. First a probe: 2 ranks on
``cuda:0`` try each collective ZeRO uses on CUDA tensors and record which work (and the error of those that do not).
Then, per case (stages 1-3, fp32/bf16, a synchronous and an asynchronous save, zero_bnb's Triton update): DP=2 ranks on
the GPU train, save, record their whole optimizer state and train on (the uninterrupted run); DP=3 ranks on the GPU
load that checkpoint, record the state and train on; DP=2 CPU ranks load it too. Checked: the state after both loads
equals the saved one bit for bit (zero_bnb's gather). Reported beside it: the resumed DP=3 losses against the
uninterrupted DP=2 ones (another DP size: another reduction order, so not expected bit-identical), the time
``save_checkpoint`` blocked, synchronous against asynchronous, and rank 0's peak GPU memory in each phase
(construction, first step, steady steps, save) with DeepSpeed's buckets as the toy model sizes them. Writes OUT.json,
prints a table, exits 1 if a case fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from cross_device import (AFTER, BEFORE, CASES as CROSS_DEVICE_CASES, each_case, build_engine, arguments,  # noqa: E402
                          case_entry, load_sides, print_problems, run_launches)

#: DeepSpeed's bucket sizes (elements) sized to the toy model (33,946 parameters), not its defaults of 5e8 (a 1 GB bf16
#: buffer per rank at ZeRO-2, which would hide everything else in the memory figures).
BUCKET = 1 << 16
#: The cases: cross_device's, plus one with zero_bnb's Triton update (``zero_gpu_update: "fused"``).
CASES = {case: CROSS_DEVICE_CASES[case] for case in ("fp32-zero1", "bf16-zero2", "bf16-zero3", "bf16-zero1-async",
                                                      "bf16-zero3-async")}
CASES["bf16-zero2-triton"] = ("Adam8bit", {**CROSS_DEVICE_CASES["bf16-zero2"][1], "zero_gpu_update": "fused"}, "toy")
CASES = {case: (optimizer, {**extra, "zero_optimization": {**extra["zero_optimization"], "reduce_bucket_size": BUCKET,
                                                           "allgather_bucket_size": BUCKET}}, kind)
         for case, (optimizer, extra, kind) in CASES.items()}
DRY_RUN_CASES = ("fp32-zero1",)
#: The collectives probed on CUDA tensors, as torch.distributed calls on a 4-element tensor per rank.
PROBES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
          "barrier")


def probe(rank: int, world: int, workdir: str) -> None:
    """Try each collective of :data:`PROBES` on tensors of this rank's device; rank 0 records the outcome."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    found = {"device": str(device), "backend": dist.get_backend()}
    for name in PROBES:
        x = torch.full((4,), float(rank + 1), device=device)
        try:
            if name == "all_reduce":
                dist.all_reduce(x)
                ok = x.tolist() == [float(sum(range(1, world + 1)))] * 4
            elif name == "broadcast":
                dist.broadcast(x, 0)
                ok = x.tolist() == [1.0] * 4
            elif name == "all_gather":
                out = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(out, x)
                ok = [t[0].item() for t in out] == [float(r + 1) for r in range(world)]
            elif name == "all_gather_into_tensor":
                out = torch.empty(4 * world, device=device)
                dist.all_gather_into_tensor(out, x)
                ok = out[::4].tolist() == [float(r + 1) for r in range(world)]
            elif name == "reduce_scatter_tensor":
                out = torch.empty(4 // world if 4 % world == 0 else 1, device=device)
                dist.reduce_scatter_tensor(out, torch.full((out.numel() * world,), float(rank + 1), device=device))
                ok = out.tolist() == [float(sum(range(1, world + 1)))] * out.numel()
            elif name == "reduce":
                dist.reduce(x, 0)
                ok = rank != 0 or x.tolist() == [float(sum(range(1, world + 1)))] * 4
            else:
                dist.barrier()
                ok = True
            found[name] = "ok" if ok else "wrong result"
        except Exception as error:  # noqa: BLE001 - recorded: which collective gloo refuses on this device
            found[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        dist.barrier()
    if rank == 0:
        with open(os.path.join(workdir, "probe.json"), "w") as handle:
            json.dump(found, handle)


class _Peaks:
    """This rank's peak GPU bytes allocated in each phase (nothing on the CPU): each :meth:`mark` ends one."""

    def __init__(self) -> None:
        self.found: dict[str, int] = {}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def mark(self, phase: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.found[phase] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()


def save_side(rank: int, world: int, workdir: str, cases: list[str]) -> None:
    from zero_bnb.testing.consolidate import consolidated_state
    from zero_bnb.testing.toy import DEFAULT_RUN, train_steps

    def body(case):
        peaks = _Peaks()
        engine = build_engine(world, case, CASES)
        try:
            peaks.mark("construction")
            losses = train_steps(engine, DEFAULT_RUN, 0, 1)
            peaks.mark("first step")
            losses += train_steps(engine, DEFAULT_RUN, 1, BEFORE - 1)
            peaks.mark("steady")
            started = time.perf_counter()
            engine.save_checkpoint(os.path.join(workdir, case), tag="dp2")
            blocked = time.perf_counter() - started
            saved = consolidated_state(engine)
            losses += train_steps(engine, DEFAULT_RUN, BEFORE, AFTER)
            engine.wait_for_checkpoint()
            peaks.mark("save")
            import zero_bnb

            return {"saved": saved, "losses": losses, "save_blocked_s": blocked, "device": str(engine.device),
                    "update_kernels": zero_bnb.describe(engine)["update_kernels"], "peak_bytes": peaks.found}
        finally:
            engine.destroy()

    each_case(workdir, f"save_dp{world}", cases, body)


def load_side(rank: int, world: int, workdir: str, cases: list[str], side: str) -> None:
    from zero_bnb.testing.consolidate import consolidated_state
    from zero_bnb.testing.toy import DEFAULT_RUN, train_steps

    def body(case):
        engine = build_engine(world, case, CASES)
        try:
            engine.load_checkpoint(os.path.join(workdir, case), tag="dp2")
            loaded = consolidated_state(engine)
            losses = train_steps(engine, DEFAULT_RUN, engine.global_steps, AFTER)
            return {"loaded": loaded, "losses": losses, "device": str(engine.device)}
        finally:
            engine.destroy()

    each_case(workdir, side, cases, body)


def verdicts(workdir: str, cases: list[str], dry_run: bool = False) -> dict:
    from zero_bnb.testing.consolidate import state_differences

    sides = load_sides(workdir, ("save_dp2", "gpu_dp3", "cpu_dp2"))
    report = {}
    for case in cases:
        # a dry run's "GPU" ranks are CPU ranks already: no separate CPU load
        report[case] = entry = case_entry(sides, case, needed=2 if dry_run else 3)
        if "errors" in entry:
            continue
        saved = sides["save_dp2"][case]
        checked, on_gpu = state_differences(saved["saved"], sides["gpu_dp3"][case]["loaded"])
        on_cpu = state_differences(saved["saved"], sides["cpu_dp2"][case]["loaded"])[1] if "cpu_dp2" in sides else []
        reference, resumed = saved["losses"][BEFORE:], sides["gpu_dp3"][case]["losses"]
        entry.update(tensors=checked, gpu_dp3_state_differs=on_gpu, cpu_dp2_state_differs=on_cpu,
                     save_blocked_s=round(saved["save_blocked_s"], 4), update_kernels=saved["update_kernels"],
                     rank0_peak_bytes_by_phase=saved.get("peak_bytes"),
                     resumed_dp3_losses=resumed, uninterrupted_dp2_losses=reference,
                     worst_relative_loss_difference=max(abs(r - u) / abs(u) for u, r in zip(reference, resumed)),
                     ok=checked > 0 and not on_gpu and not on_cpu)
    return report


def main(argv: list[str] | None = None) -> int:
    args, cases = arguments(argv, __doc__, CASES, DRY_RUN_CASES, "no GPU: the GPU ranks run on the CPU")
    device = "cpu" if args.dry_run else "cuda-shared"
    if device != "cpu" and not torch.cuda.is_available():
        print("multi_rank: no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    launches = [("probe", probe, 2, device, ()), ("save_dp2", save_side, 2, device, (cases,)),
                ("gpu_dp3", load_side, 3, device, (cases, "gpu_dp3"))]
    if not args.dry_run:
        launches.append(("cpu_dp2", load_side, 2, "cpu", (cases, "cpu_dp2")))

    def report(workdir: str, timings: dict) -> dict:
        probe_path = os.path.join(workdir, "probe.json")
        with open(probe_path) if os.path.exists(probe_path) else contextlib.nullcontext() as handle:
            probed = json.load(handle) if handle else None
        return {"device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu (dry run)",
                "torch": torch.__version__, "launch_seconds": timings, "gloo_collectives": probed,
                "cases": verdicts(workdir, cases, args.dry_run)}

    report = run_launches("multi_rank", launches, report)
    timings = report["launch_seconds"]
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    print(f"multi_rank on {report['device']}, torch {report['torch']} (launches: {timings})")
    print(f"gloo collectives on {device} tensors: {report['gloo_collectives']}")
    print(f"{'case':<20} {'ok':<4} {'tensors':>7} {'save blocked s':>14} {'worst loss diff DP3':>19}")
    for case, entry in report["cases"].items():
        print(f"{case:<20} {'yes' if entry['ok'] else 'NO':<4} {entry.get('tensors', '-'):>7} "
              f"{entry.get('save_blocked_s', float('nan')):>14.4f} "
              f"{entry.get('worst_relative_loss_difference', float('nan')):>19.3g}")
        print_problems(entry, ("gpu_dp3_state_differs", "cpu_dp2_state_differs"))
    return 0 if report["cases"] and all(entry["ok"] for entry in report["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
