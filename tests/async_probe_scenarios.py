"""A break-it probe of asynchronous saves (``zero_checkpoint_async``, issue 35): one real DP=2 launch.

What a careless user does around a pending save: ZeRO stage 2 and 3, optimizer offload and BF16_Optimizer with
state changed right after the call (masters, 8-bit state, weights, LR scheduler, ``client_state``); a second engine
saving into the same folder; a staging limit that the ranks hit at different points; the save folder removed while
the writer runs; an exception in a training step while a save is pending; the same tag twice; ``destroy()`` twice.

Each check records a value or ``"ErrorClass: message"`` per rank; rank 0 writes all ranks' records to
``async_probe.pt`` for ``tests/test_async_save.py``.
"""

from __future__ import annotations

import copy
import os
import shutil

import torch
import torch.distributed as dist
from async_scenarios import _slow_writes
from integrity_scenarios import _listing
from scenarios import _error, make_engine, run_phases

import zero_bnb
from zero_bnb.format import durable
from zero_bnb.testing.consolidate import consolidated_state, state_differences
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import train_steps

#: An LR scheduler whose state changes every step (its state goes into DeepSpeed's model file).
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 50}}

#: name -> extra DeepSpeed config of the engines the leak check saves asynchronously.
CASES = {
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
    "offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "bf16opt": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
}


def _nothing_after_the_call_leaks(c, out):
    """At ZeRO 2 and 3, with optimizer offload and with BF16_Optimizer: the checkpoint holds the optimizer state,
    LR scheduler state and client_state at the call, though training and the user change them right after."""
    rank, world, workdir = c["rank"], c["world"], c["workdir"]
    for name, extra in CASES.items():
        config = {**extra, "scheduler": SCHEDULER}
        engine = make_engine(world, zero_checkpoint_async=True, **config)
        train_steps(engine, RUN, 0, 2)
        at_call = consolidated_state(engine)
        scheduler_at_call = copy.deepcopy(engine.lr_scheduler.state_dict())
        client = {"box": {"seen": [1, 2]}, "tensor": torch.arange(4.0), "steps": engine.global_steps}
        folder = os.path.join(workdir, f"leak_{name}")
        durable.set_io_hook(_slow_writes(0.01))
        try:
            engine.save_checkpoint(folder, tag="A", client_state=client)
            out[f"pending:{name}"] = engine._zero_bnb_background.pending
            client["box"]["seen"].append(3)  # the user's objects, changed after the call
            client["tensor"].add_(100.0)
            train_steps(engine, RUN, 2, 2)
            with torch.no_grad():
                for param in engine.module.parameters():
                    param.add_(1.0)
            engine.wait_for_checkpoint()
        finally:
            durable.set_io_hook(None)
        fresh = make_engine(world, **config)
        _, loaded_client = fresh.load_checkpoint(folder)
        loaded = consolidated_state(fresh)
        if rank == 0:
            out[f"differences:{name}"] = state_differences(at_call, loaded)[1]
        out[f"scheduler:{name}"] = fresh.lr_scheduler.state_dict() == scheduler_at_call
        out[f"client:{name}"] = (loaded_client["box"], loaded_client["tensor"].tolist(), loaded_client["steps"])
        out[f"verify:{name}"] = _error(lambda: zero_bnb.verify_checkpoint(folder))
        for each in (engine, fresh):
            each.destroy()


def _second_engine_same_folder(c, out):
    """Two engines of one run save into one folder (different tags): the second save does not fail because the
    first engine's asynchronous save still holds the folder's lock; the second engine loading the folder right after
    the first one's save returned loads that checkpoint."""
    world, workdir, engine = c["world"], c["workdir"], c["engine"]
    folder = os.path.join(workdir, "two_engines")
    other = make_engine(world)
    train_steps(other, RUN, 0, 1)
    durable.set_io_hook(_slow_writes(0.02))
    try:
        engine.save_checkpoint(folder, tag="first", save_latest=False)
        out["second_engine_pending"] = engine._zero_bnb_background.pending
        out["second_engine_save"] = _error(lambda: other.save_checkpoint(folder, tag="second"))
        out["first_engine_wait"] = _error(engine.wait_for_checkpoint)
    finally:
        durable.set_io_hook(None)
    out["two_engines_listing"] = _listing(folder) if os.path.isfile(os.path.join(folder, "latest")) else None
    # the other engine loads the folder right after this engine's save returned: the checkpoint just saved, as a
    # synchronous save would give it
    at_call = consolidated_state(engine)
    durable.set_io_hook(_slow_writes(0.02))
    try:
        engine.save_checkpoint(folder, tag="third")
        out["other_load"] = _error(lambda: other.load_checkpoint(folder))
    finally:
        durable.set_io_hook(None)
    loaded = consolidated_state(other)
    if c["rank"] == 0:
        out["other_load_differences"] = state_differences(at_call, loaded)[1]
    out["other_load_wait"] = _error(engine.wait_for_checkpoint)
    other.destroy()


def _limit_the_ranks_hit_differently(c, out):
    """A staging limit hit by one rank and not the other, in the shard or in the module slices: the files not staged
    are written before the call returns, and the checkpoint still holds the state at the call."""
    rank, world, workdir, engine = c["rank"], c["world"], c["workdir"], c["engine"]
    engine.save_checkpoint(os.path.join(workdir, "limits"), tag="unbounded")
    engine.wait_for_checkpoint()
    staged = [None] * world
    dist.all_gather_object(staged, engine._zero_bnb_background.pool.staged_bytes)
    out["unbounded_staged"] = staged
    # rank 0 stages DeepSpeed's model file (first), its shard and views; rank 1 its shard and then its module slices
    limits = {"mid": (staged[0] + staged[1]) / 2, "below_rank1": 0.96 * staged[1]}
    for label, limit in limits.items():
        bounded = make_engine(world, zero_checkpoint_async=True, zero_checkpoint_async_max_staging_mb=limit / 2**20)
        train_steps(bounded, RUN, 0, 2)
        at_call = consolidated_state(bounded)
        folder = os.path.join(workdir, f"limit_{label}")
        out[f"limit_save:{label}"] = _error(lambda: bounded.save_checkpoint(folder, tag="B"))
        train_steps(bounded, RUN, 2, 1)
        out[f"limit_wait:{label}"] = _error(bounded.wait_for_checkpoint)
        fresh = make_engine(world)
        fresh.load_checkpoint(folder)
        loaded = consolidated_state(fresh)
        if rank == 0:
            out[f"limit_differences:{label}"] = state_differences(at_call, loaded)[1]
        out[f"limit_held:{label}:{rank}"] = bounded._zero_bnb_background.pool.held_bytes <= limit
        for each in (bounded, fresh):
            each.destroy()


def _folder_removed_while_writing(c, out):
    """The save folder removed (rank 0, at its writer's first write) while the writer runs: the error is raised by
    the next call, and the next save into that folder works."""
    rank, workdir, engine = c["rank"], c["workdir"], c["engine"]
    folder = os.path.join(workdir, "removed")
    engine.save_checkpoint(folder, tag="before")
    engine.wait_for_checkpoint()
    removed = [False]

    def remove_folder(event, path):
        if event == "write" and not removed[0] and rank == 0:
            removed[0] = True
            shutil.rmtree(folder)

    dist.barrier()
    durable.set_io_hook(remove_folder)
    try:
        out["removed_save"] = _error(lambda: engine.save_checkpoint(folder, tag="during"))
        out["removed_wait"] = _error(engine.wait_for_checkpoint)
    finally:
        durable.set_io_hook(None)
    out["removed_exists"] = os.path.exists(os.path.join(folder, "during"))
    out["removed_again"] = _error(lambda: (engine.save_checkpoint(folder, tag="after"), engine.wait_for_checkpoint()))
    out["removed_listing"] = _listing(folder) if os.path.isfile(os.path.join(folder, "latest")) else None


def _exception_while_pending(c, out):
    """A training step that raises while a save is pending: the save still commits; training goes on after."""
    workdir, engine = c["workdir"], c["engine"]
    folder = os.path.join(workdir, "raising")
    at_call = consolidated_state(engine)
    durable.set_io_hook(_slow_writes(0.01))
    try:
        engine.save_checkpoint(folder, tag="T")
        out["raising_step"] = _error(lambda: engine(torch.zeros(2, 7)))  # wrong input width: raises in forward
        out["raising_train_after"] = _error(lambda: train_steps(engine, RUN, 3, 1))
        out["raising_wait"] = _error(engine.wait_for_checkpoint)
    finally:
        durable.set_io_hook(None)
    fresh = make_engine(c["world"])
    fresh.load_checkpoint(folder)
    loaded = consolidated_state(fresh)
    if c["rank"] == 0:
        out["raising_differences"] = state_differences(at_call, loaded)[1]
    fresh.destroy()


def _same_tag_twice_and_destroy_twice(c, out):
    """The same tag saved twice back to back holds the second call's state; ``destroy()`` twice is harmless."""
    world, workdir, engine = c["world"], c["workdir"], c["engine"]
    folder = os.path.join(workdir, "twice")
    durable.set_io_hook(_slow_writes(0.005))
    try:
        engine.save_checkpoint(folder, tag="X")
        train_steps(engine, RUN, 4, 1)
        second = consolidated_state(engine)
        engine.save_checkpoint(folder, tag="X")
        train_steps(engine, RUN, 5, 1)
        engine.wait_for_checkpoint()
    finally:
        durable.set_io_hook(None)
    out["twice_listing"] = _listing(folder)
    fresh = make_engine(world)
    fresh.load_checkpoint(folder)
    loaded = consolidated_state(fresh)
    if c["rank"] == 0:
        out["twice_differences"] = state_differences(second, loaded)[1]
    fresh.destroy()
    other = make_engine(world, zero_checkpoint_async=True)
    other.save_checkpoint(folder, tag="Y")
    out["destroy_first"] = _error(other.destroy)
    out["destroy_second"] = _error(other.destroy)
    out["destroyed_verify"] = _error(lambda: zero_bnb.verify_checkpoint(folder, "Y"))


def _trainer_rotation_while_pending(c, out):
    """Trainer with save_total_limit=1 saving every 2 steps, the writer slower than 2 steps: at every moment after the
    first commit some checkpoint folder is complete (its ``latest`` written, which the commit does last), and the
    last folder holds everything Trainer wrote into it. Trainer writes the model weights into its next checkpoint
    folder before DeepSpeed's save waits for the pending one; the rotation deferred to that pending save's commit
    (sorted by modification time, which the commit renews) deleted that newer folder with the weights in it."""
    import threading
    import time

    from hf_scenarios import _trainer, ds_config

    run_dir = os.path.join(c["workdir"], "rotation")
    gaps, stop, committed = [], threading.Event(), [False]

    def complete() -> list[str]:
        names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
        return [name for name in names if os.path.isfile(os.path.join(run_dir, name, "latest"))]

    def watch() -> None:
        while not stop.is_set():
            if complete():
                committed[0] = True
            elif committed[0]:
                gaps.append(sorted(os.listdir(run_dir)))
            time.sleep(0.002)

    zero_bnb.enable()
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        trainer = _trainer(c["workdir"], c["world"], name="rotation", max_steps=6, save_steps=2, save_total_limit=1,
                           config=ds_config(zero_checkpoint_async=True))
        if c["rank"] == 0:
            watcher.start()
        durable.set_io_hook(_slow_writes(0.03))
        trainer.train()
        trainer.model_wrapped.wait_for_checkpoint()
    finally:
        durable.set_io_hook(None)
        stop.set()
        zero_bnb.disable()
    if c["rank"] == 0:
        watcher.join()
        out["rotation_gaps"] = gaps[:3]
        out["rotation_committed"] = committed[0]
        out["rotation_last_files"] = sorted(os.listdir(os.path.join(run_dir, "checkpoint-6")))
        out["rotation_folders"] = sorted(name for name in os.listdir(run_dir) if name.startswith("checkpoint"))
    out["rotation_verify"] = _error(lambda: zero_bnb.verify_checkpoint(os.path.join(run_dir, "checkpoint-6")))


def probe(rank, world, workdir):
    out: dict = {}
    engine = make_engine(world, zero_checkpoint_async=True)
    train_steps(engine, RUN, 0, 2)
    context = {"rank": rank, "world": world, "workdir": workdir, "engine": engine}
    run_phases(out, context, _nothing_after_the_call_leaks, _second_engine_same_folder,
               _limit_the_ranks_hit_differently, _folder_removed_while_writing, _exception_while_pending,
               _same_tag_twice_and_destroy_twice, _trainer_rotation_while_pending)
    durable.set_io_hook(None)
    _error(engine.wait_for_checkpoint)
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        torch.save(gathered, os.path.join(workdir, "async_probe.pt"))
