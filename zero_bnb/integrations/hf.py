"""Hugging Face Trainer glue, installed by :func:`zero_bnb.enable` when a Trainer calls ``deepspeed.initialize``.

``zero_bnb.enable()`` alone makes Trainer and Accelerate build zero_bnb engines. This module
adds two things Trainer needs:

* on resume: Trainer loads its own ``scheduler.pt`` after DeepSpeed's checkpoint; one written by a stock
  DeepSpeed run (which drops bitsandbytes overrides) has fewer per-group entries than zero_bnb's optimizer has
  groups, which :func:`zero_bnb.integrations.scheduler_groups.fit_to_groups` repairs right after Trainer loads it;
* with asynchronous saves (``zero_checkpoint_async``): Trainer deletes checkpoints beyond ``save_total_limit``
  right after a save returns; the deletion is deferred until the new checkpoint is committed
  (:func:`zero_bnb.checkpoint.background.after_pending_saves`), so the last complete one is never removed first.
  Trainer's next save waits for a pending one before it writes anything: it writes the model weights into its new
  ``checkpoint-N`` folder before DeepSpeed's save would wait, and the deferred deletion, which sorts the folders by
  modification time (renewed by the pending save's commit), would take that newer folder for an older one.

Imported only when ``transformers.trainer`` is already loaded. Local, no collectives.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from zero_bnb.checkpoint.background import after_pending_saves, wait_for_pending_saves
from zero_bnb.integrations.scheduler_groups import fit_to_groups

__all__ = ["install_trainer_patch", "remove_trainer_patch"]

_LOCK = threading.Lock()
_ORIGINAL: dict[str, Any] = {}


def _group_origin(trainer: Any):
    engine = getattr(trainer, "model_wrapped", None)
    optimizer = getattr(engine, "basic_optimizer", None)
    return getattr(optimizer, "zero_bnb_group_origin", None)


def install_trainer_patch() -> None:
    """Wrap ``Trainer._load_optimizer_and_scheduler`` (once) to fit the loaded scheduler to zero_bnb's groups, and
    Trainer's checkpoint saves and deletion of old checkpoints to wait for a pending asynchronous save."""
    import transformers.trainer as trainer_module
    from transformers import Trainer

    with _LOCK:
        if "load" in _ORIGINAL:
            return
        # transformers 5 calls the module's rotate_checkpoints(); 4.x the method Trainer._rotate_checkpoints
        owner, name = ((trainer_module, "rotate_checkpoints") if hasattr(trainer_module, "rotate_checkpoints")
                       else (Trainer, "_rotate_checkpoints"))
        rotate = getattr(owner, name)

        @functools.wraps(rotate)
        def rotate_when_committed(*args, **kwargs):
            after_pending_saves(lambda: rotate(*args, **kwargs), "Trainer's deletion of checkpoints beyond save_total_limit")

        _ORIGINAL["rotate"] = (owner, name, rotate)
        setattr(owner, name, rotate_when_committed)
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
        save = Trainer._save_checkpoint

        @functools.wraps(save)
        def save_checkpoint_after_pending(self, *args, **kwargs):
            wait_for_pending_saves()  # a failed asynchronous save is raised here, before anything is written
            return save(self, *args, **kwargs)

        _ORIGINAL["save"] = save
        Trainer._save_checkpoint = save_checkpoint_after_pending


def remove_trainer_patch() -> None:
    """Undo :func:`install_trainer_patch` (a no-op when it is not installed)."""
    with _LOCK:
        original = _ORIGINAL.pop("load", None)
        if original is not None:
            from transformers import Trainer

            Trainer._load_optimizer_and_scheduler = original
            Trainer._save_checkpoint = _ORIGINAL.pop("save")
        rotation = _ORIGINAL.pop("rotate", None)
        if rotation is not None:
            owner, name, rotate = rotation
            setattr(owner, name, rotate)
