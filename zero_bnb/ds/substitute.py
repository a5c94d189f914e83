"""``zero_bnb.enable()``: make every ``deepspeed.initialize`` call build zero_bnb's engine.

Transformers' ``Trainer`` and Accelerate call ``deepspeed.initialize`` themselves (Accelerate
looks the name up at call time, in ``Accelerator._prepare_deepspeed``), so the one line
``zero_bnb.enable()`` before ``trainer.train()`` / ``accelerator.prepare(...)`` is enough.

How the substitution behaves:

* :func:`enable` replaces ``deepspeed.initialize`` by a dispatcher, once (a second call is a
  no-op); :func:`disable` restores whatever was there before, and is a no-op when nothing is
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
* :func:`enable` and :func:`enabled` also let DeepSpeed's
  ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` read zero_bnb
  checkpoints (:mod:`zero_bnb.integrations.conversions`; it stays after :func:`disable`).

Call it on every rank (each process has its own ``deepspeed`` module). Local, except that :func:`enable`
initialises ``deepspeed.comm`` when it can (:mod:`zero_bnb.integrations.comm`: on a CPU launch with no process
group yet, that joins the launcher's rendezvous).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import deepspeed

from zero_bnb.integrations.comm import join_deepspeed_comm

__all__ = ["calling_deepspeed", "disable", "enable", "enabled", "is_enabled", "underlying_initialize"]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_LOCAL = threading.local()


class _State:
    """Process-wide substitution state, guarded by ``_LOCK``."""

    original: Callable[..., Any] | None = None  # what deepspeed.initialize was before the dispatcher
    installed: Callable[..., Any] | None = None  # the dispatcher, while it is in deepspeed.initialize
    global_on: bool = False
    scopes: int = 0  # open `enabled()` blocks, all threads


def _thread_depth() -> int:
    return getattr(_LOCAL, "depth", 0)


def _inside() -> bool:
    return getattr(_LOCAL, "inside", False)


def _find_genuine(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """DeepSpeed's own ``initialize`` (defined in ``deepspeed/__init__.py``) behind ``fn``'s ``__wrapped__`` chain."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if getattr(fn, "__module__", None) == "deepspeed" and getattr(fn, "__qualname__", None) == "initialize":
            return fn
        fn = getattr(fn, "__wrapped__", None)
    return None


_GENUINE = _find_genuine(deepspeed.initialize)


def _genuine() -> Callable[..., Any]:
    """DeepSpeed's own ``initialize``, whatever wraps it (found when zero_bnb was imported, or now)."""
    found = _GENUINE or _find_genuine(_State.original) or _find_genuine(deepspeed.initialize)
    if found is None:
        raise RuntimeError(
            "zero_bnb cannot find DeepSpeed's own deepspeed.initialize: it was replaced before zero_bnb was imported "
            "by a wrapper without __wrapped__; import zero_bnb before installing that wrapper, or set "
            "wrapper.__wrapped__ = <the function it wraps>"
        )
    return found


def underlying_initialize() -> Callable[..., Any]:
    """The ``deepspeed.initialize`` that :func:`zero_bnb.initialize` must call (never the dispatcher).

    The function that was in place before :func:`enable`; DeepSpeed's own one when the
    dispatcher is re-entered on this thread during a zero_bnb initialize.
    """
    if _inside():
        return _genuine()
    current = deepspeed.initialize
    if getattr(current, "_zero_bnb_dispatcher", False):
        current = _State.original if _State.original is not None else _genuine()
    if getattr(current, "__module__", None) == "zero_bnb.ds.initialize":  # deepspeed.initialize = zero_bnb.initialize
        return _genuine()
    return current


@contextmanager
def calling_deepspeed() -> Iterator[None]:
    """Mark this thread as inside :func:`zero_bnb.initialize` (dispatcher re-entries go to DeepSpeed)."""
    previous = _inside()
    _LOCAL.inside = True
    try:
        yield
    finally:
        _LOCAL.inside = previous


def _route_to_zero_bnb() -> bool:
    return _State.global_on or _thread_depth() > 0


def _dispatcher(*args: Any, **kwargs: Any):
    """Stands in for ``deepspeed.initialize`` while zero_bnb is enabled."""
    if _inside():  # re-entered from within zero_bnb.initialize (a wrapper that looks the name up at call time)
        return _genuine()(*args, **kwargs)
    if not _route_to_zero_bnb():
        original = _State.original if _State.original is not None else _genuine()
        return original(*args, **kwargs)
    from zero_bnb.ds.initialize import initialize

    door = _calling_front_door()
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


def _make_dispatcher() -> Callable[..., Any]:
    @functools.wraps(_genuine())
    def dispatcher(*args: Any, **kwargs: Any):
        return _dispatcher(*args, **kwargs)

    del dispatcher.__wrapped__  # not a transparent wrapper: it changes what is built
    dispatcher._zero_bnb_dispatcher = True
    return dispatcher


def _install() -> None:
    from zero_bnb.integrations.accelerate import install_accelerate_patch
    from zero_bnb.integrations.conversions import route_deepspeed_zero_to_fp32
    from zero_bnb.integrations.hf import install_trainer_patch

    install_accelerate_patch()  # Accelerate's offload swap must keep the user's optimizer (idempotent)
    install_trainer_patch()  # Trainer's checkpoints: complete before they count, resumed only when complete
    route_deepspeed_zero_to_fp32()  # stays: DeepSpeed's zero_to_fp32 then reads zero_bnb checkpoints too
    if _State.installed is not None:
        return
    current = deepspeed.initialize
    if getattr(current, "_zero_bnb_dispatcher", False):  # left in place inside a later wrapper
        _State.installed = current
        return
    _State.original = current
    _State.installed = _make_dispatcher()
    deepspeed.initialize = _State.installed


def _uninstall_if_idle() -> None:
    if _State.global_on or _State.scopes > 0 or _State.installed is None:
        return
    from zero_bnb.integrations.hf import remove_trainer_patch

    remove_trainer_patch()
    if "zero_bnb.integrations.accelerate" in sys.modules:
        sys.modules["zero_bnb.integrations.accelerate"].remove_accelerate_patch()
    if deepspeed.initialize is _State.installed:
        deepspeed.initialize = _State.original
        _State.installed = None
        _State.original = None
    else:
        # Someone wrapped the dispatcher after enable(); it stays inside their wrapper and passes
        # calls through to the original while zero_bnb is disabled.
        logger.warning(
            "zero_bnb: deepspeed.initialize was replaced after zero_bnb.enable() (by %s); leaving that "
            "replacement in place, zero_bnb's dispatcher inside it now passes calls to DeepSpeed",
            getattr(deepspeed.initialize, "__qualname__", deepspeed.initialize),
        )


def enable() -> None:
    """Route every ``deepspeed.initialize`` call in this process to :func:`zero_bnb.initialize`, and initialise
    DeepSpeed's communication layer when it can (:func:`zero_bnb.integrations.comm.join_deepspeed_comm`).

    Call it on every rank, **before the model is built**: at ZeRO stage 3 transformers builds the model under
    ``deepspeed.zero.Init``, which needs ``deepspeed.comm`` initialised to see the real world size (on CPU under
    ``torchrun``, nothing else initialises it in time). On a CPU launch with no process group yet, the first call
    joins the launcher's rendezvous (every rank must make it); otherwise it is local. Later calls are no-ops.
    Thread-safe.
    """
    with _LOCK:
        if _State.global_on:
            logger.debug("zero_bnb.enable(): already enabled")
            return
        _install()
        _State.global_on = True
        logger.info("zero_bnb: deepspeed.initialize now builds zero_bnb engines")
    join_deepspeed_comm()


def disable() -> None:
    """Undo :func:`enable`: ``deepspeed.initialize`` is what it was before. A no-op when not enabled.

    ``with zero_bnb.enabled():`` blocks still open on other threads keep their routing.
    """
    with _LOCK:
        if not _State.global_on:
            logger.debug("zero_bnb.disable(): zero_bnb was not enabled; nothing to do")
            return
        _State.global_on = False
        _uninstall_if_idle()


def is_enabled() -> bool:
    """Whether a ``deepspeed.initialize`` call made now, on this thread, builds a zero_bnb engine."""
    return _State.installed is not None and _route_to_zero_bnb()


@contextmanager
def enabled() -> Iterator[None]:
    """Route this thread's ``deepspeed.initialize`` calls to zero_bnb inside the ``with`` block.

    Nests, and restores the previous routing on exit, also when the block raises.
    """
    with _LOCK:
        _install()
        _State.scopes += 1
        _LOCAL.depth = _thread_depth() + 1
    try:
        yield
    finally:
        with _LOCK:
            _LOCAL.depth = _thread_depth() - 1
            _State.scopes -= 1
            _uninstall_if_idle()
