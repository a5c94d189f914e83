"""A checkpoint on the preemption signal: save at the next step boundary, wait until it is durable, exit.

SLURM (``--signal=USR1@90``, or SIGTERM at preemption), Kubernetes (SIGTERM, then SIGKILL after the grace period) and
``torchrun`` (SIGTERM to every worker when it is itself stopped) warn a job before they kill it. Saving inside the
signal handler is wrong: the handler interrupts the training step anywhere, possibly inside a collective, on each
rank at a different moment (and zero_bnb's one-call-at-a-time guard refuses a save that interrupts another
checkpoint call). :class:`Preemption` installs handlers that only note the signal; at each optimizer-step boundary
the ranks agree, over a gloo group of their own, whether any of them got one (:meth:`Preemption.requested`, a
collective); when one did, every rank saves, waits for the save to be committed and durable, and the process exits
with ``128 + signal`` (143 for SIGTERM, 138 for SIGUSR1), which launchers and schedulers read as "stopped by that
signal" (``torchrun`` restarts the workers within ``--max-restarts``; a requeued SLURM job resumes automatically).

One-liners (docs/checkpoints.md, "Preemption and automatic resume"):

* plain engine: ``zero_bnb.save_on_preemption(engine, "ckpt")`` (after ``initialize``; Accelerate: pass
  ``save=accelerator.save_state``);
* Trainer: ``Trainer(..., callbacks=[zero_bnb.PreemptionCallback()])``;
* Lightning: ``pl.Trainer(..., callbacks=[zero_bnb.lightning.SaveOnPreemption()])``.
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_SIGNALS", "Preemption", "save_on_preemption"]

logger = logging.getLogger(__name__)

#: SIGTERM (Kubernetes, torchrun, SLURM at preemption) and SIGUSR1 (SLURM's ``--signal=USR1@90``).
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Note the preemption signals; tell every rank at a step boundary; exit once the checkpoint is durable.

    Construct it in the main thread (Python installs signal handlers there only). A handler that was installed
    before (a Python function) is called after the flag is set; the default action (terminate) is replaced.

    Args:
        signals: the signals that announce a preemption.
        exit_code: the status to exit with; default ``128 + signal``.
    """

    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS, exit_code: int | None = None) -> None:
        self.signals = tuple(signals)
        self.exit_code = exit_code
        self.received: int | None = None
        self._group: Any = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("zero_bnb.Preemption must be created in the main thread (Python installs signal "
                               "handlers there only)")
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._note)

    def install_again(self) -> None:
        """Put this object's handlers back in place of whatever replaced them since (a framework that installed its
        own; the handlers that were there first are still called after the flag is set). Main thread only."""
        for number in self.signals:
            signal.signal(number, self._note)

    def _note(self, number: int, frame: Any) -> None:
        self.received = self.received or number
        previous = self._previous.get(number)
        if callable(previous):
            previous(number, frame)

    def requested(self) -> bool:
        """Whether any rank received a preemption signal. Collective over every rank of the default process group
        (at the same step boundary); local when there is no process group."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.received is not None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # a CPU flag, whatever the training backend
        flag = torch.tensor([self.received or 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self.received = self.received or int(flag.item()) or None
        return self.received is not None

    def exit(self) -> NoReturn:
        """Exit the process with the preemption's status (``128 + signal`` unless ``exit_code`` was given), after
        logging it and flushing the logs. Call once the checkpoint is committed."""
        number = self.received or signal.SIGTERM
        code = self.exit_code if self.exit_code is not None else 128 + int(number)
        logger.warning("zero_bnb: preempted (%s): checkpoint saved and durable; exiting with status %d",
                       signal.Signals(number).name, code)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.exit(code)

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


def save_on_preemption(engine: Any, save_dir: str | None = None, *, save: Callable[[], object] | None = None,
                       signals: tuple[int, ...] = DEFAULT_SIGNALS, exit_code: int | None = None) -> Preemption:
    """After a preemption signal, save at the next optimizer-step boundary of ``engine``, wait until the checkpoint
    is committed and durable, and exit (see the module docstring).

    Call on every rank, in the main thread, after the engine is built. Every ``engine.step()`` that completes an
    optimizer step then asks the ranks whether one got a signal (a small collective on a gloo group); when one did,
    ``engine.save_checkpoint(save_dir)`` (or ``save()``, e.g. Accelerate's ``accelerator.save_state``) runs on every
    rank, then ``engine.wait_for_checkpoint()``, then the process exits.

    Returns:
        The :class:`Preemption`, whose ``received`` says which signal came.
    """
    if (save_dir is None) == (save is None):
        raise ValueError("zero_bnb.save_on_preemption needs exactly one of save_dir= (engine.save_checkpoint) or "
                         "save= (a callable that saves, e.g. accelerator.save_state)")
    preemption = Preemption(signals, exit_code)
    step = engine.step

    @functools.wraps(step)
    def step_then_check(*args: Any, **kwargs: Any) -> Any:
        before = engine.global_steps
        result = step(*args, **kwargs)
        if engine.global_steps != before and preemption.requested():
            logger.warning("zero_bnb: preemption signal received: saving at step %d", engine.global_steps)
            if save is not None:
                save()
            else:
                engine.save_checkpoint(save_dir)
            engine.wait_for_checkpoint()  # committed (and durable) before the process ends
            preemption.exit()
        return result

    engine.step = step_then_check
    return preemption
