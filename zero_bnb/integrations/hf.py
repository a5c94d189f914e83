"""Hugging Face Trainer glue, installed by :func:`zero_bnb.enable` (now, or once ``transformers.trainer`` is imported).

``zero_bnb.enable()`` alone makes Trainer and Accelerate build zero_bnb engines. This module adds what Trainer's
checkpoints need:

* on resume: Trainer loads its own ``scheduler.pt`` after DeepSpeed's checkpoint; one written by a stock
  DeepSpeed run (which drops bitsandbytes overrides) has fewer per-group entries than zero_bnb's optimizer has
  groups, which :func:`zero_bnb.integrations.scheduler_groups.fit_to_groups` repairs right after Trainer loads it;
* every ``checkpoint-N`` save of a zero_bnb engine is a front door save (:mod:`zero_bnb.checkpoint.front_door`): the folder is marked
  unfinished before Trainer writes its weights and counts as complete once Trainer's files and zero_bnb's checkpoint
  (committed in the background with ``zero_checkpoint_async``) are durable; Trainer's ``save_total_limit`` deletion
  runs only then, so the last complete checkpoint is never removed first. Trainer's next save waits for a pending
  one before it writes anything (the deletion sorts folders by modification time, which a pending save's commit
  renews);
* ``train(resume_from_checkpoint=True)`` (``get_last_checkpoint``, also ``transformers.trainer_utils``'s) takes the
  newest complete ``checkpoint-N`` (:mod:`zero_bnb.integrations.resume`); so does an explicit path that is the
  newest ``checkpoint-N`` and was interrupted (what the HF example scripts' own ``get_last_checkpoint``, imported
  before ``zero_bnb.enable()``, returns); an older interrupted one is refused, naming the newest complete one;
* the end of ``train()`` waits for a pending asynchronous save and raises its failure.

Installing again (a second ``zero_bnb.enable()``, or an engine built while a wrapped call is missing) wraps what
``importlib.reload(transformers.trainer)`` replaced (the new ``Trainer`` class) and never wraps a call twice;
:func:`missing_trainer_patch` says what is not wrapped, and why.

Local, no collectives (the wrapped calls are collective as Trainer's own are).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from zero_bnb.checkpoint.pending import after_pending_saves, wait_for_pending_saves
from zero_bnb.checkpoint.front_door import current_front_door_save, front_door_save
from zero_bnb.format.progress import first_complete, folder_status
from zero_bnb.integrations.import_watch import importing, stop_watching, unpatched_because, when_imported
from zero_bnb.integrations.resume import newest_complete, refuse_interrupted, trainer_checkpoints
from zero_bnb.integrations.scheduler_groups import fit_to_groups

__all__ = ["install_trainer_patch", "missing_trainer_patch", "remove_trainer_patch"]

_LOCK = threading.RLock()
_MODULE = "transformers.trainer"
_UTILS = "transformers.trainer_utils"
#: Whether the patch is wanted now (between install and remove).
_WANTED = False
#: ``(owner, attribute)`` pairs wrapped in this process, older ``Trainer`` classes a reload left behind included.
_PATCHED: list[tuple[Any, str]] = []


def _group_origin(trainer: Any):
    engine = getattr(trainer, "model_wrapped", None)
    optimizer = getattr(engine, "basic_optimizer", None)
    return getattr(optimizer, "zero_bnb_group_origin", None)


def _checkpoint_folder(trainer: Any, trial: Any) -> str:
    """The ``checkpoint-N`` folder ``Trainer._save_checkpoint`` writes, named as Trainer names it."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")


def _last_complete(original):
    """``get_last_checkpoint`` that passes over interrupted saves (``resume_from_checkpoint=True``)."""

    @functools.wraps(original)
    def get_last_checkpoint(folder):
        chosen = original(folder)
        if chosen is None:
            return None
        return newest_complete(trainer_checkpoints(folder), "Trainer's resume_from_checkpoint=True")

    get_last_checkpoint._zero_bnb_patch = True
    return get_last_checkpoint


def _explicit_resume(path: str) -> str:
    """What ``train(resume_from_checkpoint=path)`` resumes from: ``path``, or, when it holds an interrupted save and is
    its output folder's newest ``checkpoint-N`` (what transformers' ``get_last_checkpoint`` returned in a script that
    imported it before ``zero_bnb.enable()``, as the HF example scripts do), the newest complete checkpoint.

    Raises:
        CheckpointUsageError: ``path`` holds an interrupted save and is an older one, or nothing complete is left.
    """
    parent = os.path.dirname(os.path.abspath(path))
    candidates = trainer_checkpoints(parent)
    if candidates and os.path.abspath(path) == candidates[0] and folder_status(path).interrupted:
        found = newest_complete(candidates, f"Trainer's resume_from_checkpoint={path!r} (the newest checkpoint-N)")
        if found is not None:
            return found
    refuse_interrupted(path, first_complete(candidates)[0], "resume_from_checkpoint",
                       "pass that folder, or resume_from_checkpoint=True, which skips interrupted saves")
    return path


def _rotate_when_complete(rotate: Callable[..., Any]) -> Callable[..., Any]:
    """Trainer's deletion of checkpoints beyond ``save_total_limit``, run once the new checkpoint is complete."""

    @functools.wraps(rotate)
    def rotate_when_complete(*args, **kwargs):
        what = "Trainer's deletion of checkpoints beyond save_total_limit"
        save = current_front_door_save()
        if save is not None:
            save.defer(lambda: rotate(*args, **kwargs), what)
        else:
            after_pending_saves(lambda: rotate(*args, **kwargs), what)

    return rotate_when_complete


def _fit_scheduler_after_load(original_load: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer._load_optimizer_and_scheduler`` that fits the loaded scheduler to zero_bnb's param groups."""

    @functools.wraps(original_load)
    def load_optimizer_and_scheduler(self, checkpoint):
        result = original_load(self, checkpoint)
        origin = _group_origin(self)
        if checkpoint is not None and origin and getattr(self, "lr_scheduler", None) is not None:
            fit_to_groups(self.lr_scheduler, origin)
        return result

    return load_optimizer_and_scheduler


def _save_when_complete(save: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer._save_checkpoint`` as a front door save when a zero_bnb engine saves."""

    @functools.wraps(save)
    def save_checkpoint_complete(self, model, trial, *args, **kwargs):
        wait_for_pending_saves()  # a failed asynchronous save is raised here, before anything is written
        if not hasattr(getattr(self, "model_wrapped", None), "zero_bnb_config"):
            return save(self, model, trial, *args, **kwargs)  # no zero_bnb engine: Trainer's own save
        with front_door_save(_checkpoint_folder(self, trial), "trainer", main=self.args.should_save, mark_first=True):
            return save(self, model, trial, *args, **kwargs)

    return save_checkpoint_complete


def _train_then_wait(train: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer.train`` that resumes only from complete checkpoints and waits for its last asynchronous save."""

    @functools.wraps(train)
    def train_then_wait(self, resume_from_checkpoint=None, *args, **kwargs):
        wait_for_pending_saves()  # a save of this process still being written is complete first
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = _explicit_resume(os.fspath(resume_from_checkpoint))
        result = train(self, resume_from_checkpoint, *args, **kwargs)
        engine = getattr(self, "model_wrapped", None)
        if callable(getattr(engine, "wait_for_checkpoint", None)):
            engine.wait_for_checkpoint()  # the last save's failure is raised here, not lost at exit
        return result

    return train_then_wait


def _targets(module: ModuleType, trainer_utils: ModuleType) -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """What the patch wraps: ``(owner, attribute, wrapper factory)`` for this ``transformers.trainer`` module."""
    trainer = module.Trainer
    # transformers 5 calls the module's rotate_checkpoints(); 4.x the method Trainer._rotate_checkpoints
    rotate = ((module, "rotate_checkpoints") if hasattr(module, "rotate_checkpoints")
              else (trainer, "_rotate_checkpoints"))
    return [(*rotate, _rotate_when_complete),
            (trainer, "_load_optimizer_and_scheduler", _fit_scheduler_after_load),
            (trainer, "_save_checkpoint", _save_when_complete),
            (trainer, "train", _train_then_wait),
            (module, "get_last_checkpoint", _last_complete),
            (trainer_utils, "get_last_checkpoint", _last_complete)]


def _in_place(function: Any) -> bool:
    return getattr(function, "_zero_bnb_patch", False)


def _label(owner: Any, name: str) -> str:
    """``owner.name`` as a user finds it (``transformers.trainer.Trainer.train``)."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{getattr(owner, '__name__', owner)}.{name}"


def _patch_trainer(module: ModuleType, trainer_utils: ModuleType) -> None:
    """Wrap Trainer's checkpoint calls (see the module docstring), each unless it is wrapped already (a reload of
    ``transformers.trainer`` makes a new ``Trainer`` class, whose methods are wrapped then). Under ``_LOCK``."""
    for owner, name, wrap in _targets(module, trainer_utils):
        current = getattr(owner, name)
        if _in_place(current):  # never wrapped twice (the module's get_last_checkpoint may be trainer_utils' one)
            continue
        wrapper = wrap(current)
        wrapper._zero_bnb_patch = True
        setattr(owner, name, wrapper)
        if not any(o is owner and n == name for o, n in _PATCHED):
            _PATCHED.append((owner, name))


def _utils() -> ModuleType:
    """``transformers.trainer_utils`` (imported with ``transformers.trainer``)."""
    return sys.modules.get(_UTILS) or importlib.import_module(_UTILS)


def _patch_if_wanted(module: ModuleType) -> None:
    trainer_utils = _utils()  # outside _LOCK: nothing is imported while it is held
    with _LOCK:
        if _WANTED:
            _patch_trainer(module, trainer_utils)


def install_trainer_patch() -> None:
    """Wrap Trainer's checkpoint calls now if ``transformers.trainer`` is imported, else once it is (idempotent,
    thread-safe; called again, it re-wraps what a reload of the module replaced): the scheduler fitted to zero_bnb's
    groups on resume, saves marked unfinished until complete, deletions of older checkpoints after that,
    ``resume_from_checkpoint=True`` skipping interrupted saves, and the end of ``train()`` waiting for a pending
    asynchronous save."""
    global _WANTED
    with _LOCK:
        _WANTED = True
    when_imported(_MODULE, _patch_if_wanted, _ready)  # outside _LOCK: a watcher patches under Python's import lock


def _ready(module: ModuleType) -> bool:
    return hasattr(module, "Trainer")


def missing_trainer_patch() -> list[str]:
    """What the installed patch should have wrapped and has not, as one entry naming the calls and why
    (:func:`zero_bnb.integrations.import_watch.unpatched_because`); empty while the patch is not wanted,
    ``transformers.trainer`` is not imported (or still importing), or everything is in place. Changes nothing."""
    with _LOCK:
        wanted = _WANTED
    module, trainer_utils = sys.modules.get(_MODULE), sys.modules.get(_UTILS)
    if not wanted or module is None or trainer_utils is None or importing(module) or not _ready(module):
        return []
    lost = [_label(owner, name) for owner, name, _ in _targets(module, trainer_utils)
            if not _in_place(getattr(owner, name, None))]
    return [f"{', '.join(lost)}: {unpatched_because(_MODULE)}"] if lost else []


def _unwrapped(function: Any) -> Any:
    while _in_place(function):
        function = function.__wrapped__
    return function


def remove_trainer_patch() -> None:
    """Undo :func:`install_trainer_patch` (a no-op when it is not installed): every call it wrapped, in this module
    and in the classes a reload left behind, gets back what it wrapped."""
    global _WANTED
    stop_watching(_MODULE)  # before _LOCK: the watcher's lock (Python's import lock) is always taken first
    with _LOCK:
        _WANTED = False
        module, trainer_utils = sys.modules.get(_MODULE), sys.modules.get(_UTILS)
        owners = list(_PATCHED)
        if module is not None and trainer_utils is not None and _ready(module):
            owners += [(owner, name) for owner, name, _ in _targets(module, trainer_utils)]
        for owner, name in owners:
            current = getattr(owner, name, None)
            if _in_place(current):
                setattr(owner, name, _unwrapped(current))
        _PATCHED.clear()
