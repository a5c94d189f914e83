"""One DP=2 launch of asynchronous saves (``zero_checkpoint_async``): what is saved, waits, failures, memory.

Each check records a value or ``"ErrorClass: message"`` per rank; rank 0 writes all ranks' records to
``async.pt`` for ``tests/test_async_save.py``.
"""

from __future__ import annotations

import os
import resource
import signal
import time

import torch
import torch.distributed as dist
from integrity_scenarios import _fail_when, _listing
from optimizer_scenarios import bnb_view, views_differ
from scenarios import _error, make_engine, run_phases

import zero_bnb
from zero_bnb.format import durable
from zero_bnb.format.manifest import read_manifest
from zero_bnb.testing.consolidate import consolidated_state, state_differences
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import param_groups, train_steps


def _same_file(first: str, second: str) -> bool:
    """The same bytes (the background writer, like a synchronous save, writes no zip CRC-32: the switch is per
    thread) and, to say what differs when they are not, the same loaded content (tensors bit for bit, their dtypes,
    every other value)."""
    with open(first, "rb") as a, open(second, "rb") as b:
        if a.read() == b.read():
            return True
    if os.path.getsize(first) == os.path.getsize(second) and _same_value(torch.load(first, weights_only=False),
                                                                        torch.load(second, weights_only=False)):
        raise AssertionError(f"{first} and {second} hold the same values in different bytes")
    return False


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return a == b


def _slow_writes(seconds: float):
    """An I/O hook that makes every write of the background writer slow (so training overlaps it)."""
    return lambda event, path: time.sleep(seconds) if event == "write" else None


def _same_as_sync(c, out):
    """An asynchronous save holds exactly the state at the call, whatever training does next; its files are the
    ones a synchronous save of the same state writes; a load waits for it."""
    workdir, engine, twin = c["workdir"], c["engine"], c["twin"]
    at_call = consolidated_state(engine)
    at_call_bnb = bnb_view(engine, param_groups(engine.module))  # bitsandbytes' view: no zero_bnb code
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    client = {"epoch": [3], "note": "at the call"}
    slow = _slow_writes(0.02)
    durable.set_io_hook(slow)  # the writer is slow, so the steps below overlap it
    began = time.perf_counter()
    engine.save_checkpoint(os.path.join(workdir, "async"), tag="A", client_state=client)
    blocked = time.perf_counter() - began
    out["returned_while_pending"] = engine._zero_bnb_background.pending
    client["epoch"].append(4)  # changed after the call: must not reach the checkpoint
    client["note"] = "changed"
    out["losses_overlapping"] = train_steps(engine, RUN, 2, 2)  # DP=2 all-reduces while the writer commits
    with torch.no_grad():
        for param in engine.module.parameters():
            param.add_(1.0)  # module weights changed in place too
    engine.wait_for_checkpoint()
    durable.set_io_hook(None)
    out[f"blocked_and_background:{c['rank']}"] = (blocked, engine._zero_bnb_background.last_duration)
    twin.save_checkpoint(os.path.join(workdir, "sync"), tag="A", client_state={"epoch": [3], "note": "at the call"})
    out["twin_losses"] = train_steps(twin, RUN, 2, 2)
    for name in ("async", "sync"):
        zero_bnb.verify_checkpoint(os.path.join(workdir, name))
    fresh = make_engine(c["world"])
    _, client_loaded = fresh.load_checkpoint(os.path.join(workdir, "async"))
    loaded = consolidated_state(fresh)
    loaded_bnb = bnb_view(fresh, param_groups(fresh.module))
    if c["rank"] == 0:
        out["state_differences"] = state_differences(at_call, loaded)[1]
        out["bnb_differences"] = views_differ(at_call_bnb, loaded_bnb)
        out["bnb_checked"] = sorted(at_call_bnb["params"])
    out["client_state"] = {key: client_loaded[key] for key in ("epoch", "note")}
    out["weights_differ"] = [n for n, p in fresh.module.named_parameters() if not torch.equal(p, weights[n])]
    folders = [os.path.join(workdir, name, "A") for name in ("async", "sync")]
    out["same_files"] = sorted(os.listdir(os.path.join(folders[0], "zero_bnb"))) == sorted(
        os.listdir(os.path.join(folders[1], "zero_bnb")))
    shard = f"zero_bnb/shard_0000{c['rank']}-of-00002.pt"
    out[f"same_shard_bytes:{c['rank']}"] = all(
        _same_file(os.path.join(folders[0], path), os.path.join(folders[1], path))
        for path in (shard, "mp_rank_00_model_states.pt"))
    fresh.destroy()


def _bf16(c, out):
    """bf16: the masters derive from the module weights in the background writer (low 16 bits and exceptions),
    to the bytes a synchronous save writes."""
    workdir, rank = c["workdir"], c["rank"]
    engines = {name: make_engine(c["world"], bf16={"enabled": True}, zero_checkpoint_async=name == "async")
               for name in ("async", "sync")}
    for engine in engines.values():
        train_steps(engine, RUN, 0, 2)
    at_call = consolidated_state(engines["async"])
    at_call_bnb = bnb_view(engines["async"], param_groups(engines["async"].module))
    for name, engine in engines.items():
        engine.save_checkpoint(os.path.join(workdir, f"bf16_{name}"), tag="A")
    train_steps(engines["async"], RUN, 2, 1)
    engines["async"].wait_for_checkpoint()
    folders = [os.path.join(workdir, f"bf16_{name}", "A") for name in ("async", "sync")]
    out[f"bf16_same_bytes:{rank}"] = all(
        _same_file(os.path.join(folders[0], path), os.path.join(folders[1], path))
        for path in (f"zero_bnb/shard_0000{rank}-of-00002.pt", "mp_rank_00_model_states.pt"))
    out["bf16_masters"] = [group.masters for group in read_manifest(os.path.join(folders[0], "zero_bnb")).groups]
    fresh = make_engine(c["world"], bf16={"enabled": True})
    fresh.load_checkpoint(os.path.join(workdir, "bf16_async"))
    loaded = consolidated_state(fresh)
    loaded_bnb = bnb_view(fresh, param_groups(fresh.module))
    if rank == 0:
        out["bf16_differences"] = state_differences(at_call, loaded)[1]
        out["bf16_bnb_differences"] = views_differ(at_call_bnb, loaded_bnb)
    for engine in (*engines.values(), fresh):
        engine.destroy()


def _waits(c, out):
    """Back-to-back saves, a load while a save is pending, destroy() while pending."""
    workdir, engine = c["workdir"], c["engine"]
    folder = os.path.join(workdir, "waits")
    durable.set_io_hook(_slow_writes(0.01))
    engine.save_checkpoint(folder, tag="one")
    engine.save_checkpoint(folder, tag="two")  # waits for "one" first
    state_two = consolidated_state(engine)
    train_steps(engine, RUN, 4, 1)
    engine.load_checkpoint(folder, tag="two")  # waits for "two", then loads it
    durable.set_io_hook(None)
    loaded = consolidated_state(engine)
    if c["rank"] == 0:
        out["load_while_pending"] = state_differences(state_two, loaded)[1]
    out["waits_listing"] = _listing(folder)
    for tag in ("one", "two"):
        out[f"verify_{tag}"] = _error(lambda tag=tag: zero_bnb.verify_checkpoint(folder, tag))
    other = make_engine(c["world"], zero_checkpoint_async=True)
    durable.set_io_hook(_slow_writes(0.01))
    other.save_checkpoint(folder, tag="three")
    other.destroy()  # waits for the pending save, then frees the staging buffers
    durable.set_io_hook(None)
    out["after_destroy"] = (_error(lambda: zero_bnb.verify_checkpoint(folder, "three")), _listing(folder)[1])
    if c["rank"] == 1:  # a write of rank 1's writer fails: destroy() raises it on every rank instead of returning
        durable.set_io_hook(_fail_when("write", "shard_00001", 1))
    other.save_checkpoint(folder, tag="four")
    out["destroy_raises"] = _error(other.destroy)
    durable.set_io_hook(None)
    out["destroy_raises_once"] = (_error(other.wait_for_checkpoint), _listing(folder)[1])


def _failures(c, out):
    """A background failure leaves the previous checkpoint and is raised by the next wait, save or load; a full disk
    (a real file-size limit) likewise; saving works again after."""
    rank, workdir, engine = c["rank"], c["workdir"], c["engine"]
    folder = os.path.join(workdir, "fail")
    engine.save_checkpoint(folder, tag="good")
    engine.wait_for_checkpoint()
    for label, call in (("wait", engine.wait_for_checkpoint),
                        ("save", lambda: engine.save_checkpoint(folder, tag="next")),
                        ("load", lambda: engine.load_checkpoint(folder))):
        if rank == 1:
            durable.set_io_hook(_fail_when("write", "shard_00001", 2))
        out[f"returned:{label}"] = _error(lambda: engine.save_checkpoint(folder, tag="bad"))
        out[f"raised:{label}"] = _error(call)
        durable.set_io_hook(None)
        out[f"listing:{label}"] = _listing(folder)
        out[f"raised_once:{label}"] = _error(engine.wait_for_checkpoint)
    engine.wait_for_checkpoint()
    if rank == 0:  # a real full disk: rank 0 may write no file beyond 64 KiB
        previous = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, previous[1]))
    try:
        out["full_disk_returned"] = _error(lambda: engine.save_checkpoint(folder, tag="full"))
        out["full_disk_raised"] = _error(engine.wait_for_checkpoint)
    finally:
        if rank == 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, previous)
            signal.signal(signal.SIGXFSZ, handler)
    out["full_disk_listing"] = _listing(folder)
    if rank == 0:  # something else removes the staging folder while the background write runs
        durable.set_io_hook(_remove_staging_when("write", "shard_00000"))
    try:
        out["staging_removed_returned"] = _error(lambda: engine.save_checkpoint(folder, tag="removed"))
        out["staging_removed_raised"] = _error(engine.wait_for_checkpoint)
    finally:
        durable.set_io_hook(None)
    out["staging_removed_listing"] = _listing(folder)
    out["save_after_failures"] = _error(lambda: (engine.save_checkpoint(folder, tag="again"),
                                                 engine.wait_for_checkpoint()))
    out["final_listing"] = _listing(folder)


def _remove_staging_when(event_wanted: str, file_wanted: str):
    """An I/O hook removing the staging folder that holds the first ``file_wanted`` at its ``event_wanted``."""
    import shutil

    done = [False]

    def hook(event: str, path: str) -> None:
        if (not done[0] and event == event_wanted and os.path.basename(path).startswith(file_wanted)
                and ".zero_bnb-staging" in path):
            done[0] = True
            staging = path
            while ".zero_bnb-staging" not in os.path.basename(staging):
                staging = os.path.dirname(staging)
            # the other rank may be creating its files in it meanwhile (ENOTEMPTY): remove until it is gone
            while os.path.lexists(staging):
                shutil.rmtree(staging, ignore_errors=True)

    return hook


def _slices_fail(c, out):
    """Staging the module weights fails on rank 1 (any error, not only the staging limit): the save goes on with
    the masters stored whole on every rank, and the save folder's lock is not left held."""
    import zero_bnb.ds.engine as engine_module

    workdir, engine, rank = c["workdir"], c["engine"], c["rank"]
    folder = os.path.join(workdir, "slices_fail")
    original = engine_module.stage_module_slices

    def failing(*args, **kwargs):
        raise RuntimeError("injected: pinned memory exhausted")

    if rank == 1:
        engine_module.stage_module_slices = failing
    try:
        out["slices_fail_save"] = _error(lambda: (engine.save_checkpoint(folder, tag="s1"), engine.wait_for_checkpoint()))
    finally:
        engine_module.stage_module_slices = original
    out["slices_fail_next_save"] = _error(lambda: (engine.save_checkpoint(folder, tag="s2"), engine.wait_for_checkpoint()))
    out["slices_fail_verify"] = [_error(lambda tag=tag: zero_bnb.verify_checkpoint(folder, tag)) for tag in ("s1", "s2")]


def _deepspeed_writer(c, out):
    """DeepSpeed's checkpoint.writer.decoupled (its KeyError 'CROSS_SIZE' outside the deepspeed launcher) makes
    saves asynchronous; its other writers are refused with the fix, not with DeepSpeed's KeyError."""
    decoupled = make_engine(c["world"], checkpoint={"writer": {"decoupled": True}})
    out["decoupled_async"] = decoupled.zero_bnb_config.checkpoint_async
    train_steps(decoupled, RUN, 0, 1)
    folder = os.path.join(c["workdir"], "decoupled")
    decoupled.save_checkpoint(folder, tag="d")
    out["decoupled_pending"] = decoupled._zero_bnb_background.pending
    decoupled.wait_for_checkpoint()
    out["decoupled_verify"] = _error(lambda: zero_bnb.verify_checkpoint(folder, "d"))
    decoupled.destroy()
    out["fast_writer"] = _error(lambda: make_engine(c["world"], checkpoint={"writer": {"type": "fast"}}))


def _memory(c, out):
    """The staging buffers are reused between saves; a run can bound them (over the bound, the save writes what does
    not fit before it returns, with a warning)."""
    workdir, engine = c["workdir"], c["engine"]
    saver = engine._zero_bnb_background
    folder = os.path.join(workdir, "memory")
    pointers = []
    for tag in ("m1", "m2"):
        engine.save_checkpoint(folder, tag=tag)
        engine.wait_for_checkpoint()
        pointers.append(sorted(buffer.data_ptr() for buffer in saver.pool._buffers))
        train_steps(engine, RUN, 5, 1)
    out["buffers_reused"] = pointers[0] == pointers[1]
    out["staged_bytes"] = saver.pool.staged_bytes
    out["held_bytes"] = saver.pool.held_bytes
    out["params"] = sum(p.numel() for p in engine.module.parameters())
    bounded = make_engine(c["world"], zero_checkpoint_async=True, zero_checkpoint_async_max_staging_mb=0.05)
    train_steps(bounded, RUN, 0, 1)
    state = consolidated_state(bounded)
    out["bounded_save"] = _error(lambda: bounded.save_checkpoint(folder, tag="bounded"))
    bounded.wait_for_checkpoint()
    out["bounded_held"] = bounded._zero_bnb_background.pool.held_bytes
    fresh = make_engine(c["world"])
    fresh.load_checkpoint(folder, tag="bounded")
    loaded = consolidated_state(fresh)
    if c["rank"] == 0:
        out["bounded_differences"] = state_differences(state, loaded)[1]
    bounded.destroy()
    fresh.destroy()


def _overlapping_calls(c, out):
    """A save started inside a save (a "save on SIGTERM" handler interrupting one) and a load from a second thread
    while a save runs: each refused at once; the interrupted save fails cleanly, the other one completes."""
    import threading

    workdir, twin = c["workdir"], c["twin"]  # the synchronous engine: its writes run in the calling thread
    folder = os.path.join(workdir, "overlapping")
    twin.save_checkpoint(folder, tag="base")
    inner: list = []

    def on_signal(signum, frame):
        inner.append(_error(lambda: twin.save_checkpoint(folder, tag="inner")))
        raise RuntimeError("the signal handler's save was refused")  # what a handler that re-raises does

    def send_signal_once(event, path):
        if event == "write" and not inner and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGUSR1)

    sent: list = []
    previous = signal.signal(signal.SIGUSR1, on_signal)
    durable.set_io_hook(send_signal_once)
    try:
        out["interrupted_outer"] = _error(lambda: twin.save_checkpoint(folder, tag="outer"))
    finally:
        durable.set_io_hook(None)
        signal.signal(signal.SIGUSR1, previous)
    out["interrupted_inner"] = inner
    out["interrupted_listing"] = _listing(folder)
    # A second thread's load while this thread's save waits inside its first write.
    attempted, other = threading.Event(), []

    def load_from_another_thread():
        other.append(_error(lambda: twin.load_checkpoint(folder, tag="base")))
        attempted.set()

    def wait_for_the_other_thread(event, path):
        if event == "write" and not attempted.is_set():
            threading.Thread(target=load_from_another_thread, name="second-caller").start()
            attempted.wait(60)

    durable.set_io_hook(wait_for_the_other_thread)
    try:
        out["threaded_outer"] = _error(lambda: twin.save_checkpoint(folder, tag="threaded"))
    finally:
        durable.set_io_hook(None)
    out["threaded_other"] = other
    out["threaded_listing"] = _listing(folder)[1]
    out["threaded_verify"] = _error(lambda: zero_bnb.verify_checkpoint(folder, "threaded"))


def asynchronous(rank, world, workdir):
    out: dict = {}
    engine = make_engine(world, zero_checkpoint_async=True)
    twin = make_engine(world)  # the same run, saving synchronously
    train_steps(engine, RUN, 0, 2)
    train_steps(twin, RUN, 0, 2)
    context = {"rank": rank, "world": world, "workdir": workdir, "engine": engine, "twin": twin}
    run_phases(out, context, _same_as_sync, _bf16, _waits, _failures, _slices_fail, _deepspeed_writer, _memory,
               _overlapping_calls)
    engine.wait_for_checkpoint()
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        torch.save(gathered, os.path.join(workdir, "async.pt"))
