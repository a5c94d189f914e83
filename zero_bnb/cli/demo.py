"""The elastic-resume demo: Adam8bit at DP=2, checkpoint, resume at DP=3 with gradient
accumulation adjusted so the global batch stays the same, and compare with the run that
never stopped: optimizer state bit for bit, then the loss curve (table and PNG).
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from zero_bnb.format.publish import replacing
from zero_bnb.testing.consolidate import state_differences
from zero_bnb.testing.launch import run_distributed
from zero_bnb.testing.toy import DEFAULT_RUN as RUN

__all__ = ["LOSS_BOUND", "relative_differences", "report", "run_demo"]

#: Largest relative difference of a resumed loss from the uninterrupted run that the demo accepts. Measured with the
#: defaults (12 + 12 steps, DP=2 -> 3, the fused CPU 8-bit update) under seven instruction-set variants of one machine
#: (docs/bounds.md, 2026-11-27): 1.24e-4 natively (step 19), worst 2.26e-4 (AVX2 kernels); the first resumed step 0
#: in every variant (the same per-sample losses summed by 3 ranks instead of 2: at most an ulp). Reduction-order noise
#: that moves an 8-bit code across a rounding boundary grows with steps; the bound is 5.3x the worst.
LOSS_BOUND = 1.2e-3


def _engine(dp: int):
    import bitsandbytes as bnb

    from zero_bnb.testing.toy import build_engine

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return build_engine(dp, bnb.optim.Adam8bit, zero_unsharded_state_keys=["qmap1", "qmap2"])


def _uninterrupted(rank: int, world: int, out: str, before: int, after: int) -> None:
    from zero_bnb.testing.consolidate import consolidated_state
    from zero_bnb.testing.toy import train_steps

    engine = _engine(world)
    losses = train_steps(engine, RUN, 0, before)
    engine.save_checkpoint(os.path.join(out, "checkpoints"), tag=f"step{before}")
    saved = consolidated_state(engine)
    losses += train_steps(engine, RUN, before, after)
    if rank == 0:
        with replacing(os.path.join(out, "uninterrupted.pt")) as temporary:
            torch.save({"saved": saved, "losses": losses}, temporary)


def _resumed(rank: int, world: int, out: str, before: int, after: int) -> None:
    from zero_bnb.testing.consolidate import consolidated_state
    from zero_bnb.testing.toy import train_steps

    engine = _engine(world)
    engine.load_checkpoint(os.path.join(out, "checkpoints"))
    loaded = consolidated_state(engine)
    resumed_at = engine.global_steps
    losses = train_steps(engine, RUN, resumed_at, after)
    if rank == 0:
        with replacing(os.path.join(out, "resumed.pt")) as temporary:
            torch.save({"loaded": loaded, "losses": losses, "global_steps": resumed_at}, temporary)



def _plot(path: str, steps: list[int], reference: list[float], resumed: list[float], before: int, dps) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(steps, reference, "o-", label=f"uninterrupted, DP={dps[0]}")
    axis.plot(steps[before:], resumed, "x--", label=f"resumed from step {before} at DP={dps[1]}")
    axis.axvline(before - 0.5, color="grey", linestyle=":", label="checkpoint")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss (global batch mean)")
    axis.set_title("zero_bnb: Adam8bit under ZeRO-1, elastic resume")
    axis.legend()
    figure.tight_layout()
    with replacing(path) as temporary:
        figure.savefig(temporary, dpi=120, format="png")
    plt.close(figure)


def relative_differences(reference: list[float], resumed: list[float]) -> list[float]:
    """``|resumed - reference| / |reference|`` of each resumed step (``reference`` holds every step from 0)."""
    return [abs(res - ref) / abs(ref) for ref, res in zip(reference[len(reference) - len(resumed):], resumed)]


def run_demo(out: str, before: int, after: int, save_dp: int = 2, resume_dp: int = 3,
             loss_bound: float = LOSS_BOUND) -> int:
    """Run the demo on CPU processes; returns 0 when the resumed state is bit-identical and every resumed loss is
    within ``loss_bound`` (relative) of the uninterrupted run, else 1."""
    out = os.path.abspath(out)
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    print(f"zero_bnb demo: {before} steps at DP={save_dp} (grad accum {RUN.grad_accum(save_dp)}), checkpoint, "
          f"then {after} steps resumed at DP={resume_dp} (grad accum {RUN.grad_accum(resume_dp)}); "
          f"global batch {RUN.global_batch_size} throughout")
    if torch.cuda.is_available():
        print(f"the ranks are CPU processes (gloo), whatever GPUs this machine has ({torch.cuda.device_count()} here): "
              f"the demo needs {max(save_dp, resume_dp)} ranks and shows the same on any machine; "
              f"benchmarks/gpu/check.sh runs the GPU checks")
    run_distributed(_uninterrupted, save_dp, out, before, after)
    run_distributed(_resumed, resume_dp, out, before, after)
    return report(out, before, save_dp, resume_dp, loss_bound)


def report(out: str, before: int, save_dp: int, resume_dp: int, loss_bound: float = LOSS_BOUND) -> int:
    """Compare the two runs' results in ``out`` (state, then losses), print the table, write the plot; the exit
    code of :func:`run_demo`."""
    reference = torch.load(os.path.join(out, "uninterrupted.pt"), weights_only=False)
    resumed = torch.load(os.path.join(out, "resumed.pt"), weights_only=False)

    checked, different = state_differences(reference["saved"], resumed["loaded"])
    verdict = "bit-identical" if not different else f"DIFFERENT: {different}"
    print(f"\nstate after load at DP={resume_dp}: {checked} tensors (fp32 master weights and dequantized Adam "
          f"moments of every parameter) + step counters: {verdict}")
    print(f"resumed at global step {resumed['global_steps']} (saved at {before})\n")

    steps = list(range(len(reference["losses"])))
    relative = relative_differences(reference["losses"], resumed["losses"])
    print(f"{'step':>4}  {'uninterrupted DP=' + str(save_dp):>20}  {'resumed DP=' + str(resume_dp):>16}  {'rel. diff':>9}")
    for step in steps:
        ref = reference["losses"][step]
        if step < before:
            print(f"{step:>4}  {ref:>20.6f}  {'':>16}  {'':>9}")
        else:
            res = resumed["losses"][step - before]
            print(f"{step:>4}  {ref:>20.6f}  {res:>16.6f}  {relative[step - before]:>9.2e}")
    plot = os.path.join(out, "elastic_resume.png")
    _plot(plot, steps, reference["losses"], resumed["losses"], before, (save_dp, resume_dp))
    worst = max(relative, default=0.0)
    within = worst <= loss_bound
    print(f"\nresumed losses within {loss_bound:.1e} (relative) of the uninterrupted run: "
          f"{'yes' if within else 'NO'} (largest difference {worst:.2e})")
    print(f"plot: {plot}\ncheckpoint: {os.path.join(out, 'checkpoints')}")
    return 0 if not different and within else 1
