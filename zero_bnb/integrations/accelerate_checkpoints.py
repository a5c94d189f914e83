"""Accelerate's ``save_state`` and ``load_state`` around zero_bnb checkpoints: a killed save never becomes the one
``load_state()`` resumes from, and no older checkpoint is deleted before the newer one is complete.

* ``save_state`` of a zero_bnb engine runs as a front door save (:mod:`zero_bnb.checkpoint.front_door`): its folder is marked unfinished
  when the zero_bnb engine starts writing into it, and counts as complete once Accelerate's own files (RNG states,
  scheduler, sampler, custom objects) and zero_bnb's checkpoint are durable; a pending asynchronous save is committed
  before another ``save_state`` starts. With automatic checkpoint naming and ``total_limit``, Accelerate deletes the
  oldest folders *before* it saves; here the same folders are deleted once the new one is complete.
* ``load_state()`` with automatic checkpoint naming takes the newest ``checkpoints/checkpoint_N`` whose save was not
  interrupted (one WARNING names those passed over); an ``input_dir`` holding an interrupted save is refused, naming
  the newest complete one. After a zero_bnb engine's load, ``accelerator.step`` is set from its optimizer step on
  every rank (:func:`_align_step`: resumed at more processes, Accelerate left it at 0 on the new ones).

Installed the first time zero_bnb patches Accelerate, and kept (it changes nothing for a folder without zero_bnb's
records); installed again on the new class a reload of ``accelerate.accelerator`` makes
(:func:`missing_checkpoint_patch` says what is not wrapped). Local, except that the wrapped calls are collective as
Accelerate's own are.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from typing import Any

from zero_bnb.checkpoint.pending import wait_for_pending_saves
from zero_bnb.checkpoint.front_door import front_door_save
from zero_bnb.errors import CheckpointUsageError
from zero_bnb.format.progress import first_complete, folder_status
from zero_bnb.integrations.resume import accelerate_checkpoints, newest_complete, refuse_interrupted

__all__ = ["install_checkpoint_patch", "missing_checkpoint_patch", "newest_checkpoint"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()


def _checkpoints_dir(accelerator: Any) -> str:
    return os.path.join(accelerator.project_dir, "checkpoints")


def _save_folder(accelerator: Any, output_dir: Any) -> str | None:
    """The folder ``save_state(output_dir)`` writes, as Accelerate chooses it."""
    if accelerator.project_configuration.automatic_checkpoint_naming:
        return os.path.join(_checkpoints_dir(accelerator), f"checkpoint_{accelerator.save_iteration}")
    return os.fspath(output_dir) if output_dir is not None else None


def _delete_oldest(folders: list[str], limit: int) -> None:
    """Accelerate's ``total_limit`` rule, run once the new checkpoint is complete: of ``folders`` (those there before
    the save, oldest first) the oldest go, so that ``limit`` stay with the new one."""
    doomed = folders[: len(folders) + 1 - limit]
    if doomed:
        logger.warning("zero_bnb: deleting %d checkpoints to make room for the new checkpoint (complete now; Accelerate's "
                       "total_limit)", len(doomed))
    for path in doomed:
        if os.path.lexists(path):
            shutil.rmtree(path)


def _required_tag(accelerator: Any) -> str | None:
    """The tag folder Accelerate loads from each checkpoint folder (DeepSpeed: ``pytorch_model``), if any."""
    from accelerate.utils import MODEL_NAME, DistributedType

    return MODEL_NAME if accelerator.distributed_type == DistributedType.DEEPSPEED else None


def newest_checkpoint(folder: str, require: str | None) -> str | None:
    """The folder ``load_state()`` resumes from in Accelerate's ``{project_dir}/checkpoints`` ``folder``: its newest
    entry, or, when that holds an interrupted save, the newest complete one (a WARNING names those passed over)."""
    candidates = accelerate_checkpoints(folder)
    if not candidates or not folder_status(candidates[0], require).interrupted:
        return candidates[0] if candidates else None  # Accelerate's own choice is complete
    found = newest_complete(candidates, "Accelerator.load_state()", require)
    if found is None:
        raise CheckpointUsageError(
            f"Accelerator.load_state() found no complete checkpoint in {folder}: every folder there holds an "
            f"interrupted save (named in the warning above). Start without load_state(), or pass input_dir= a "
            f"complete checkpoint"
        )
    return found


def _resume_folder(accelerator: Any, input_dir: Any) -> Any:
    """The folder ``load_state(input_dir)`` should read (see the module docstring)."""
    require = _required_tag(accelerator)
    if input_dir is None and accelerator.project_configuration.automatic_checkpoint_naming:
        return newest_checkpoint(_checkpoints_dir(accelerator), require)
    if input_dir is not None:
        path = os.path.expanduser(os.fspath(input_dir))
        parent = os.path.dirname(os.path.abspath(path))
        refuse_interrupted(path, first_complete(accelerate_checkpoints(parent), require)[0], "input_dir",
                           "pass that folder, or call load_state() without input_dir under automatic checkpoint "
                           "naming, which skips interrupted saves", require)
    return input_dir


def _align_step(accelerator: Any) -> None:
    """Set Accelerate's micro-batch counter from the zero_bnb engine's optimizer step, on every rank.

    Accelerate restores ``accelerator.step`` (which decides, modulo the accumulation, where gradients are synced) from
    each process's own ``random_states_{i}.pkl``: a resume at more processes leaves it at 0 on the new ones, and a
    resume at another accumulation counts it in the old split; the ranks then disagree on where DeepSpeed steps (a
    collective mismatch, or a hang). ``optimizer steps x this run's accumulation`` is the count at that step in this
    run's split, the same on every rank."""
    engines = [model for model in accelerator._models if hasattr(model, "zero_bnb_config")]
    if not engines:
        return
    step = engines[0].global_steps * accelerator.gradient_accumulation_steps
    if accelerator.step != step:
        logger.info("zero_bnb: Accelerator.step set to %d (optimizer step %d x gradient accumulation %d; it was %d on "
                    "this process)", step, engines[0].global_steps, accelerator.gradient_accumulation_steps,
                    accelerator.step)
        accelerator.step = step


_METHODS = ("save_state", "load_state")


def missing_checkpoint_patch(accelerator_class: type) -> list[str]:
    """The methods of ``accelerator_class`` that :func:`install_checkpoint_patch` wraps and that are not wrapped now
    (after ``importlib.reload(accelerate.accelerator)``, a new class)."""
    return [name for name in _METHODS if not getattr(getattr(accelerator_class, name, None), "_zero_bnb_patch", False)]


def _wrap(method: str, original: Any) -> Any:
    """``Accelerator.<method>`` (``save_state`` or ``load_state``) around ``original``: see the module docstring."""
    if method == "save_state":
        save_state = original

        @functools.wraps(save_state)
        def save_state_complete(self, output_dir=None, *args, **kwargs):
            wait_for_pending_saves()  # one save at a time; a failed asynchronous save is raised here
            folder = _save_folder(self, output_dir)
            if folder is None or not any(hasattr(model, "zero_bnb_config") for model in self._models):
                return save_state(self, output_dir, *args, **kwargs)  # no zero_bnb engine saves: Accelerate's own
            config = self.project_configuration
            limit = config.total_limit if config.automatic_checkpoint_naming else None
            existing = accelerate_checkpoints(_checkpoints_dir(self))[::-1] if limit is not None else []
            with front_door_save(folder, "accelerate", main=self.is_main_process, mark_first=False) as save:
                config.total_limit = None  # deleted below, once the new checkpoint is complete
                try:
                    result = save_state(self, output_dir, *args, **kwargs)
                finally:
                    config.total_limit = limit
                if limit is not None:
                    save.defer(functools.partial(_delete_oldest, existing, limit),
                               f"Accelerate's deletion of checkpoints beyond total_limit={limit}")
            return result

        wrapper = save_state_complete
    else:
        load_state = original

        @functools.wraps(load_state)
        def load_state_complete(self, input_dir=None, *args, **kwargs):
            wait_for_pending_saves()  # a save of this process still being written is complete first
            result = load_state(self, _resume_folder(self, input_dir), *args, **kwargs)
            _align_step(self)
            return result

        wrapper = load_state_complete
    wrapper._zero_bnb_patch = True
    return wrapper


def install_checkpoint_patch(accelerator_class: type) -> None:
    """Wrap ``accelerator_class.save_state`` and ``load_state``, each once (a method already wrapped is left as it
    is: no double wrapping; one replaced since, e.g. by a reload of ``accelerate.accelerator``, is wrapped again).
    Thread-safe."""
    with _LOCK:
        for name in missing_checkpoint_patch(accelerator_class):
            setattr(accelerator_class, name, _wrap(name, getattr(accelerator_class, name)))
