"""The batch geometry a checkpoint was saved with, and the warning when a resume changes it.

Trainer and Accelerate skip ``global_step x gradient_accumulation_steps`` micro-batches per
rank on resume; that lands on the right sample only when the global batch (micro batch x
accumulation x DP size) is unchanged. zero_bnb records the geometry in the manifest and
warns, with both values and the accumulation that keeps it, when a resume changes it. A
deliberate batch-size ramp-up stays legal: it is a warning, not an error.

The warning speaks the words of the front door that built the engine (:data:`FRONT_DOORS`):
Lightning's knob is ``accumulate_grad_batches``, Trainer's ``TrainingArguments``, plain
DeepSpeed's the config key.

Local, no collectives.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from zero_bnb.format.manifest import Manifest

__all__ = ["FRONT_DOORS", "FrontDoor", "batch_of", "warn_if_batch_changed"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FrontDoor:
    """How one front door names the accumulation setting, and what its resume does with the data."""

    #: The instruction that sets the accumulation to ``{steps}``.
    set_accumulation: str
    #: What a changed global batch does to this front door's resume.
    consequence: str


_TRAINER_SKIPS = ("Trainer skips global_step x gradient_accumulation_steps micro-batches per process on resume "
                  "assuming the global batch is unchanged, so this run now trains on other samples than an "
                  "uninterrupted one would")
_STEP_MEANS = "each optimizer step now averages another number of samples than the saved run's steps did"

#: Front doors by the name the engine records (``ZeroBnbEngine.zero_bnb_front_door``).
FRONT_DOORS = {
    "deepspeed": FrontDoor('set "gradient_accumulation_steps": {steps} in the DeepSpeed config',
                           _STEP_MEANS),
    "trainer": FrontDoor("set TrainingArguments(gradient_accumulation_steps={steps})",
                         _TRAINER_SKIPS),
    "accelerate": FrontDoor('set "gradient_accumulation_steps": {steps} in the DeepSpeed config given '
                            "to DeepSpeedPlugin (or DeepSpeedPlugin(gradient_accumulation_steps={steps}))",
                            "accelerator.skip_first_batches(loader, global_step x gradient_accumulation_steps) "
                            "assumes the global batch is unchanged, so it now lands on other samples than an "
                            "uninterrupted run would"),
    "lightning": FrontDoor("set pl.Trainer(accumulate_grad_batches={steps})", _STEP_MEANS),
}


def batch_of(engine: Any) -> dict[str, int]:
    """``{"global", "micro", "accumulation", "dp"}`` of a running DeepSpeed engine."""
    return {
        "global": int(engine.train_batch_size()),
        "micro": int(engine.train_micro_batch_size_per_gpu()),
        "accumulation": int(engine.gradient_accumulation_steps()),
        "dp": int(engine.optimizer.dp_size),
    }


def _describe(batch: dict[str, int]) -> str:
    return (f"global batch {batch['global']} (micro batch {batch['micro']} x accumulation {batch['accumulation']} "
            f"x DP {batch['dp']})")


def warn_if_batch_changed(manifest: Manifest, engine: Any, where: str, front_door: str = "deepspeed") -> bool:
    """Warn (rank 0 logs) when ``engine``'s global batch differs from the saved one; returns whether it does.

    ``front_door`` (a key of :data:`FRONT_DOORS`) chooses the words of the fix.
    """
    saved = getattr(manifest, "batch", None) or {}
    if "global" not in saved:
        return False  # stock DeepSpeed or an older zero_bnb checkpoint: nothing recorded
    now = batch_of(engine)
    if saved["global"] == now["global"]:
        return False
    door = FRONT_DOORS.get(front_door, FRONT_DOORS["deepspeed"])
    keep = saved["global"] / (now["micro"] * now["dp"])
    fix = (door.set_accumulation.format(steps=int(keep)) + f" (= {saved['global']} / (micro batch {now['micro']} x "
           f"DP {now['dp']}))" if keep == int(keep) and keep >= 1 else
           f"choose micro batch x accumulation x DP = {saved['global']}")
    if engine.global_rank == 0:
        logger.warning(
            "zero_bnb: %s was saved with %s; this run has %s. %s. To keep the global batch, %s. If the change is a "
            "deliberate batch-size ramp-up, ignore this warning.",
            where, _describe(saved), _describe(now), door.consequence, fix,
        )
    return True
