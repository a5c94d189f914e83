"""``zero_bnb.enable()``: make every ``deepspeed.initialize`` call build zero_bnb's engine.

Transformers' ``Trainer`` and Accelerate call ``deepspeed.initialize`` themselves (Accelerate
looks the name up at call time, in ``Accelerator._prepare_deepspeed``), so the one line
``zero_bnb.enable()`` before ``trainer.train()`` / ``accelerator.prepare(...)`` is enough.

How the substitution behaves:

* :func:`enable` replaces ``deepspeed.initialize`` by a dispatcher (:mod:`zero_bnb.ds.dispatch`), once (a second
  call is a no-op); :func:`disable` restores whatever was there before, and is a no-op when nothing is
  enabled. Both are process-wide and serialised by a lock, so two threads may call them.
* :func:`enabled` is a context manager that routes only **the calling thread's** calls to
  zero_bnb for the duration of the ``with`` block (exceptions included); other threads keep
  stock DeepSpeed unless :func:`enable` is in force.
* Recursion-safe: :func:`zero_bnb.initialize` calls the ``deepspeed.initialize`` that was in
  place before :func:`enable` (stock DeepSpeed, or a wrapper a user or MS-AMP installed
  earlier), never the dispatcher; a dispatcher re-entered on the same thread during that call
  (a wrapper that looks ``deepspeed.initialize`` up at call time) goes straight to DeepSpeed's
  own function.
* A wrapper installed *after* :func:`enable` (it captured the dispatcher) keeps working;
  :func:`disable` then leaves it in place and the dispatcher inside it passes calls through.
* Under optimizer offload Accelerate (and Trainer through it) would replace the user's optimizer
  by ``DeepSpeedCPUAdam`` before ``deepspeed.initialize``; while zero_bnb routes the call it keeps
  the optimizer (:mod:`zero_bnb.integrations.accelerate`, installed with the dispatcher).
* The engine records which front door built it (Trainer, Accelerate or plain DeepSpeed, from the
  calling stack), so that its messages use that front door's words.
* Patches that vanish are put back: a second :func:`enable` (and every :func:`enabled`) re-checks
  ``deepspeed.initialize`` and the front doors' patches and re-installs one that is not in place
  (``importlib.reload`` of ``accelerate.accelerator`` or ``transformers.trainer`` makes new, unpatched
  functions and classes; an import hook ahead of zero_bnb's watcher on ``sys.meta_path`` may import
  them unseen), wrapping nothing twice. An engine built through a front door checks the same and, when
  something was missing, re-installs it with a WARNING naming what, why and the fix (the call under
  way may have run the unpatched code).
* :func:`enable` and :func:`enabled` also let DeepSpeed's
  ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` read zero_bnb
  checkpoints (:mod:`zero_bnb.integrations.conversions`; it stays after :func:`disable`).

Call it on every rank (each process has its own ``deepspeed`` module). Local, except that :func:`enable`
initialises ``deepspeed.comm`` when it can (:mod:`zero_bnb.integrations.comm`: on a CPU launch with no process
group yet, that joins the launcher's rendezvous).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from zero_bnb.ds import dispatch
from zero_bnb.ds.dispatch import LOCK, is_enabled
from zero_bnb.integrations.comm import join_deepspeed_comm

__all__ = ["disable", "enable", "enabled", "is_enabled"]

logger = logging.getLogger(__name__)


def _build(*args: Any, **kwargs: Any):
    """What a routed ``deepspeed.initialize`` call runs: :func:`zero_bnb.initialize`, after re-installing what the
    front door relies on; the engine records which front door built it."""
    from zero_bnb.ds.initialize import initialize

    door = _calling_front_door()
    _reinstall_lost(door)
    built = initialize(*args, **kwargs)
    built[0].zero_bnb_front_door = door
    return built


def _calling_front_door() -> str:
    """Which framework called ``deepspeed.initialize``: ``"trainer"`` when transformers' Trainer is on the stack
    (it calls through Accelerate), else ``"accelerate"`` when Accelerate is, else ``"deepspeed"``."""
    door = "deepspeed"
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "transformers.trainer" or module.startswith("transformers.trainer."):
            return "trainer"
        if module == "accelerate" or module.startswith("accelerate."):
            door = "accelerate"
        frame = frame.f_back
    return door


def _lost() -> list[str]:
    """What :func:`enable` / :func:`enabled` installed that is not in place now, each entry naming it and why (empty
    while nothing is installed). Changes nothing."""
    lost = []
    if dispatch.dispatcher_replaced():
        lost.append("deepspeed.initialize: DeepSpeed's own function again (importlib.reload(deepspeed), or an "
                    "assignment)")
    for module, check in (("zero_bnb.integrations.accelerate", "missing_accelerate_patch"),
                          ("zero_bnb.integrations.hf", "missing_trainer_patch")):
        if module in sys.modules:  # imported by the first _install(): nothing of it was installed before
            lost += getattr(sys.modules[module], check)()
    return lost


def _install() -> list[str]:
    """Install the dispatcher and the front doors' patches, each unless it is in place (a second call re-checks every
    one: what a reload or an import hook ahead of zero_bnb's watcher left unpatched is installed, nothing is wrapped
    twice). Returns what was installed before and found not in place (see :func:`_lost`). Under ``LOCK``."""
    from zero_bnb.integrations.accelerate import install_accelerate_patch
    from zero_bnb.integrations.conversions import route_deepspeed_zero_to_fp32
    from zero_bnb.integrations.hf import install_trainer_patch

    lost = _lost()
    install_accelerate_patch()  # Accelerate's offload swap must keep the user's optimizer (idempotent)
    install_trainer_patch()  # Trainer's checkpoints: complete before they count, resumed only when complete
    route_deepspeed_zero_to_fp32()  # stays: DeepSpeed's zero_to_fp32 then reads zero_bnb checkpoints too
    dispatch.install_dispatcher(_build)
    return lost


#: What a call under way may have missed, per patch found not in place (by the prefix of its entry in :func:`_lost`).
_MISSED = (("deepspeed.initialize", "other deepspeed.initialize calls built stock DeepSpeed engines"),
           ("accelerate.", "under optimizer offload Accelerate may have replaced the optimizer by DeepSpeedCPUAdam, "
                           "which zero_bnb then refuses"),
           ("transformers.", "a Trainer.train() under way resumes from interrupted checkpoints and does not wait for "
                             "its last asynchronous save"))
_DOORS = {"trainer": "Trainer", "accelerate": "Accelerate", "deepspeed": "deepspeed.initialize"}


def _reinstall_lost(door: str) -> None:
    """Where zero_bnb relies on its patches (an engine built through ``door``): re-install any found not in place,
    with one WARNING naming each, why, what the call under way may have missed, and the fix."""
    with LOCK:
        if not dispatch.routed():
            return
        lost = _install()
    if lost:
        missed = [what for prefix, what in _MISSED if any(entry.startswith(prefix) for entry in lost)]
        logger.warning(
            "zero_bnb: an engine is being built through %s, but zero_bnb's patches were not in place: %s. Re-installed "
            "now, for the calls that follow; the calls under way ran without them (%s). Call zero_bnb.enable() again "
            "after importlib.reload() of a patched module, or after an import hook ahead of zero_bnb's on "
            "sys.meta_path has imported it (or import the module before zero_bnb.enable())",
            _DOORS.get(door, door), "; ".join(lost), "; ".join(missed))


def _uninstall_if_idle() -> None:
    if dispatch.routed() or not dispatch.installed():
        return
    from zero_bnb.integrations.hf import remove_trainer_patch

    remove_trainer_patch()
    if "zero_bnb.integrations.accelerate" in sys.modules:
        sys.modules["zero_bnb.integrations.accelerate"].remove_accelerate_patch()
    dispatch.remove_dispatcher()


def enable() -> None:
    """Route every ``deepspeed.initialize`` call in this process to :func:`zero_bnb.initialize`, and initialise
    DeepSpeed's communication layer when it can (:func:`zero_bnb.integrations.comm.join_deepspeed_comm`).

    Call it on every rank, **before the model is built**: at ZeRO stage 3 transformers builds the model under
    ``deepspeed.zero.Init``, which needs ``deepspeed.comm`` initialised to see the real world size (on CPU under
    ``torchrun``, nothing else initialises it in time). On a CPU launch with no process group yet, the first call
    joins the launcher's rendezvous (every rank must make it); otherwise it is local. A later call re-checks every
    patch and re-installs one that is not in place (after ``importlib.reload`` of a patched module, or an import hook
    ahead of zero_bnb's watcher that imported Accelerate or Trainer), never wrapping anything twice; it does nothing
    else. Thread-safe.
    """
    with LOCK:
        lost = _install()
        if lost:
            logger.info("zero_bnb.enable(): re-installed what was not in place: %s", "; ".join(lost))
        if dispatch.route_process(True):
            logger.debug("zero_bnb.enable(): already enabled")
            return
        logger.info("zero_bnb: deepspeed.initialize now builds zero_bnb engines")
    join_deepspeed_comm()


def disable() -> None:
    """Undo :func:`enable`: ``deepspeed.initialize`` is what it was before. A no-op when not enabled.

    ``with zero_bnb.enabled():`` blocks still open on other threads keep their routing.
    """
    with LOCK:
        if not dispatch.route_process(False):
            logger.debug("zero_bnb.disable(): zero_bnb was not enabled; nothing to do")
            return
        _uninstall_if_idle()


@contextmanager
def enabled() -> Iterator[None]:
    """Route this thread's ``deepspeed.initialize`` calls to zero_bnb inside the ``with`` block.

    Nests, and restores the previous routing on exit, also when the block raises.
    """
    with LOCK:
        lost = _install()
        if lost:
            logger.info("zero_bnb.enabled(): re-installed what was not in place: %s", "; ".join(lost))
        dispatch.enter_scope()
    try:
        yield
    finally:
        with LOCK:
            dispatch.leave_scope()
            _uninstall_if_idle()
