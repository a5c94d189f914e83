"""Kill a rank with SIGKILL at chosen I/O steps of a checkpoint save, with real processes and files.

Three stages, each one process launch:

1. :func:`reference` (DP=2, spawned): trains, saves tag ``A`` into ``base/``, records the state at ``A`` and one
   step later (``B``) as bitsandbytes sees it (``optimizer_scenarios.bnb_view``: each rank's partition and state read
   from the inner optimizer, 8-bit codes dequantized by bitsandbytes; no zero_bnb code), and logs every durable I/O
   step of a clean save of ``B`` (new tag) and of a re-save of ``A`` (same tag) on each rank.
2. :func:`run_trials` (one spawned server that imports everything once, then forks :data:`_SLOTS` sub-servers that
   each run every ``_SLOTS``-th trial, forking a DP=2 pair per trial): each pair loads ``A`` from a copy of
   ``base/``, trains the same step, and saves; the victim rank SIGKILLs itself at its ``k``-th I/O step, the
   surviving rank is SIGKILLed (as a launcher would) if it has not died on its own within a grace period.
   In the ``async_new`` mode the save is asynchronous (``zero_checkpoint_async``): the I/O steps,
   and so the kill, happen in the background writer while the pair trains one more step.
3. :func:`verify` (DP=3, spawned): loads every trial folder and compares its bitsandbytes view with
   ``A`` and ``B`` bit for bit, step counters of every rank included.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import signal
import time
import traceback

import torch
import torch.distributed as dist

from zero_bnb.format import durable
from zero_bnb.testing.forks import run_server
from zero_bnb.testing.launch import init_worker
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import param_groups, train_steps

STEPS_TO_A = 2
# save mode -> tag the interrupted save writes
# (an asynchronous save publishes through the same commit as a synchronous one: its re-save of a tag is not repeated)
MODES = {"new": "B", "overwrite": "A", "async_new": "B"}
_GRACE_S = 2.0
_TRIAL_TIMEOUT_S = 60.0
#: Trials run at once (each in a sub-server of its own).
_SLOTS = 2


def _engine(world):
    from scenarios import make_engine

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return make_engine(world)


def _view(engine):
    """Bitsandbytes' view of the engine's state (rank 0; None elsewhere): the oracle shares no code with zero_bnb."""
    from optimizer_scenarios import bnb_view

    return bnb_view(engine, param_groups(engine.module))


def _asynchronous(engine, mode: str) -> None:
    """Make ``engine``'s saves asynchronous in the ``async_*`` modes, synchronous in the others."""
    engine.zero_bnb_config = dataclasses.replace(engine.zero_bnb_config, checkpoint_async=mode.startswith("async"))


def _save(engine, folder: str, mode: str) -> None:
    """A save of ``mode``; an asynchronous one is followed by a training step overlapping its writer, then a wait."""
    _asynchronous(engine, mode)
    engine.save_checkpoint(folder, tag=MODES[mode])
    if mode.startswith("async"):
        train_steps(engine, RUN, STEPS_TO_A + 1, 1)  # must not reach the checkpoint
        engine.wait_for_checkpoint()


def _events_of(save) -> list[list[str]]:
    events: list[list[str]] = []
    durable.set_io_hook(lambda event, path: events.append([event, os.path.basename(path)]))
    try:
        save()
    finally:
        durable.set_io_hook(None)
    return events


def reference(rank, world, workdir):
    """Stage 1: the base checkpoint, the two reference states, and each rank's I/O steps per mode."""
    engine = _engine(world)
    train_steps(engine, RUN, 0, STEPS_TO_A)
    base = os.path.join(workdir, "base")
    engine.save_checkpoint(base, tag="A")
    state_a = _view(engine)
    train_steps(engine, RUN, STEPS_TO_A, 1)
    state_b = _view(engine)
    events = {}
    for mode in MODES:
        folder = os.path.join(workdir, f"clean_{mode}")
        if rank == 0:
            shutil.copytree(base, folder)
        dist.barrier()
        events[mode] = _events_of(lambda folder=folder, mode=mode: _save(engine, folder, mode))
    gathered = [None] * world
    dist.all_gather_object(gathered, events)
    if rank == 0:
        torch.save({"A": state_a, "B": state_b}, os.path.join(workdir, "references.pt"))
        with open(os.path.join(workdir, "events.json"), "w") as handle:
            json.dump(gathered, handle)


def _kill_at(index: int):
    count = [0]

    def hook(event: str, path: str) -> None:
        if count[0] == index:
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1

    return hook


def _trial_child(rank: int, folder: str, store: str, trial: dict) -> None:
    init_worker(rank, 2, store)
    engine = _engine(2)
    engine.load_checkpoint(folder)
    train_steps(engine, RUN, STEPS_TO_A, 1)
    if rank == trial["victim"]:
        durable.set_io_hook(_kill_at(trial["index"]))
    _save(engine, folder, trial["mode"])
    dist.destroy_process_group()


def _status(code: int) -> str:
    if os.WIFSIGNALED(code):
        return signal.Signals(os.WTERMSIG(code)).name
    return f"exit {os.WEXITSTATUS(code)}"


def _run_trial(workdir: str, number: int, trial: dict) -> dict:
    folder = os.path.join(workdir, f"trial_{number:03d}")
    store = os.path.join(workdir, f"store_{number:03d}")
    shutil.copytree(os.path.join(workdir, "base"), folder)
    pids = {}
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:  # child: never return into the server loop
            code = 1
            log = os.open(f"{folder}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            try:
                _trial_child(rank, folder, store, trial)
                code = 0
            except BaseException:  # noqa: BLE001 - the exit code reports it
                traceback.print_exc()
            finally:
                os._exit(code)
        pids[rank] = pid
    status: dict[int, str] = {}
    started, grace_end = time.monotonic(), None
    while len(status) < 2:
        for rank, pid in pids.items():
            if rank not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[rank] = _status(code)
        now = time.monotonic()
        if status and grace_end is None:
            grace_end = now + _GRACE_S
        if (grace_end is not None and now > grace_end) or now - started > _TRIAL_TIMEOUT_S:
            for rank, pid in pids.items():
                if rank not in status:
                    os.kill(pid, signal.SIGKILL)
                    status[rank] = "killed by harness: " + _status(os.waitpid(pid, 0)[1])
        time.sleep(0.005)
    return {**trial, "folder": folder, "status": {str(rank): text for rank, text in status.items()}}


def _serve(workdir: str, trials: list[dict]) -> None:
    # run_server started this process with the CPU ranks' environment, before DeepSpeed picked its accelerator at
    # import: the forked trials inherit both, so on a machine with GPUs they stay on the CPU too
    torch.set_num_threads(1)
    import deepspeed  # noqa: F401 - imported once here, inherited by every forked trial
    import scenarios  # noqa: F401

    gc.freeze()  # the imports are never garbage: left out of every trial's collections (zero_bnb.testing.launch)

    # Trials are independent (a folder and a store each): _SLOTS forked sub-servers run every _SLOTS-th one, so the
    # cores a trial leaves idle (its ranks wait on each other, on fsync, on the grace period) serve another.
    slots = {}
    for slot in range(_SLOTS):
        pid = os.fork()
        if pid == 0:  # a sub-server: never returns into this loop
            code = 1
            try:
                mine = [_run_trial(workdir, number, trial) for number, trial in enumerate(trials)
                        if number % _SLOTS == slot]
                with open(os.path.join(workdir, f"trials.{slot}.json"), "w") as handle:
                    json.dump(mine, handle)
                code = 0
            except BaseException:  # noqa: BLE001 - the exit status reports it, the traceback the log
                traceback.print_exc()
            finally:
                os._exit(code)
        slots[slot] = pid
    failed = {slot: _status(os.waitpid(pid, 0)[1]) for slot, pid in slots.items()}
    failed = {slot: status for slot, status in failed.items() if status != "exit 0"}
    if failed:
        raise RuntimeError(f"fault-injection sub-servers failed: {failed}")
    results = []
    for slot in range(_SLOTS):
        with open(os.path.join(workdir, f"trials.{slot}.json")) as handle:
            results += json.load(handle)
    results.sort(key=lambda result: result["folder"])  # trial_NNN: the trials' order
    with open(os.path.join(workdir, "trials.json"), "w") as handle:
        json.dump(results, handle)


def run_trials(workdir: str, trials: list[dict]) -> list[dict]:
    """Stage 2: run every ``{"mode", "victim", "index"}`` trial; returns each with its folder and exit statuses."""
    run_server(_serve, workdir, trials, what="the fault-injection server")
    with open(os.path.join(workdir, "trials.json")) as handle:
        return json.load(handle)


def verify(rank, world, workdir, folders):
    """Stage 3: load each folder's ``latest`` at DP=``world``; record which reference it equals."""
    from optimizer_scenarios import views_differ

    references = torch.load(os.path.join(workdir, "references.pt"), weights_only=False)
    engine = _engine(world)
    outcomes = {}
    for folder in folders:
        try:
            engine.load_checkpoint(folder)
        except Exception as error:  # noqa: BLE001 - recorded and asserted on by the test
            outcomes[folder] = f"load failed: {type(error).__name__}: {error}"
            continue
        state = _view(engine)
        if rank == 0:
            matches = [name for name, ref in references.items() if not views_differ(ref, state)]
            outcomes[folder] = matches[0] if len(matches) == 1 else f"matches {matches}"
    if rank == 0:
        with open(os.path.join(workdir, "verified.json"), "w") as handle:
            json.dump(outcomes, handle)
