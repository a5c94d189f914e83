"""Kill campaigns through the front doors: the whole job SIGKILLed at each distinct I/O step of a save, then that
front door's own automatic resume at another DP size.

Each front door (Trainer, Accelerate, Lightning) runs the same story at DP=2 on the zero_bnb engine, synchronous or
asynchronous saves: train, save a complete checkpoint after step :data:`FIRST`, train, save the checkpoint under test
after step :data:`SECOND` (its completion deletes the older one: ``save_total_limit``/``total_limit``/``save_top_k``
of 1), train on. Every run is a job forked by one warm server (:mod:`zero_bnb.testing.forks`):

1. the **reference** job runs the story uninterrupted to :data:`STEPS`, records every step's loss and, per rank, the
   distinct I/O steps of the save under test in order (:class:`zero_bnb.testing.io_trace.IoTrace`: zero_bnb's files,
   the front door's own, folders, renames, deletions; ``returned`` when the save call returned);
2. one **trial** job per kill point (each rank's first occurrence of each distinct step: :func:`_kill_points`) runs
   the story and SIGKILLs the whole job when its victim is about to take that step; an asynchronous save's background
   steps happen while training goes on. Every trial runs in the same folder (moved aside after), so equal outcomes are equal bytes;
3. one **resume** job at DP=3 per distinct outcome (trials whose front door picks the same folder, holding the same
   checkpoint byte for byte, share it: the pick itself is made for every trial by the front door's finder) resumes
   through the front door's automatic path (``train(resume_from_checkpoint=True)``, ``load_state()`` with automatic
   checkpoint naming, ``fit(ckpt_path="last")``) and trains to :data:`STEPS`, recording the step it resumed from and
   the losses after it.

``tests/test_front_door_kills.py`` requires every trial to resume from the newest complete checkpoint and the losses
to follow the reference from there.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

FIRST, SECOND, STEPS = 1, 2, 3
MODES = ("sync", "async")
#: Step kinds that are not kill points: under SIGKILL (the page cache survives) a kill before them leaves what a kill
#: right after the step before leaves.
_NOT_KILL_POINTS = {"write", "fsync", "fsync_dir"}
#: Files whose bytes differ between equal runs (process ids, times, tokens): compared by name only.
_VOLATILE = (".zero_bnb.lock", ".zero_bnb-saving.json")


class Steps:
    """The I/O steps of the save under test on this rank: recorded (reference) or a kill at one of them (trial).

    ``belongs(kind, name)`` tells which steps belong to the save under test; recording starts when ``active`` is
    set (by the story, at the end of step :data:`SECOND`).
    """

    def __init__(self, belongs: Callable[[str, str], bool], kill: tuple[str, str] | None = None) -> None:
        self.belongs = belongs
        self.kill = kill
        self.seen: list[list[str]] = []
        self.active = False
        self.snapshot: Callable[[], None] | None = None

    def __call__(self, kind: str, name: str) -> None:
        if not self.active or not self.belongs(kind, name):
            return
        step = [kind, name]
        if step in self.seen:
            return
        self.seen.append(step)
        if self.kill is not None and tuple(step) == tuple(self.kill):
            from zero_bnb.testing.forks import kill_job

            kill_job()

    def returned(self) -> None:
        """The save call under test returned (an asynchronous one may still be writing)."""
        self("returned", "")

    def start(self) -> None:
        """The save under test is next: an asynchronous save before it is committed first (as the save would wait
        for it), so that none of its steps is taken for one of the save under test."""
        from zero_bnb.checkpoint.pending import wait_for_pending_saves

        wait_for_pending_saves()
        self.active = True

    def after(self) -> None:
        """The step after :data:`SECOND` begins: the reference records what the complete checkpoint holds."""
        if self.snapshot is not None:
            self.snapshot()


def _trace(folder: str, steps: Steps):
    from zero_bnb.testing.io_trace import IoTrace

    return IoTrace(folder, steps)


def _write(path: str, value) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle)


def _read(path: str):
    with open(path) as handle:
        return json.load(handle)


# -- Trainer ---------------------------------------------------------------------------------------------------------


def _trainer(folder: str, world: int, mode: str, callbacks=None, save_steps: int = 1):
    from hf_scenarios import _trainer as build
    from hf_scenarios import ds_config

    config = ds_config(zero_optimization={"stage": 2}, zero_checkpoint_async=mode == "async")
    return build(os.path.dirname(folder), world, name=os.path.basename(folder), max_steps=STEPS,
                 save_steps=save_steps, save_total_limit=1, config=config, callbacks=callbacks)


def _sigterm_the_job() -> None:
    """A preemption: SIGTERM to every process of the job at once (rank 0 sends it)."""
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.killpg(os.getpgid(0), signal.SIGTERM)


def _trainer_callback(steps: Steps):
    from transformers import TrainerCallback

    class Around(TrainerCallback):
        """Traces the save of step SECOND, from the end of that step (before Trainer saves) on."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == SECOND:
                steps.start()

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == SECOND:
                steps.returned()

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == SECOND:
                steps.after()

    return Around()


def trainer_story(rank: int, world: int, folder: str, mode: str, steps: Steps) -> dict:
    import zero_bnb
    from hf_scenarios import _losses

    zero_bnb.enable()
    trainer = _trainer(folder, world, mode, callbacks=[_trainer_callback(steps)])
    with _trace(folder, steps):
        trainer.train()
    return _losses(trainer)


def trainer_resume(rank: int, world: int, folder: str) -> dict:
    import zero_bnb
    from transformers import TrainerCallback

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.step = state.global_step

    zero_bnb.enable()
    start = Start()
    trainer = _trainer(folder, world, "sync", callbacks=[start])
    trainer.train(resume_from_checkpoint=True)
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history
              if "loss" in entry and entry["step"] > start.step}
    return {"resumed_from": start.step, "losses": losses}


def trainer_preempted(rank: int, world: int, folder: str) -> None:
    """Trainer with ``zero_bnb.PreemptionCallback()`` and no regular saves, SIGTERMed during step SECOND."""
    from transformers import TrainerCallback

    import zero_bnb

    class Preempt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == SECOND:
                _sigterm_the_job()

    zero_bnb.enable()
    _trainer(folder, world, "async", callbacks=[Preempt(), zero_bnb.PreemptionCallback()], save_steps=10**6).train()


def trainer_pick(folder: str) -> str | None:
    """What ``train(resume_from_checkpoint=True)`` resumes from: Trainer's own ``get_last_checkpoint``."""
    import transformers.trainer

    return transformers.trainer.get_last_checkpoint(folder)


# -- Accelerate ------------------------------------------------------------------------------------------------------


def _accelerator(folder: str, world: int, mode: str):
    import bitsandbytes as bnb
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration, set_seed
    from hf_scenarios import GLOBAL_BATCH, MICRO, ds_config, tiny_gpt2

    import zero_bnb

    config = ds_config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * world), gradient_clipping=1.0,
                       zero_optimization={"stage": 2}, zero_checkpoint_async=mode == "async")
    PartialState(cpu=True)  # on a machine without a GPU (README): else every process is process 0
    set_seed(0)  # Python's, NumPy's and torch's generators, whose states Accelerate saves
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), project_config=ProjectConfiguration(
        project_dir=folder, automatic_checkpoint_naming=True, total_limit=1))
    model = tiny_gpt2()
    zero_bnb.enable()
    model, optimizer = accelerator.prepare(model, bnb.optim.AdamW8bit(model.parameters(), lr=3e-3))
    return accelerator, model, optimizer


def accelerate_story(rank: int, world: int, folder: str, mode: str, steps: Steps) -> dict:
    from hf_scenarios import _accelerate_steps

    accelerator, model, optimizer = _accelerator(folder, world, mode)
    losses = {}
    with _trace(folder, steps):
        for step in range(STEPS):
            if step == SECOND:
                steps.after()
            losses[step + 1] = _accelerate_steps(accelerator, model, optimizer, step, 1)[0]
            if step + 1 == SECOND:
                steps.start()
            accelerator.save_state()  # checkpoints/checkpoint_{step}
            if step + 1 == SECOND:
                steps.returned()
        model.wait_for_checkpoint()
    return losses


def accelerate_resume(rank: int, world: int, folder: str) -> dict:
    from hf_scenarios import _accelerate_steps

    accelerator, model, optimizer = _accelerator(folder, world, "sync")
    accelerator.load_state()
    start = model.global_steps
    accelerator.project_configuration.iteration = STEPS  # past every folder of the story
    losses = {step + 1: _accelerate_steps(accelerator, model, optimizer, step, 1)[0] for step in range(start, STEPS)}
    return {"resumed_from": start, "losses": losses}


def accelerate_preempted(rank: int, world: int, folder: str) -> None:
    """Accelerate with ``zero_bnb.save_on_preemption(model, save=accelerator.save_state)`` and no regular saves,
    SIGTERMed before the last micro-batch of step SECOND."""
    from hf_scenarios import _accelerate_steps

    import zero_bnb

    accelerator, model, optimizer = _accelerator(folder, world, "async")
    zero_bnb.save_on_preemption(model, save=accelerator.save_state)
    for step in range(STEPS):
        if step + 1 == SECOND:
            _sigterm_the_job()
        _accelerate_steps(accelerator, model, optimizer, step, 1)


def accelerate_pick(folder: str) -> str | None:
    """What ``load_state()`` resumes from (automatic checkpoint naming, DeepSpeed)."""
    from zero_bnb.integrations.accelerate_checkpoints import newest_checkpoint

    return newest_checkpoint(os.path.join(folder, "checkpoints"), "pytorch_model")


# -- Lightning -------------------------------------------------------------------------------------------------------


def _lightning_fit(folder: str, world: int, mode: str, extra=(), ckpt_path=None, every_n_epochs: int = 1):
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_scenarios import GLOBAL_BATCH, MICRO, QUIET, _module, _step_losses

    from zero_bnb.integrations.lightning import ZeroBnbStrategy
    from zero_bnb.testing.toy import global_batch

    inputs, targets = global_batch(0, GLOBAL_BATCH)  # one optimizer step per epoch: every save at an epoch end
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=MICRO)
    accum = GLOBAL_BATCH // (MICRO * world)
    checkpoints = ModelCheckpoint(dirpath=folder, filename="{step}", save_last=True, save_top_k=1, monitor="step",
                                  mode="max", every_n_epochs=every_n_epochs)
    strategy = ZeroBnbStrategy(stage=2, config={"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                                                "zero_checkpoint_async": mode == "async"})
    module = _module()
    quiet = {**QUIET, "enable_checkpointing": True}
    # epochs, not max_steps: with max_steps Lightning restarts an epoch-end checkpoint inside its finished epoch
    trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_epochs=STEPS,
                         accumulate_grad_batches=accum, callbacks=[checkpoints, *extra], **quiet)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer, _step_losses(module.micro_losses, accum, world)


def _lightning_callback(steps: Steps):
    import lightning.pytorch as pl

    class Around(pl.Callback):
        """Traces the saves at the end of step SECOND (top-k, then last), from the end of that step on."""

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == SECOND and not steps.active:
                steps.start()

        def on_train_epoch_start(self, trainer, module):
            if trainer.global_step == SECOND:
                steps.returned()  # the epoch-end saves of step SECOND returned
                steps.after()

    return Around()


def lightning_story(rank: int, world: int, folder: str, mode: str, steps: Steps) -> dict:
    with _trace(folder, steps):
        _, losses = _lightning_fit(folder, world, mode, [_lightning_callback(steps)])
    return {start + 1: loss for start, loss in enumerate(losses)}


def lightning_resume(rank: int, world: int, folder: str) -> dict:
    _, losses = _lightning_fit(folder, world, "sync", ckpt_path="last")
    start = STEPS - len(losses)
    return {"resumed_from": start, "losses": {start + 1 + i: loss for i, loss in enumerate(losses)}}


def lightning_preempted(rank: int, world: int, folder: str) -> None:
    """Lightning with ``zero_bnb.lightning.SaveOnPreemption()`` and no regular saves, SIGTERMed during step SECOND
    (Lightning's own SIGTERM handler runs too)."""
    import lightning.pytorch as pl

    from zero_bnb.integrations.lightning import SaveOnPreemption

    class Preempt(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == SECOND - 1 and batch_idx == 0:
                _sigterm_the_job()

    _lightning_fit(folder, world, "async", [Preempt(), SaveOnPreemption()], every_n_epochs=10**6)


def lightning_pick(folder: str) -> str | None:
    """What ``fit(ckpt_path="last")`` resumes from: Lightning's ``last*.ckpt`` modified last, as zero_bnb's strategy
    loads it."""
    from zero_bnb.integrations.lightning_resume import complete_checkpoint

    last = [os.path.join(folder, name) for name in os.listdir(folder) if name.startswith("last") and name.endswith(".ckpt")]
    if not last:
        return None
    return complete_checkpoint(max(last, key=os.path.getmtime), [folder])


# -- the campaign ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Door:
    """One front door's story, automatic resume and naming."""

    story: Callable[..., dict]
    resume: Callable[[int, int, str], dict]
    pick: Callable[[str], str | None]
    step_of: Callable[[str], int]  # the training step a checkpoint folder of this front door holds
    first: str  # the complete checkpoint folder before the save under test
    second: tuple[str, ...]  # the folders of the save under test
    complete_at: tuple[str, str]  # rank 0's step after which the save under test is complete
    preempted: Callable[[int, int, str], None]  # the story with the front door's preemption one-liner, SIGTERMed
    last: str  # the folder of the story's last save (after step STEPS)


def _number(path: str) -> int:
    return int(re.findall(r"[0-9]+", os.path.basename(path))[0])


DOORS = {
    "trainer": Door(trainer_story, trainer_resume, trainer_pick, _number, f"checkpoint-{FIRST}",
                    (f"checkpoint-{SECOND}",), ("remove", f"checkpoint-{SECOND}/.zero_bnb-saving.json"), trainer_preempted,
                    f"checkpoint-{STEPS}"),
    "accelerate": Door(accelerate_story, accelerate_resume, accelerate_pick, lambda path: _number(path) + 1,
                       os.path.join("checkpoints", f"checkpoint_{FIRST - 1}"),
                       (os.path.join("checkpoints", f"checkpoint_{SECOND - 1}"),),
                       ("remove", os.path.join("checkpoints", f"checkpoint_{SECOND - 1}", ".zero_bnb-saving.json")),
                       accelerate_preempted, f"checkpoint_{STEPS - 1}"),
    "lightning": Door(lightning_story, lightning_resume, lightning_pick, lambda path: None, f"step={FIRST}.ckpt",
                      (f"step={SECOND}.ckpt", "last.ckpt"), ("replace", f"step={SECOND}.ckpt/latest"),
                      lightning_preempted, f"step={STEPS}.ckpt"),
}


def _belongs(door: Door) -> Callable[[str, str], bool]:
    """The steps of the save under test: anything in its folders, the deletion of the older checkpoint, ``returned``."""
    deletions = {"shutil.rmtree", "os.rmdir", "os.remove", "remove", "rename"}

    inside = tuple(f"{folder}{os.sep}" for folder in door.second)
    # a new front-door folder is made under a private name beside it (with its mark), then renamed into place
    private = tuple(os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.zero_bnb-new")
                    for folder in door.second)

    def belongs(kind: str, name: str) -> bool:
        if kind == "returned" or name.startswith(inside + private):
            return True
        if name in door.second:  # the folder itself: made, but not deleted (that is the next save's rotation)
            return kind not in deletions
        return kind in deletions and name == door.first

    return belongs


_PRIVATE = re.compile(r"^(.*?\.zero_bnb-(?:staging|new)-\*|.*?\.\*\.zero_bnb-tmp)/")


def _kill_points(steps: list[list[str]]) -> list[list[str]]:
    """The kill points among one rank's steps: every step on a name visible in the checkpoint folders (the front
    door's files, zero_bnb's tag, ``latest``, lock, mark and ``zero_to_fp32.py``, deletions, renames, ``returned``),
    and of the steps inside a private zero_bnb folder (a staging folder, a file's private folder) the first one: a
    kill anywhere inside leaves the same visible state, and ``tests/test_faults.py`` kills at each of them. Not
    ``write``/``fsync`` steps (:data:`_NOT_KILL_POINTS`)."""
    points, inside = [], set()
    for step in steps:
        private = _PRIVATE.match(step[1])
        if step[0] in _NOT_KILL_POINTS or (private and private.group(1) in inside):
            continue
        if private:
            inside.add(private.group(1))
        points.append(step)
    return points


#: Not part of a checkpoint's content: zero_bnb's private folders, its lock and marks, and ``zero_to_fp32.py`` (a
#: recovery script written after the commit).
_NOT_CONTENT = re.compile(r"(\.zero_bnb-(staging|new|tmp|replaced)|\.zero_bnb\.lock$|\.zero_bnb-saving\.json$|"
                          r"(^|/)zero_to_fp32\.py$)")


def _folder_state(folder: str | None, content: bool = False) -> str:
    """A digest of what ``folder`` holds: every name (random parts as ``*``), and every file's bytes but those of
    :data:`_VOLATILE` files; with ``content``, only what the checkpoint is (not :data:`_NOT_CONTENT`)."""
    from zero_bnb.testing.io_trace import step_name

    digest = hashlib.sha256()
    if folder is None:
        return "none"
    for root, folders, files in os.walk(folder):
        folders.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            if content and _NOT_CONTENT.search(step_name(path, folder)):
                continue
            digest.update(step_name(path, folder).encode() + b"\0")
            if not name.endswith(_VOLATILE) and not os.path.islink(path):
                with open(path, "rb") as handle:
                    digest.update(hashlib.sha256(handle.read()).digest())
        for name in folders:
            if not (content and _NOT_CONTENT.search(step_name(os.path.join(root, name), folder))):
                digest.update(step_name(os.path.join(root, name), folder).encode() + b"/\0")
    return digest.hexdigest()


#: What a job imports that the server may import for it: pure-Python front-door packages (not DeepSpeed's ops, whose
#: shared-memory communication a forked job must set up itself, nor torch's).
_WARM = ("transformers", "accelerate", "lightning", "safetensors", "huggingface_hub", "email", "importlib")


def _import_for_the_jobs(names: list[str]) -> None:
    """Import in the server what a job imported on its own (about 0.3 s of every forked job otherwise)."""
    for name in names:
        if name.split(".")[0] not in _WARM:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that only imports inside a job: the jobs import it themselves
            pass


def _campaign(workdir: str, name: str, door: Door) -> dict:
    from zero_bnb.testing.forks import fork_job

    belongs = _belongs(door)
    run = os.path.join(workdir, f"{name}_run")  # every job of the story runs here: equal outcomes, equal bytes
    result: dict = {"reference": {}, "trials": []}
    resumes: dict[tuple, dict] = {}
    for mode in MODES:
        recorders = {rank: Steps(belongs) for rank in range(2)}

        def reference(rank, world, mode=mode, recorders=recorders):
            imported = set(sys.modules)

            def snapshot():  # the checkpoint under test, complete: what a resume from it must read
                from zero_bnb.checkpoint.pending import wait_for_pending_saves

                wait_for_pending_saves()
                if rank == 0:
                    _write(f"{run}.complete.json", {folder: _folder_state(os.path.join(run, folder), content=True)
                                                    for folder in door.second})

            recorders[rank].snapshot = snapshot
            losses = door.story(rank, world, run, mode, recorders[rank])
            _write(f"{run}.rank{rank}.json", {"losses": losses, "steps": recorders[rank].seen,
                                              "imported": sorted(set(sys.modules) - imported)})

        status = fork_job(2, reference, f"{run}.reference_{mode}")
        seen = {rank: _read(f"{run}.rank{rank}.json") for rank in range(2)}
        _import_for_the_jobs(seen[0]["imported"])
        complete = _read(f"{run}.complete.json")
        reference_folder = os.path.join(workdir, f"{name}_reference_{mode}")
        os.rename(run, reference_folder)
        result["reference"][mode] = {"status": status, "losses": seen[0]["losses"], "complete": complete,
                                     "steps": {str(rank): seen[rank]["steps"] for rank in seen}}
        for victim in range(2):
            for step in _kill_points(seen[victim]["steps"]):
                trial = os.path.join(workdir, f"{name}_trial_{len(result['trials']):03d}")
                began = time.monotonic()
                status = fork_job(2, lambda rank, world, mode=mode, step=step, victim=victim: door.story(
                    rank, world, run, mode, Steps(belongs, tuple(step) if rank == victim else None)), trial)
                quiet = logging.getLogger("zero_bnb")
                level = quiet.level
                quiet.setLevel(logging.ERROR)  # the pick's WARNING is the resume job's to print
                try:
                    pick = door.pick(run)
                    # what the resume reads: the folder the front door picks (found per trial) and its checkpoint
                    content = _folder_state(pick, content=True)
                    key = (os.path.relpath(pick, run) if pick else None, content)
                except Exception as error:  # noqa: BLE001 - recorded; the test requires a pick
                    content = "none"
                    key = (f"pick failed: {type(error).__name__}: {error}", content)
                finally:
                    quiet.setLevel(level)
                os.rename(run, trial)
                killed = time.monotonic() - began
                if key not in resumes:  # the first trial whose resume reads this folder: resume it for real
                    out = f"{trial}.resumed.json"

                    def resumed(rank, world, trial=trial, out=out):
                        value = door.resume(rank, world, trial)
                        if rank == 0:
                            _write(out, value)

                    resume_status = fork_job(3, resumed, f"{trial}.resume")
                    resumes[key] = {"status": resume_status, "folder": trial,
                                    "result": _read(out) if os.path.exists(out) else None}
                result["trials"].append({
                    "mode": mode, "victim": victim, "step": step, "folder": trial, "status": status,
                    "pick": key[0], "pick_content": content, "resume": resumes[key],
                    "seconds": [round(killed, 2), round(time.monotonic() - began - killed, 2)]})
    signalled = os.path.join(workdir, f"{name}_preempted")
    status = fork_job(2, lambda rank, world: door.preempted(rank, world, signalled), signalled)
    out = f"{signalled}.resumed.json"

    def resumed(rank, world):
        value = door.resume(rank, world, signalled)
        if rank == 0:
            _write(out, value)

    result["preempted"] = {"status": status, "resume_status": fork_job(3, resumed, f"{signalled}.resume"),
                           "result": _read(out) if os.path.exists(out) else None}
    result["lost"] = _lost_last_save(workdir, name, door)
    return result


def _lost_last_save(workdir: str, name: str, door: Door) -> dict:
    """The story with asynchronous saves whose last one fails in rank 1's writer (a full disk): the end of the front
    door's training (``train()``, ``fit()``; Accelerate: ``wait_for_checkpoint``) raises it on every rank."""
    from zero_bnb.format import durable
    from zero_bnb.testing.forks import fork_job

    folder = os.path.join(workdir, f"{name}_lost")

    def job(rank, world):
        def full_disk(kind, path):
            if rank == 1 and kind == "write" and f"{os.sep}{door.last}{os.sep}" in path:
                raise OSError(28, "injected: no space left on device")

        durable.set_io_hook(full_disk)
        try:
            door.story(rank, world, folder, "async", Steps(lambda kind, step: False))
            raised = None
        except Exception as error:  # noqa: BLE001 - what the end of training raised is the result
            raised = f"{type(error).__name__}: {error}"
        _write(f"{folder}.rank{rank}.json", {"raised": raised})

    status = fork_job(2, job, folder)
    return {"status": status, "ranks": [_read(f"{folder}.rank{rank}.json") if os.path.exists(
        f"{folder}.rank{rank}.json") else None for rank in range(2)]}


def serve(workdir: str, doors: list[str]) -> None:
    """The campaigns of ``doors`` (in a server spawned by :func:`zero_bnb.testing.forks.run_server`, with the CPU ranks'
    environment: imports once, forks every job); writes ``{door}.json``."""
    import gc

    import torch

    torch.set_num_threads(1)
    import deepspeed  # noqa: F401 - imported once here, inherited by every forked job
    import hf_scenarios  # noqa: F401
    import lightning.pytorch  # noqa: F401
    import lightning_scenarios  # noqa: F401
    import transformers.trainer  # noqa: F401

    import zero_bnb
    import zero_bnb.ds.initialize  # noqa: F401
    import zero_bnb.integrations.lightning  # noqa: F401

    zero_bnb.enable()  # Trainer's resume_from_checkpoint=True as the jobs see it (they enable it too)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # transformers builds its checkpoint-conversion tables (0.4 s of regular expressions) at the first
    # save_pretrained of a process: built here once, inherited by every job
    hf_scenarios.tiny_gpt2().save_pretrained(os.path.join(workdir, "warm-up"))
    gc.freeze()
    for door in doors:
        _write(os.path.join(workdir, f"{door}.json"), _campaign(workdir, door, DOORS[door]))


def run_campaigns(workdir: str, doors: list[str]) -> dict[str, dict]:
    """Run :func:`serve` in a spawned process; returns what it wrote per front door."""
    from zero_bnb.testing.forks import run_server

    run_server(serve, workdir, doors, what="the kill campaigns' server")
    return {door: _read(os.path.join(workdir, f"{door}.json")) for door in doors}


if __name__ == "__main__":  # by hand: python tests/front_door_kills.py /tmp/kills trainer accelerate lightning
    import sys

    shutil.rmtree(sys.argv[1], ignore_errors=True)
    os.makedirs(sys.argv[1])
    began = time.monotonic()
    campaigns = run_campaigns(sys.argv[1], sys.argv[2:])
    for door, campaign in campaigns.items():
        print(door, len(campaign["trials"]), "trials", {mode: ref["status"] for mode, ref in
                                                        campaign["reference"].items()})
        for trial in campaign["trials"]:
            resume = trial["resume"]
            print(f"  {trial['mode']:5s} rank {trial['victim']} {trial['step']} {trial['status']} pick {trial['pick']}"
                  f" -> {resume['status']} {(resume['result'] or {}).get('resumed_from')} {trial['seconds']}")
    print(f"{time.monotonic() - began:.0f} s")
