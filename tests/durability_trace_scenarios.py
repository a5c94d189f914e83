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
