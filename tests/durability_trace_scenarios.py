"""Saves run under the system-call recorder of tests/csrc/fsync_trace.c (tests/test_durability_trace.py).

One launch per DP size: a sequence of saves into ``{workdir}/root/ckpt`` (a first save into a new folder, a new tag,
an asynchronous new tag, a re-save of the tag ``latest`` names); each save's window of time (CLOCK_MONOTONIC, the
recorder's clock), the durable I/O steps zero_bnb reports to its hook (``durable.set_io_hook``, the fault campaign's
kill points) and a copy of the folder after each save (outside the recorded root) go to ``{workdir}/run.json`` and
``{workdir}/snap/``. At DP=1, mutants follow: each a save with one fsync of zero_bnb's left out, in a folder of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from zero_bnb.checkpoint import commit
from zero_bnb.format import durable, publish
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import train_steps

#: name, tag, asynchronous: the saves into ``root/ckpt``, in order
SAVES = [("first", "A", False), ("new", "B", False), ("async_new", "C", True), ("overwrite", "C", False)]
#: mutant -> what it leaves out (each in ``root/mutant_{name}``: a save of tag ``P``, then the mutant's save of ``M``)
MUTANTS = {
    "manifest_fsync": "the fsync of zero_bnb/manifest.json",
    "subfolder_fsync": "the fsync of the tag's zero_bnb/ folder before the tag is renamed into place",
    "tag_rename_fsync": "the fsync of the save folder after the tag folder's rename (before latest's)",
}


class _OsWithout:
    """The ``os`` module, but ``fsync`` skips descriptors whose path ends in ``/{name}``."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute):
        return getattr(os, attribute)

    def fsync(self, descriptor: int) -> None:
        if not os.readlink(f"/proc/self/fd/{descriptor}").endswith("/" + self._name):
            os.fsync(descriptor)


@contextmanager
def _mutant(name: str):
    """Leave out one fsync of zero_bnb's while the block runs (test code patching the library in this process)."""
    if name == "manifest_fsync":
        saved, durable.os = durable.os, _OsWithout("manifest.json")
        try:
            yield
        finally:
            durable.os = saved
    elif name == "subfolder_fsync":
        real = commit.fsync_dir
        commit.fsync_dir = lambda path: None if os.path.basename(path) == "zero_bnb" else real(path)
        try:
            yield
        finally:
            commit.fsync_dir = real
    elif name == "tag_rename_fsync":
        real = publish._sync_published
        # finish_publish syncs the save folder for the tag (path: the tag folder); StagedFile for latest (path: latest)
        publish._sync_published = lambda path, folder: None if os.path.basename(path) == "M" else real(path, folder)
        try:
            yield
        finally:
            publish._sync_published = real
    else:
        raise ValueError(name)


def _save(engine, save_dir: str, tag: str, asynchronous: bool, step: int, hooked: list) -> dict:
    """One save, timed from before any rank starts it until every rank has it committed (an asynchronous one: while a
    training step runs, then waited for); returns the window and this rank's hook events in it."""
    engine.zero_bnb_config = dataclasses.replace(engine.zero_bnb_config, checkpoint_async=asynchronous)
    first = len(hooked)
    dist.barrier()
    start = time.monotonic_ns()
    engine.save_checkpoint(save_dir, tag=tag)
    if asynchronous:
        train_steps(engine, RUN, step, 1)
        engine.wait_for_checkpoint()
    dist.barrier()
    return {"start": start, "end": time.monotonic_ns(), "events": hooked[first:], "pid": os.getpid()}


def traced_saves(rank, world, workdir, mutants):
    from scenarios import make_engine

    hooked: list = []
    durable.set_io_hook(lambda event, path: hooked.append([time.monotonic_ns(), threading.get_native_id(), event,
                                                           path]))
    engine = make_engine(world)
    root = os.path.join(workdir, "root")
    windows = {}
    step = 0

    def snapshot(name: str) -> None:
        if rank == 0:
            shutil.copytree(root, os.path.join(workdir, "snap", name), symlinks=True)
        dist.barrier()

    for name, tag, asynchronous in SAVES:
        train_steps(engine, RUN, step, 1)
        step += 1
        windows[name] = _save(engine, os.path.join(root, "ckpt"), tag, asynchronous, step, hooked)
        step += asynchronous
        snapshot(name)
    for name in mutants:
        folder = os.path.join(root, f"mutant_{name}")
        windows[f"{name}:P"] = _save(engine, folder, "P", False, step, hooked)
        snapshot(f"{name}:P")
        with _mutant(name):
            windows[name] = _save(engine, folder, "M", False, step, hooked)
        snapshot(name)
    durable.set_io_hook(None)
    gathered = [None] * world
    dist.all_gather_object(gathered, windows)
    if rank == 0:
        with open(os.path.join(workdir, "run.json"), "w") as handle:
            json.dump({"saves": [name for name, _, _ in SAVES], "mutants": list(mutants), "ranks": gathered}, handle)


#: The front doors whose checkpoint folder zero_bnb marks unfinished until it is complete (tests/front_door_kills.py).
FRONT_DOORS = ("trainer", "accelerate")


def _front_door_job(rank: int, world: int, workdir: str, door: str, mode: str) -> None:
    """One front door's story of tests/front_door_kills.py at DP=``world`` (a save after step 1, the save under test
    after step 2, whose completion deletes the first, a third) in ``{workdir}/root/{door}_{mode}``. The save under
    test is timed from the end of step 2 (the earlier save committed) until step 3 begins with it committed; the
    story's folder is copied to ``{workdir}/snap/{door}_{mode}:before`` and ``:after`` at those two instants, the
    window written to ``{workdir}/{door}_{mode}.json``."""
    import front_door_kills as kills

    from zero_bnb.checkpoint.pending import wait_for_pending_saves

    name = f"{door}_{mode}"
    folder = os.path.join(workdir, "root", name)
    window: dict = {"pid": os.getpid()}

    def snapshot(moment: str) -> None:
        if rank == 0:
            shutil.copytree(folder, os.path.join(workdir, "snap", f"{name}:{moment}"), symlinks=True)
        dist.barrier()

    class Window(kills.Steps):
        def start(self) -> None:
            super().start()  # the earlier save committed
            dist.barrier()
            snapshot("before")
            window["start"] = time.monotonic_ns()

        def after(self) -> None:
            wait_for_pending_saves()
            dist.barrier()
            window["end"] = time.monotonic_ns()
            snapshot("after")

    kills.DOORS[door].story(rank, world, folder, mode, Window(lambda kind, step: False))
    if rank == 0:
        with open(os.path.join(workdir, f"{name}.json"), "w") as handle:
            json.dump(window, handle)


def serve_front_doors(workdir: str, doors: list[str]) -> None:
    """Run :func:`_front_door_job` for each of ``doors`` and both save modes as a DP=2 job forked by this process (a
    spawned server that imported the front doors once, as tests/front_door_kills.py's: the recorder preloaded into it
    is in every fork); writes ``{workdir}/front_doors.json``: the job statuses."""
    import front_door_kills as kills
    import hf_scenarios  # noqa: F401 - imported once here, inherited by every forked job
    import torch

    from zero_bnb.testing.forks import fork_job

    torch.set_num_threads(1)
    statuses = {}
    for door in doors:
        for mode in kills.MODES:
            statuses[f"{door}_{mode}"] = fork_job(
                2, lambda rank, world, door=door, mode=mode: _front_door_job(rank, world, workdir, door, mode),
                os.path.join(workdir, f"{door}_{mode}"))
    with open(os.path.join(workdir, "front_doors.json"), "w") as handle:
        json.dump(statuses, handle)
