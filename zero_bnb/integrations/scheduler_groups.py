"""Per-group LR-scheduler state saved before zero_bnb isolated bitsandbytes overrides into groups of their own.

A scheduler keeps per-param-group lists (``base_lrs``, ``_last_lr``, ``min_lrs``). A run without
the isolation (stock DeepSpeed, which drops the overrides) saved them for fewer groups than
zero_bnb's optimizer has; loading such a state makes the next ``scheduler.step()`` fail
(``zip() argument 2 is shorter than argument 1``). :func:`fit_to_groups` extends each of those
lists: every group takes the entry of the user's group it came from.

Local, no collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["PER_GROUP_LISTS", "fit_to_groups"]

logger = logging.getLogger(__name__)

#: Scheduler attributes that hold one entry per param group (torch.optim.lr_scheduler).
PER_GROUP_LISTS = ("base_lrs", "_last_lr", "min_lrs", "default_min_lr")


def fit_to_groups(scheduler: Any, origin: Sequence[int]) -> list[str]:
    """Extend ``scheduler``'s per-group lists saved for the user's groups to zero_bnb's groups, in place.

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` scheduler after ``load_state_dict``.
        origin: for each of zero_bnb's groups, the index of the user's group it came from
            (``optimizer.zero_bnb_group_origin``).

    Returns:
        The attributes extended (empty when the state already fits).
    """
    user_groups = max(origin) + 1 if origin else 0
    extended = []
    for name in PER_GROUP_LISTS:
        value = getattr(scheduler, name, None)
        if isinstance(value, list) and len(value) == user_groups != len(origin):
            setattr(scheduler, name, [value[source] for source in origin])
            extended.append(name)
    if extended:
        logger.info("zero_bnb: LR scheduler state saved for %d param groups extended to %d (bitsandbytes overrides "
                    "in groups of their own): %s", user_groups, len(origin), extended)
    return extended
