"""What a load did to optimizer state it could not copy as saved: the records and the sentence a user reads.

A moment is loaded in another form than the checkpoint holds it when the running optimizer keeps it in another
precision (bitsandbytes' ``min_8bit_size`` is decided per partition under ZeRO stages 1/2 and per whole parameter
at stage 3; a 32-bit override), or when the checkpoint's flat groups differ from the optimizer's and the state is
moved by parameter name (:mod:`zero_bnb.checkpoint.regroup`: 8-bit moments pass through fp32 and are quantized again
on the new block grid). Pure: no I/O, no collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Conversion", "describe_conversions"]

#: How many group indexes a message lists before it counts the rest.
LISTED_GROUPS = 8


@dataclass(frozen=True, slots=True)
class Conversion:
    """One element-wise state of one flat group, loaded in another form than saved.

    ``saved``: the dtype(s) the checkpoint holds it in (``"uint8"``: 8-bit codes; two when a regrouped group takes
    parameters from saved groups of both precisions); ``now``: the dtype the running optimizer holds;
    ``regrouped``: moved between flat groups by parameter name.
    """

    key: str
    saved: tuple[str, ...]
    now: str
    regrouped: bool

    @property
    def changes_precision(self) -> bool:
        return self.saved != (self.now,)


def _form(dtype: str) -> str:
    return "8-bit (uint8)" if dtype == "uint8" else {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
        dtype, dtype)


def _how(item: Conversion) -> str:
    if not item.changes_precision:
        return "regrouped by parameter name: dequantized, then quantized again once on this run's block grid"
    if item.now == "uint8":
        how = "quantized once"
    elif "uint8" in item.saved:
        how = "dequantized (exact)"
    else:
        how = "cast"
    reason = ("this run keeps it in another precision (bitsandbytes' min_8bit_size, decided per partition at ZeRO "
              "stages 1/2 and per whole parameter at stage 3, or a 32-bit override)")
    return f"{how}: {reason}" + ("; regrouped by parameter name" if item.regrouped else "")


def _indexes(groups: Sequence[int]) -> str:
    listed = ", ".join(map(str, groups[:LISTED_GROUPS]))
    more = len(groups) - LISTED_GROUPS
    return f"{'group' if len(groups) == 1 else 'groups'} {listed}" + (f" and {more} more" if more > 0 else "")


def describe_conversions(per_group: Sequence[Sequence[Conversion]]) -> str | None:
    """One sentence for the conversions of every flat group (``per_group[i]``: group ``i``'s), ``None`` for none.

    Conversions of the same form (saved dtypes, held dtype, regrouped or not) are told once, with their state keys
    and group indexes: ``"state1, state2: fp32 -> 8-bit (uint8) in group 5 (quantized once: ...)"``.
    """
    buckets: dict[tuple[tuple[str, ...], str, bool], tuple[set[str], list[int], Conversion]] = {}
    for index, conversions in enumerate(per_group):
        for item in conversions:
            keys, groups, _ = buckets.setdefault((item.saved, item.now, item.regrouped), (set(), [], item))
            keys.add(item.key)
            if not groups or groups[-1] != index:
                groups.append(index)
    if not buckets:
        return None
    converted = len({index for _, groups, _ in buckets.values() for index in groups})
    parts = [f"{', '.join(sorted(keys))}: {' and '.join(map(_form, saved))} -> {_form(now)} in {_indexes(groups)} "
             f"({_how(item)})" for (saved, now, _), (keys, groups, item) in buckets.items()]
    return f"optimizer state of {converted} of {len(per_group)} groups not loaded as saved: " + "; ".join(parts)
