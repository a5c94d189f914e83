"""The dispatcher that stands in for ``deepspeed.initialize`` while zero_bnb routes calls, and the way back to
DeepSpeed's own function (the front door, ``zero_bnb.enable()`` and friends, is
:mod:`zero_bnb.integrations.substitute`).

* Routing: process-wide (:func:`route_process`) or for the calling thread inside a scope (:func:`enter_scope` /
  :func:`leave_scope`); :func:`is_enabled` says whether a call made now on this thread builds a zero_bnb engine.
* Recursion-safe: :func:`underlying_initialize` is the ``deepspeed.initialize`` that was in place before the
  dispatcher (stock DeepSpeed, or a wrapper a user or MS-AMP installed earlier), never the dispatcher; a dispatcher
  re-entered on the same thread inside :func:`calling_deepspeed` (a wrapper that looks ``deepspeed.initialize`` up at
  call time) goes straight to DeepSpeed's own function.
* A wrapper installed *after* the dispatcher (it captured it) keeps working: :func:`remove_dispatcher` then leaves it
  in place and the dispatcher inside it passes calls through.

Process-wide state guarded by :data:`LOCK` (re-entrant; the front door holds it around its own patches too). Local.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import deepspeed

__all__ = ["LOCK", "calling_deepspeed", "dispatcher_replaced", "enter_scope", "install_dispatcher", "installed",
           "is_enabled", "leave_scope", "remove_dispatcher", "route_process", "routed", "underlying_initialize"]

logger = logging.getLogger(__name__)

#: Guards the routing state and the dispatcher's installation.
LOCK = threading.RLock()
_LOCAL = threading.local()


class _State:
    """Process-wide routing state, guarded by :data:`LOCK`."""

    original: Callable[..., Any] | None = None  # what deepspeed.initialize was before the dispatcher
    installed: Callable[..., Any] | None = None  # the dispatcher, while it is in deepspeed.initialize
    build: Callable[..., Any] | None = None  # what a routed call runs (zero_bnb's front door's builder)
    global_on: bool = False
    scopes: int = 0  # open scopes, all threads


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

    The function that was in place before the dispatcher; DeepSpeed's own one when the dispatcher is re-entered on
    this thread during a zero_bnb initialize.
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


def routed() -> bool:
    """Whether any routing is in force (process-wide or a scope on any thread). Under :data:`LOCK`."""
    return _State.global_on or _State.scopes > 0


def route_process(on: bool) -> bool:
    """Route every thread's calls (``on``) or stop doing so; returns whether it was on before. Under :data:`LOCK`."""
    before, _State.global_on = _State.global_on, on
    return before


def enter_scope() -> None:
    """Route this thread's calls until the matching :func:`leave_scope` (nests). Under :data:`LOCK`."""
    _State.scopes += 1
    _LOCAL.depth = _thread_depth() + 1


def leave_scope() -> None:
    """End the innermost scope of this thread. Under :data:`LOCK`."""
    _LOCAL.depth = _thread_depth() - 1
    _State.scopes -= 1


def installed() -> bool:
    """Whether the dispatcher is installed (in ``deepspeed.initialize``, or inside a wrapper put around it)."""
    return _State.installed is not None


def is_enabled() -> bool:
    """Whether a ``deepspeed.initialize`` call made now, on this thread, builds a zero_bnb engine."""
    return _State.installed is not None and _route_to_zero_bnb()


def _dispatcher(*args: Any, **kwargs: Any):
    """Stands in for ``deepspeed.initialize`` while it is installed."""
    if _inside():  # re-entered from within zero_bnb.initialize (a wrapper that looks the name up at call time)
        return _genuine()(*args, **kwargs)
    if not _route_to_zero_bnb() or _State.build is None:
        original = _State.original if _State.original is not None else _genuine()
        return original(*args, **kwargs)
    return _State.build(*args, **kwargs)


def _make_dispatcher() -> Callable[..., Any]:
    @functools.wraps(_genuine())
    def dispatcher(*args: Any, **kwargs: Any):
        return _dispatcher(*args, **kwargs)

    del dispatcher.__wrapped__  # not a transparent wrapper: it changes what is built
    dispatcher._zero_bnb_dispatcher = True
    return dispatcher


def dispatcher_replaced() -> bool:
    """Whether ``deepspeed.initialize`` lost the dispatcher while one is installed: it is DeepSpeed's own function
    again (``importlib.reload(deepspeed)``) or what was there before (put back by assignment). Any other function is
    left alone: a wrapper installed after the dispatcher may hold it."""
    current = deepspeed.initialize
    if _State.installed is None or current is _State.installed:
        return False
    return current is _State.original or _find_genuine(current) is current


def install_dispatcher(build: Callable[..., Any]) -> None:
    """Put the dispatcher into ``deepspeed.initialize`` unless it is in place; routed calls run ``build(*args,
    **kwargs)``. Under :data:`LOCK`."""
    _State.build = build
    if _State.installed is not None and not dispatcher_replaced():
        return
    current = deepspeed.initialize
    if _State.installed is None and getattr(current, "_zero_bnb_dispatcher", False):  # left inside a later wrapper
        _State.installed = current
        return
    _State.original = current
    _State.installed = _make_dispatcher()
    deepspeed.initialize = _State.installed


def remove_dispatcher() -> None:
    """Put back what ``deepspeed.initialize`` was before :func:`install_dispatcher` (a wrapper installed after it
    stays, with a WARNING: the dispatcher inside passes calls through). Under :data:`LOCK`."""
    if _State.installed is None:
        return
    if deepspeed.initialize is _State.installed:
        deepspeed.initialize = _State.original
        _State.installed = None
        _State.original = None
    else:
        logger.warning(
            "zero_bnb: deepspeed.initialize was replaced after zero_bnb.enable() (by %s); leaving that "
            "replacement in place, zero_bnb's dispatcher inside it now passes calls to DeepSpeed",
            getattr(deepspeed.initialize, "__qualname__", deepspeed.initialize),
        )
