"""Trainer's one-liner for preemption: ``Trainer(..., callbacks=[zero_bnb.PreemptionCallback()])``.

After a preemption signal (:mod:`zero_bnb.integrations.preemption`) the ranks agree at the end of the next optimizer
step; Trainer then saves its ``checkpoint-N`` (a front door save: complete and durable before it counts) and stops
training; at the end of training the callback waits for a pending asynchronous save and exits with ``128 + signal``.
``train(resume_from_checkpoint=True)`` in the next run resumes from it, at any number of processes.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from zero_bnb.checkpoint.pending import wait_for_pending_saves
from zero_bnb.integrations.preemption import DEFAULT_SIGNALS, Preemption

__all__ = ["PreemptionCallback"]


class PreemptionCallback(TrainerCallback):
    """Save a checkpoint and stop at the next step after SIGTERM or SIGUSR1 (every rank; create it in the main thread).

    Args:
        signals: the signals that announce a preemption.
        exit_code: the status to exit with; default ``128 + signal``.
    """

    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS, exit_code: int | None = None) -> None:
        self.preemption = Preemption(tuple(signals), exit_code)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.preemption.requested():
            control.should_save = True  # Trainer saves right after this callback, then stops
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.preemption.received is not None:
            wait_for_pending_saves()  # committed and durable (a failure is raised here, not lost)
            self.preemption.exit()
        return control


