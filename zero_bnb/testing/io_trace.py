"""Every file-system step a save takes under one folder, zero_bnb's and the front door's own, as named kill points.

zero_bnb reports its own steps to :func:`zero_bnb.format.durable.set_io_hook`; a front door writes with plain
``open``, ``torch.save``, safetensors and ``os.replace``. :class:`IoTrace` sees all of them: the zero_bnb hook,
Python's audit events (``open`` for writing, ``os.rename``/``os.replace``, ``os.remove``, ``os.mkdir``, ``os.rmdir``,
``shutil.rmtree``) and the two writers whose files are opened in C (``torch.save`` to a path, safetensors'
``serialize_file``). Each step reaches ``on_step(kind, name)`` before it happens, with ``name`` relative to the
traced folder and random parts (tokens, temporary names) replaced by ``*``, so the same step of two runs has the
same name. Test support; one trace per process at a time.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from zero_bnb.format import durable

__all__ = ["IoTrace", "step_name"]

_ACTIVE: list[IoTrace] = []
_LOCAL = threading.local()
_AUDITED = False
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_AUDIT_PATHS = {"os.rename": 0, "os.remove": 0, "os.mkdir": 0, "os.rmdir": 0, "shutil.rmtree": 0, "os.truncate": 0}
#: zero_bnb's own steps come from its hook (which names them better): the audit events of these paths are skipped.
_ZERO_BNB_PRIVATE = (".zero_bnb-staging", ".zero_bnb-tmp", ".zero_bnb-replaced")
_RANDOM = [(re.compile(r"zero_bnb-(staging|new)-[0-9a-f]+"), r"zero_bnb-\1-*"),
           (re.compile(r"\.[A-Za-z0-9_]{8}\.zero_bnb-tmp"), ".*.zero_bnb-tmp")]


def step_name(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` with random parts as ``*``; ``None`` outside ``root``."""
    relative = os.path.relpath(os.path.abspath(path), root)
    if relative.startswith(".."):
        return None
    for pattern, replacement in _RANDOM:
        relative = pattern.sub(replacement, relative)
    return relative


def _report(kind: str, path: Any, *, audited: bool = False) -> None:
    if not _ACTIVE or getattr(_LOCAL, "inside", False) or not isinstance(path, (str, os.PathLike)):
        return
    path = os.path.abspath(os.fspath(path))
    if audited and getattr(_LOCAL, "last", None) == path:
        return  # the step zero_bnb's hook or a traced writer reported just before, seen again by the audit hook
    _LOCAL.last = None if audited else path
    trace = _ACTIVE[-1]
    name = step_name(os.fspath(path), trace.root)
    if name is None:
        return
    _LOCAL.inside = True
    try:
        trace.on_step(kind, name)
    finally:
        _LOCAL.inside = False


def _audit(event: str, args: tuple) -> None:
    if not _ACTIVE:
        return
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITE_FLAGS)
        if not writes:
            return
    elif event not in _AUDIT_PATHS:
        return
    else:
        path = args[0]
    if isinstance(path, (str, os.PathLike)) and not any(part in os.fspath(path) for part in _ZERO_BNB_PRIVATE):
        _report(event, path, audited=True)


class IoTrace:
    """Report every file-system step under ``root`` to ``on_step(kind, name)`` inside the ``with`` block."""

    def __init__(self, root: str, on_step: Callable[[str, str], None]) -> None:
        self.root = os.path.abspath(root)
        self.on_step = on_step
        self._saved: list[tuple[Any, str, Any]] = []
        self._hook: Any = None

    def __enter__(self) -> IoTrace:
        global _AUDITED
        if not _AUDITED:
            sys.addaudithook(_audit)  # for the life of the process; idle while no trace is active
            _AUDITED = True
        import safetensors.torch
        import torch

        def wrap(owner: Any, name: str, kind: str, position: int) -> None:
            original = getattr(owner, name)

            def traced(*args: Any, **kwargs: Any) -> Any:
                target = args[position] if len(args) > position else kwargs.get("f", kwargs.get("filename"))
                _report(kind, target)
                return original(*args, **kwargs)

            self._saved.append((owner, name, original))
            setattr(owner, name, traced)

        wrap(torch, "save", "torch.save", 1)
        wrap(safetensors.torch, "serialize_file", "safetensors", 1)
        previous = durable.set_io_hook(None)

        def hook(kind: str, path: str) -> None:
            _report(kind, path)
            if previous is not None:  # a hook installed before (a test's injected failure) still runs
                previous(kind, path)

        self._hook = previous
        durable.set_io_hook(hook)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        durable.set_io_hook(self._hook)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
