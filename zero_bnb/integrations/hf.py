"""Hugging Face Trainer glue, installed by :func:`zero_bnb.enable` when a Trainer calls ``deepspeed.initialize``.

``zero_bnb.enable()`` alone makes Trainer and Accelerate build zero_bnb engines. This module
adds one thing Trainer needs on resume: Trainer loads its own ``scheduler.pt`` after DeepSpeed's
checkpoint; one written by a stock DeepSpeed run (which drops bitsandbytes overrides) has
fewer per-group entries than zero_bnb's optimizer has groups, which
:func:`zero_bnb.integrations.scheduler_groups.fit_to_groups` repairs right after Trainer loads it.

Imported only when ``transformers.trainer`` is already loaded. Local, no collectives.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from zero_bnb.integrations.scheduler_groups import fit_to_groups

__all__ = ["install_trainer_patch", "remove_trainer_patch"]

_LOCK = threading.Lock()
_ORIGINAL: dict[str, Any] = {}


def _group_origin(trainer: Any):
    engine = getattr(trainer, "model_wrapped", None)
    optimizer = getattr(engine, "basic_optimizer", None)
    return getattr(optimizer, "zero_bnb_group_origin", None)


def install_trainer_patch() -> None:
    """Wrap ``Trainer._load_optimizer_and_scheduler`` (once) to fit the loaded scheduler to zero_bnb's groups."""
    from transformers import Trainer

    with _LOCK:
        if "load" in _ORIGINAL:
            return
        original = Trainer._load_optimizer_and_scheduler

        @functools.wraps(original)
        def load_optimizer_and_scheduler(self, checkpoint):
            result = original(self, checkpoint)
            origin = _group_origin(self)
            if checkpoint is not None and origin and getattr(self, "lr_scheduler", None) is not None:
                fit_to_groups(self.lr_scheduler, origin)
            return result

        _ORIGINAL["load"] = original
        Trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler


def remove_trainer_patch() -> None:
    """Undo :func:`install_trainer_patch` (a no-op when it is not installed)."""
    with _LOCK:
        original = _ORIGINAL.pop("load", None)
        if original is not None:
            from transformers import Trainer

            Trainer._load_optimizer_and_scheduler = original
