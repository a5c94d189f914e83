"""What a load tells the user: rank 0's account of a ``load_checkpoint`` (where it came from, what was re-split,
what was not loaded as saved). Local."""

from __future__ import annotations

import logging

from zero_bnb.checkpoint.load import LoadPlan
from zero_bnb.checkpoint.model_file import saved_zero_stage
from zero_bnb.checkpoint.precision import describe_conversions
from zero_bnb.ds.describe import describe, update_kernels_line

__all__ = ["log_load"]

logger = logging.getLogger("zero_bnb.ds.engine")  # the engine's messages, as before the split


def log_load(engine, folder: str, plan: LoadPlan) -> None:
    """Rank 0's account of ``engine``'s load of ``folder``: one INFO line (saved and running DP size and ZeRO stage,
    what was re-split, the 8-bit state held now), and a WARNING naming the state not loaded as saved (dtypes,
    direction, why)."""
    restore, described = plan.optimizer, describe(engine)
    saved_stage, stage = saved_zero_stage(plan.model_states), described["zero_stage"]
    moved = "mapped by parameter name" if restore.regrouped else ""
    if saved_stage is not None and saved_stage != stage:
        layout = f"from ZeRO stage {saved_stage}: every tensor re-split" + (f", {moved}" if moved else "")
    elif restore.saved_dp == engine.optimizer.dp_size and not restore.regrouped:
        layout = "same partitions"
    else:
        layout = "every tensor re-split" + (f", {moved}" if moved else "")
    migrated = plan.saved.manifest.migrated_from  # a stock checkpoint rewritten offline: its own DP size
    saved_at = (f"DP={migrated.get('dp_world_size')} by {migrated.get('format')} (migrated offline, stored as "
                f"DP={restore.saved_dp})" if migrated else f"DP={restore.saved_dp}")
    logger.info(
        "zero_bnb: loaded checkpoint %s saved at %s into DP=%d at ZeRO stage %d (%s); %s; rank 0's optimizer "
        "state 8-bit in %d of %d groups, %.2f B/param; %s",
        folder, saved_at, engine.optimizer.dp_size, stage, layout,
        "optimizer state loaded" if restore.load_optimizer_states else "weights only",
        len(described["eight_bit_groups"]), len(described["groups"]), described["state_bytes_per_param"],
        update_kernels_line(engine, described),
    )
    converted = describe_conversions([group.conversions for group in restore.groups])
    if converted is not None:
        logger.warning(
            "zero_bnb: checkpoint %s (saved at %s, ZeRO stage %s; now DP=%d, ZeRO stage %d): %s", folder,
            saved_at, "unknown" if saved_stage is None else saved_stage, engine.optimizer.dp_size, stage,
            converted,
        )
