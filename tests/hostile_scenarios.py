"""One DP=2 launch that misuses a real engine the way a careless user or an attacker would.

Every check records, per rank, what happened (``"ErrorClass: message"`` or ``None``, listings,
comparisons); rank 0 writes all ranks' records to ``hostile.pt`` for the tests to assert on.
A check that raises unexpectedly records its own error instead of failing the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket

import blake3
import numpy
import torch
import torch.distributed as dist
from scenarios import OPTIMIZERS, _error, make_engine, run_phases

from zero_bnb.format import digests, durable
from zero_bnb.format.lock import LOCK_NAME
from zero_bnb.format.manifest import MANIFEST_NAME, SUBDIR
from zero_bnb.format.masters import piece_digest
from zero_bnb.format.stock_files import MODEL_STATES
from zero_bnb.testing.consolidate import consolidated_state, state_differences
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import train_steps

UNSAFE_TAGS = ("latest", "latest_universal", "../escape", "/tmp/zero_bnb_abs_tag", "a/b", ".hidden", "..", " x")
#: Safe names, but names zero_bnb or DeepSpeed use inside checkpoint folders: refused for new checkpoints.
INTERNAL_TAGS = ("zero_bnb", "mp_rank_00_model_states.pt", "zero_to_fp32.py", "zero", "x_optim_states.pt")


class Payload:
    """A pickle that runs a shell command when unpickled with ``weights_only=False``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def resign(folder: str, data: dict) -> None:
    """Write manifest JSON ``data`` into zero_bnb ``folder`` with a valid self-checksum, as an attacker can."""
    data = {key: value for key, value in data.items() if key != "manifest_sha256"}
    text = json.dumps({"manifest_sha256": "0" * 64, **data}, indent=1)
    text = text.replace("0" * 64, hashlib.sha256(text.encode("utf-8")).hexdigest(), 1)
    with open(os.path.join(folder, MANIFEST_NAME), "w", encoding="utf-8") as handle:
        handle.write(text)


def record_algorithm(record: dict) -> str:
    """The digest algorithm of a manifest's ``files`` entry (its key: ``blake3`` or ``sha256``)."""
    return next(name for name in digests.ALGORITHMS if name in record)


def replace_listed_file(tag_folder: str, relative: str, obj) -> None:
    """Replace a file the manifest lists with ``torch.save(obj)`` and re-sign the manifest to match."""
    torch.save(obj, os.path.join(tag_folder, relative))
    relist_file(tag_folder, relative)


def relist_file(tag_folder: str, relative: str) -> None:
    """Re-sign the manifest for the present bytes of the listed file ``relative`` (in the digest algorithm its record
    names, computed by the package itself, as an attacker can)."""
    path = os.path.join(tag_folder, relative)
    folder = os.path.join(tag_folder, SUBDIR)
    with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as handle:
        data = json.load(handle)
    for record in data["files"]:
        if record["path"] == relative:
            algorithm = record_algorithm(record)
            with open(path, "rb") as handle:
                content = handle.read()
            digest = (blake3.blake3(content) if algorithm == "blake3" else hashlib.sha256(content)).hexdigest()
            record.update({"size": len(content), algorithm: digest})
    resign(folder, data)


def _edit_payload(relative: str, edit):
    """A tamper: ``edit`` the object in file ``relative`` of a tag folder, then re-sign the manifest to match."""
    def tamper(tag_folder: str) -> None:
        data = torch.load(os.path.join(tag_folder, relative), weights_only=True)
        edit(data)
        replace_listed_file(tag_folder, relative, data)
    return tamper


def _declare(name: str, keys: list[str]):
    """A tamper: the manifest's non_finite declares NaN/Inf in ``keys`` of parameter ``name`` (re-signed)."""
    def tamper(tag_folder: str) -> None:
        folder = os.path.join(tag_folder, SUBDIR)
        with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as handle:
            data = json.load(handle)
        data["non_finite"] = {name: keys}
        resign(folder, data)
    return tamper


_REPLICATED = os.path.join(SUBDIR, "replicated.pt")
_SHARD_0 = os.path.join(SUBDIR, "shard_00000-of-00002.pt")


def _set_counter(value):
    return _edit_payload(_REPLICATED, lambda data: data["groups"][0]["counters"].update(step=value))


def _set_qmap(make):
    return _edit_payload(_REPLICATED, lambda data: data["groups"][0]["replicated"].update(
        qmap1=make(data["groups"][0]["replicated"]["qmap1"])))


def _set_in_shard(key, value=float("nan")):
    if key == "fp32":
        return _set_master(value)
    def edit(data):
        data["groups"][0]["state"][key][0] = value
    return _edit_payload(_SHARD_0, edit)


def _set_master(value):
    """A tamper: the first master weight of ``0.weight`` becomes ``value``. In fp32 training the masters are the
    module weights of DeepSpeed's model file, so the attacker edits that, the digest shard 0 records for the
    weight, and re-signs the manifest."""
    def tamper(tag_folder: str) -> None:
        states = torch.load(os.path.join(tag_folder, MODEL_STATES), weights_only=False)
        weight = states["module"]["0.weight"].clone()
        weight.view(-1)[0] = value
        states["module"]["0.weight"] = weight
        replace_listed_file(tag_folder, MODEL_STATES, states)
        with open(os.path.join(tag_folder, SUBDIR, MANIFEST_NAME), encoding="utf-8") as handle:
            start, end = json.load(handle)["groups"][0]["element_ranges"][0]
        shard = torch.load(os.path.join(tag_folder, _SHARD_0), weights_only=True)
        masters = shard["groups"][0]["masters"]
        key = next(key for key in masters if key.startswith("module_"))
        masters[key]["0.weight"] = piece_digest(weight.view(-1)[start : min(end, weight.numel())],
                                                key.removeprefix("module_"))
        replace_listed_file(tag_folder, _SHARD_0, shard)
    return tamper


def _replace_module_weight(tag_folder: str) -> None:
    """A tamper: another tool rewrites DeepSpeed's model file after the save (``0.weight`` changed), and the
    manifest is re-signed; the masters derived from that weight must not be rebuilt from the new one."""
    states = torch.load(os.path.join(tag_folder, MODEL_STATES), weights_only=False)
    states["module"]["0.weight"] = states["module"]["0.weight"] * 0.5
    replace_listed_file(tag_folder, MODEL_STATES, states)


#: Values a re-signed checkpoint may carry, each refused by ``verify`` and by a load with one line naming the
#: field: name -> (tamper, text the error must hold). The first parameter of group 0 is ``0.weight``.
TAMPERED_VALUES = {
    "step_negative": (_set_counter(-1), "group 0 counter step=-1 must be a number >= 0"),
    "step_text": (_set_counter("x"), "group 0 counter step='x' must be a number >= 0"),
    "qmap_300": (_set_qmap(lambda q: torch.linspace(-1, 1, 300)), "quantization map 'qmap1' is float32 (300,)"),
    "qmap_1": (_set_qmap(lambda q: q[:1].clone()), "quantization map 'qmap1' is float32 (1,)"),
    "qmap_unsorted": (_set_qmap(lambda q: q.flip(0).contiguous()), "quantization map 'qmap1' must be sorted"),
    "qmap_nan": (_set_qmap(lambda q: torch.where(q == q.max(), float("nan"), q)),
                 "quantization map 'qmap1' must hold finite values in [-1, 1]"),
    "lr_nan": (_edit_payload(_REPLICATED, lambda data: data["groups"][0]["param_group"].update(lr=float("nan"))),
               "hyper-parameter lr=nan must be finite"),
    "lr_negative": (_edit_payload(_REPLICATED, lambda data: data["groups"][0]["param_group"].update(lr=-0.1)),
                    "hyper-parameter lr=-0.1 must be >= 0"),
    "beta_one": (_edit_payload(_REPLICATED, lambda data: data["groups"][0]["param_group"].update(betas=(0.9, 1.0))),
                 "hyper-parameter betas=(0.9, 1.0) must hold numbers in [0, 1)"),
    "loss_scale_nan": (_edit_payload(_REPLICATED, lambda data: data["zero_wrapper"]["loss_scaler"]["state"].update(
        cur_scale=float("nan"))), "zero_wrapper.loss_scaler.state.cur_scale=nan must be a finite number > 0"),
    "absmax_nan": (_set_in_shard("absmax1"), "'absmax1' of parameter(s) ['0.weight'] holds NaN/Inf"),
    "master_nan": (_set_in_shard("fp32"), "'fp32' of parameter(s) ['0.weight'] holds NaN/Inf"),
    "master_inf_declared_for_another": (
        lambda folder: (_set_in_shard("fp32", float("inf"))(folder), _declare("2.weight", ["fp32"])(folder)),
        "'fp32' of parameter(s) ['0.weight'] holds NaN/Inf"),
    "module_weight_replaced": (_replace_module_weight, "mp_rank_00_model_states.pt: the module weights of "
                                                       "['0.weight'] are not the ones the master weights in"),
}


def _listing(folder: str) -> tuple[list[str], str | None]:
    latest = os.path.join(folder, "latest")
    text = open(latest).read() if os.path.isfile(latest) else None
    return sorted(os.listdir(folder)), text


def _snapshot(engine):
    return consolidated_state(engine), {n: p.detach().clone() for n, p in engine.module.named_parameters()}, \
        engine.global_steps


def _same(engine, snapshot) -> bool | None:
    """Whether the engine is bit-identical to ``snapshot`` (collective; ``None`` off rank 0 for the state part)."""
    state, weights, steps = _snapshot(engine)
    same_weights = all(torch.equal(weights[n], w) for n, w in snapshot[1].items()) and steps == snapshot[2]
    if dist.get_rank() != 0:
        return same_weights
    return same_weights and not state_differences(snapshot[0], state)[1]


def _unsafe_tags(c, out):
    workdir, engine, save = c["workdir"], c["engine"], c["save"]
    # Unsafe and reserved tags: refused on save and on load, before anything is touched.
    for tag in UNSAFE_TAGS:
        out[f"save_tag:{tag}"] = _error(lambda tag=tag: engine.save_checkpoint(save, tag=tag))
        out[f"load_tag:{tag}"] = _error(lambda tag=tag: engine.load_checkpoint(save, tag=tag))
    for tag in INTERNAL_TAGS:
        out[f"save_internal:{tag}"] = _error(lambda tag=tag: engine.save_checkpoint(save, tag=tag))
    out["listing_after_tags"] = _listing(save)
    dist.barrier()  # every rank has listed before rank 0 adds a symlink below
    out["escapes_created"] = [path for path in (os.path.join(workdir, "escape"), "/tmp/zero_bnb_abs_tag")
                              if os.path.lexists(path)]


def _symlinked_tag(c, out):
    rank, engine, save = c["rank"], c["engine"], c["save"]
    # A symlinked tag folder is not re-saved through (or reported wrongly).
    if rank == 0:
        os.symlink(os.path.join(save, "A"), os.path.join(save, "L"))
    dist.barrier()
    out["symlink_tag"] = _error(lambda: engine.save_checkpoint(save, tag="L"))
    link = os.path.join(save, "L")
    out["symlink_target"] = os.readlink(link) if os.path.islink(link) else f"not a link: {os.path.lexists(link)=}"
    out["listing_after_symlink"] = _listing(save)


def _unwritable_folders(c, out):
    rank, workdir, engine = c["rank"], c["workdir"], c["engine"]
    # A folder that cannot be created (a file in the way; as root, permissions do not stop us) and an
    # injected read-only error inside DeepSpeed's own makedirs: the same error on both ranks, no hang.
    blocker = os.path.join(workdir, "a_file")
    if rank == 0:
        open(blocker, "w").close()
    dist.barrier()
    out["uncreatable"] = _error(lambda: engine.save_checkpoint(os.path.join(blocker, "ckpt"), tag="B"))

    def read_only(event, path):
        if event == "mkdir" and rank == 0:
            raise OSError(30, f"injected: read-only file system: {path}")

    durable.set_io_hook(read_only)
    out["read_only"] = _error(lambda: engine.save_checkpoint(os.path.join(workdir, "ro"), tag="B"))
    durable.set_io_hook(None)
    out["read_only_left"] = sorted(os.listdir(os.path.join(workdir, "ro"))) if os.path.isdir(
        os.path.join(workdir, "ro")) else None


def _split_folders_and_fifo_lock(c, out):
    rank, world, workdir, engine = c["rank"], c["world"], c["workdir"], c["engine"]
    # Ranks that do not see the same folder (relative paths with other working directories, node-local
    # disks): refused on every rank before anything is published, instead of a checkpoint missing a shard.
    out["split_folders"] = _error(lambda: engine.save_checkpoint(os.path.join(workdir, f"ck{rank}"), tag="t"))
    out["split_folders_published"] = [r for r in range(world) if os.path.lexists(os.path.join(workdir, f"ck{r}", "t"))]
    out["split_folders_left"] = sorted(os.listdir(os.path.join(workdir, "ck0")))
    # A FIFO where the lock file goes: a clear error on every rank, never a hang.
    fifo_dir = os.path.join(workdir, "fifo")
    if rank == 0:
        os.makedirs(fifo_dir)
        os.mkfifo(os.path.join(fifo_dir, LOCK_NAME))
    dist.barrier()
    out["fifo_lock"] = _error(lambda: engine.save_checkpoint(fifo_dir, tag="F"))


def _locks(c, out):
    rank, foreign_pid, engine, save = c["rank"], c["foreign_pid"], c["engine"], c["save"]
    # Another live writer holds the lock: refused, naming it; a dead writer's lock is taken over.
    lock = os.path.join(save, LOCK_NAME)
    if rank == 0:
        with open(lock, "w") as handle:
            json.dump({"host": socket.gethostname(), "pid": foreign_pid, "token": "x", "purpose": "test", "since": 0},
                      handle)
    dist.barrier()
    out["locked"] = _error(lambda: engine.save_checkpoint(save, tag="C"))
    if rank == 0:
        with open(lock, "w") as handle:
            json.dump({"host": socket.gethostname(), "pid": 2**22 + 12345, "token": "x", "since": 0}, handle)
    dist.barrier()
    out["stale_lock"] = _error(lambda: engine.save_checkpoint(save, tag="C"))
    out["lock_left"] = open(lock).read() if os.path.lexists(lock) else None
    out["listing_after_locks"] = _listing(save)


def _planted_links(c, out):
    rank, workdir, engine = c["rank"], c["workdir"], c["engine"]
    # A symlink planted where a save used to write its temporary pointer file (and one at every name a
    # writer could guess) sends no write through it: the victim keeps its bytes, 'latest' is a file.
    folder, victim = os.path.join(workdir, "planted"), os.path.join(workdir, "victim.txt")
    engine.save_checkpoint(folder, tag="A")
    if rank == 0:
        with open(victim, "w") as handle:
            handle.write("precious")
        for name in ("latest.zero_bnb-tmp", ".latest.zero_bnb-tmp", ".zero_to_fp32.py.zero_bnb-tmp"):
            os.symlink(victim, os.path.join(folder, name))
        os.symlink(workdir, os.path.join(folder, ".A.zero_bnb-replaced"))  # where a re-save of A moves the old A
    dist.barrier()
    out["planted_resave"] = _error(lambda: engine.save_checkpoint(folder, tag="A"))
    out["planted_after_resave"] = (open(victim).read(), _listing(os.path.join(workdir, "save"))[0])
    out["planted_save"] = _error(lambda: engine.save_checkpoint(folder, tag="B"))
    out["planted_victim"] = open(victim).read()
    latest = os.path.join(folder, "latest")
    out["planted_latest"] = f"a link to {os.readlink(latest)}" if os.path.islink(latest) else open(latest).read()
    out["planted_listing"] = _listing(folder)


def _full_disk(c, out):
    rank, workdir, engine = c["rank"], c["workdir"], c["engine"]
    # The disk fills while the new 'latest' is written: nothing was published and the error says so; the
    # rename of 'latest' fails after the tag folder's: the error says the checkpoint WAS published. Nothing
    # temporary is left either way.
    folder = os.path.join(workdir, "full")
    engine.save_checkpoint(folder, tag="A")

    for key, step in (("full_pointer", "write"), ("full_rename", "replace")):
        def full(event, path, step=step):
            if rank == 0 and event == step and os.path.basename(path).startswith("latest"):
                raise OSError(28, "No space left on device (injected)")

        durable.set_io_hook(full)
        out[key] = _error(lambda: engine.save_checkpoint(folder, tag="B"))
        durable.set_io_hook(None)
        out[f"{key}_listing"] = _listing(folder)


def _late_mismatch(c, out):
    rank, workdir, engine, save = c["rank"], c["workdir"], c["engine"], c["save"]
    # A mismatch only the restore finds (the last group's manifest lists no state2/absmax2) leaves
    # the engine bit-identical: masters, module weights, state and step.
    train_steps(engine, RUN, 2, 1)
    snapshot = c["snapshot"] = _snapshot(engine)
    doctored = os.path.join(workdir, "doctored")
    if rank == 0:
        import shutil

        shutil.copytree(save, doctored, ignore=shutil.ignore_patterns(LOCK_NAME))
        folder = os.path.join(doctored, "C", SUBDIR)
        with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as handle:
            data = json.load(handle)
        last = data["groups"][-1]
        last["states"] = [s for s in last["states"] if s["key"] not in ("state2", "absmax2")]
        resign(folder, data)
    dist.barrier()
    out["late_mismatch"] = _error(lambda: engine.load_checkpoint(doctored, tag="C"))
    out["late_mismatch_unchanged"] = _same(engine, snapshot)


def _code_payload(c, out):
    rank, world, workdir, engine = c["rank"], c["world"], c["workdir"], c["engine"]
    save, snapshot = c["save"], c["snapshot"]
    # A checkpoint whose replicated file carries a code payload (manifest re-signed): nothing runs.
    sentinel = os.path.join(workdir, f"pwned_by_load_{rank}")
    poisoned = os.path.join(workdir, "poisoned")
    if rank == 0:
        import shutil

        shutil.copytree(save, poisoned, ignore=shutil.ignore_patterns(LOCK_NAME))
        commands = "; ".join(f"touch {os.path.join(workdir, f'pwned_by_load_{r}')}" for r in range(world))
        replace_listed_file(os.path.join(poisoned, "C"), os.path.join(SUBDIR, "replicated.pt"),
                            {"groups": Payload(commands)})
    dist.barrier()
    out["payload"] = _error(lambda: engine.load_checkpoint(poisoned, tag="C"))
    out["payload_ran"] = os.path.exists(sentinel)
    out["payload_unchanged"] = _same(engine, snapshot)


def _hyperparameter_log(c, out):
    engine, save, log = c["engine"], c["save"], c["log"]
    # The checkpoint's hyper-parameters replace the optimizer's; the log says so.
    for group in engine.optimizer.optimizer.param_groups:
        group["lr"] = 0.5
    del log[:]
    out["load_c"] = _error(lambda: engine.load_checkpoint(save, tag="C"))
    out["hyper_log"] = [m for m in log if "replace the optimizer's" in m]


def _weights_only_loads(c, out):
    rank, world, workdir = c["rank"], c["world"], c["workdir"]
    # Weights-only loads in bf16 take the exact fp32 masters from the checkpoint.
    bf16 = make_engine(world, bf16={"enabled": True})
    train_steps(bf16, RUN, 0, 2)
    bf16.save_checkpoint(os.path.join(workdir, "bf16"), tag="W")
    saved = consolidated_state(bf16)
    for kwargs in ({"load_module_only": True}, {"load_optimizer_states": False}):
        train_steps(bf16, RUN, 2, 1)
        label = "weights_only:" + ",".join(kwargs)
        out[label] = _error(lambda kwargs=kwargs: bf16.load_checkpoint(os.path.join(workdir, "bf16"), tag="W", **kwargs))
        loaded = consolidated_state(bf16)
        if rank == 0:
            out[label + ":masters"] = all(torch.equal(loaded["params"][n]["fp32"], s["fp32"])
                                          for n, s in saved["params"].items())
            out[label + ":modules"] = all(torch.equal(p.detach(), saved["params"][n]["fp32"].to(p.dtype))
                                          for n, p in bf16.module.named_parameters())
            out[label + ":bf16_rounding_would_differ"] = any(
                not torch.equal(s["fp32"], s["fp32"].bfloat16().float()) for s in saved["params"].values())
    # A custom_load_fn is handed the trained entries as the masters cast (not the live weights the plan otherwise
    # leaves there for the apply phase to set).
    handed = {}

    def custom_load_fn(src, dst):
        handed.update({key: value.detach().clone() for key, value in src.items()})
        dst.load_state_dict(src)

    train_steps(bf16, RUN, 2, 1)
    out["custom_load_fn"] = _error(lambda: bf16.load_checkpoint(os.path.join(workdir, "bf16"), tag="W",
                                                                 custom_load_fn=custom_load_fn))
    if rank == 0:
        out["custom_load_fn:handed"] = all(torch.equal(handed[n], s["fp32"].bfloat16())
                                           for n, s in saved["params"].items())
        out["custom_load_fn:modules"] = all(torch.equal(p.detach(), saved["params"][n]["fp32"].bfloat16())
                                            for n, p in bf16.module.named_parameters())


SCHEDULER = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 10}}}


def _scheduler_and_counters(c, out):
    """What DeepSpeed's loader applies besides the optimizer (LR scheduler, counters) is checked before anything
    changes: a scheduler the checkpoint lacks (and the reverse) or a bad counter leaves the engine bit-identical."""
    import shutil

    rank, world, workdir, engine, save = c["rank"], c["world"], c["workdir"], c["engine"], c["save"]
    scheduled = make_engine(world, **SCHEDULER)
    train_steps(scheduled, RUN, 0, 2)
    snapshot, schedule = _snapshot(scheduled), scheduled.lr_scheduler.state_dict()
    out["scheduler_missing"] = _error(lambda: scheduled.load_checkpoint(save, tag="A"))
    out["scheduler_missing_unchanged"] = bool(_same(scheduled, snapshot)) and \
        scheduled.lr_scheduler.state_dict() == schedule
    scheduled_dir = os.path.join(workdir, "scheduled")
    scheduled.save_checkpoint(scheduled_dir, tag="S")
    snapshot = _snapshot(engine)
    out["scheduler_unexpected"] = _error(lambda: engine.load_checkpoint(scheduled_dir, tag="S"))
    out["scheduler_unexpected_unchanged"] = _same(engine, snapshot)
    out["scheduler_left_out"] = _error(lambda: scheduled.load_checkpoint(save, tag="A", load_lr_scheduler_states=False))
    for name, value in (("global_steps", -1), ("global_steps", "x"), ("skipped_steps", None)):
        doctored = os.path.join(workdir, f"counter_{name}_{value}")
        if rank == 0:
            shutil.copytree(scheduled_dir, doctored, ignore=shutil.ignore_patterns(LOCK_NAME))
            model_file = os.path.join(doctored, "S", "mp_rank_00_model_states.pt")
            states = torch.load(model_file, weights_only=False)
            states[name] = value
            replace_listed_file(os.path.join(doctored, "S"), "mp_rank_00_model_states.pt", states)
        dist.barrier()
        snapshot = _snapshot(scheduled)
        out[f"counter:{name}={value}"] = _error(lambda doctored=doctored: scheduled.load_checkpoint(doctored, tag="S"))
        out[f"counter:{name}={value}:unchanged"] = _same(scheduled, snapshot)


RANDOM_LTD = {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
    "enabled": True, "total_layer_num": 3, "random_ltd_layer_num": 1, "random_ltd_layer_id": [1],
    "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
    "random_ltd_schedule": {"min_value": 8, "max_value": 32, "schedule_type": "fixed_linear",
                            "schedule_config": {"require_steps": 10, "seq_per_step": 8}}}}}}


def _data_efficiency_entries(c, out):
    """DeepSpeed hands the model file's 'random_ltd' entry to an engine's random-LTD scheduler (and 'data_sampler' to
    its curriculum data sampler) after replacing the module: a checkpoint saved without them (None there) or with a
    bad value is refused first, engine unchanged; one saved with random-LTD restores the scheduler."""
    import shutil

    rank, world, workdir, save = c["rank"], c["world"], c["workdir"], c["save"]
    ltd = make_engine(world, **RANDOM_LTD)
    train_steps(ltd, RUN, 0, 2)
    snapshot, schedule = _snapshot(ltd), ltd.random_ltd_scheduler.state_dict()
    out["random_ltd_missing"] = _error(lambda: ltd.load_checkpoint(save, tag="A"))
    out["random_ltd_missing_unchanged"] = bool(_same(ltd, snapshot)) and ltd.random_ltd_scheduler.state_dict() == schedule
    ltd.random_ltd_scheduler.update_seq(5)
    schedule = ltd.random_ltd_scheduler.state_dict()
    ltd_dir = os.path.join(workdir, "random_ltd")
    ltd.save_checkpoint(ltd_dir, tag="L")
    ltd.random_ltd_scheduler.reset_to_init()
    out["random_ltd_load"] = _error(lambda: ltd.load_checkpoint(ltd_dir, tag="L"))
    out["random_ltd_restored"] = ltd.random_ltd_scheduler.state_dict() == schedule
    doctored = os.path.join(workdir, "random_ltd_doctored")
    if rank == 0:
        shutil.copytree(ltd_dir, doctored, ignore=shutil.ignore_patterns(LOCK_NAME))
        model_file = os.path.join(doctored, "L", "mp_rank_00_model_states.pt")
        states = torch.load(model_file, weights_only=False)
        states["random_ltd"]["current_value"] = "x"
        replace_listed_file(os.path.join(doctored, "L"), "mp_rank_00_model_states.pt", states)
    dist.barrier()
    snapshot = _snapshot(ltd)
    out["random_ltd_bad_value"] = _error(lambda: ltd.load_checkpoint(doctored, tag="L"))
    out["random_ltd_bad_value_unchanged"] = _same(ltd, snapshot)
    # The same for the curriculum data sampler ('data_sampler'), which needs training data to exist.
    import zero_bnb
    from zero_bnb.testing.toy import LEARNING_RATE, build_model, param_groups

    model = build_model()
    curriculum = {"data_efficiency": {"enabled": True, "seed": 1, "data_sampling": {
        "enabled": True, "num_epochs": 1, "curriculum_learning": {
            "enabled": True, "data_cluster_path": os.path.join(workdir, "clusters"), "curriculum_metrics": {}}}}}
    sampled, *_ = zero_bnb.initialize(model=model, optimizer=OPTIMIZERS["Adam8bit"](param_groups(model), lr=LEARNING_RATE),
                                      training_data=torch.utils.data.TensorDataset(torch.randn(64, 4)),
                                      config=RUN.ds_config(world, **curriculum))
    sampler = sampled.training_dataloader.data_sampler
    snapshot, sampler_state = _snapshot(sampled), repr(sampler.state_dict())
    out["data_sampler_missing"] = _error(lambda: sampled.load_checkpoint(save, tag="A"))
    out["data_sampler_missing_unchanged"] = bool(_same(sampled, snapshot)) and repr(sampler.state_dict()) == sampler_state
    out["data_sampler_class"] = type(sampler).__name__
    # A checkpoint of its own carries the sampler's state, NumPy's random state included (an array): it loads.
    sampler_dir = os.path.join(workdir, "data_sampler")
    sampled.save_checkpoint(sampler_dir, tag="S")
    out["data_sampler_saved"] = _sampler_state(sampler)  # rank 0's is in the model file (DeepSpeed's choice)
    sampler.consumed_samples += 7
    numpy.random.seed(1234 + rank)
    out["data_sampler_changed"] = _sampler_state(sampler)
    out["data_sampler_load"] = _error(lambda: sampled.load_checkpoint(sampler_dir, tag="S"))
    out["data_sampler_loaded"] = _sampler_state(sampler)


def _sampler_state(sampler) -> str:
    """A curriculum data sampler's state, NumPy's random state spelled out in full."""
    state = dict(sampler.state_dict())
    kind, keys, *rest = state.pop("np_rng_state")
    return repr((sorted(state.items()), kind, keys.tolist(), rest))


def _tampered_values(c, out):
    """Values a re-signed checkpoint carries (counters, quantization maps, hyper-parameters, NaN the manifest does
    not declare) are refused before a load applies anything."""
    import shutil

    rank, workdir, engine, save = c["rank"], c["workdir"], c["engine"], c["save"]
    snapshot = _snapshot(engine)
    for name, (tamper, _) in TAMPERED_VALUES.items():
        folder = os.path.join(workdir, f"tampered_{name}")
        if rank == 0:
            shutil.copytree(save, folder, ignore=shutil.ignore_patterns(LOCK_NAME))
            tamper(os.path.join(folder, "A"))
        dist.barrier()
        out[f"tampered:{name}"] = _error(lambda folder=folder: engine.load_checkpoint(folder, tag="A"))
    out["tampered_unchanged"] = _same(engine, snapshot)


def fingerprint(engine) -> str:
    """SHA-256 of everything a load sets on this rank: module weights, master partitions, optimizer state and
    hyper-parameters, ``global_steps``. Local."""
    digest = hashlib.sha256(repr(engine.global_steps).encode())

    def add(value):
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())

    for name, param in sorted(engine.module.state_dict().items()):
        digest.update(name.encode())
        add(param)
    optimizer = engine.optimizer
    for index in range(optimizer.num_groups):
        master = optimizer.master_partition(index)
        add(master)
        for key, value in sorted(optimizer.optimizer.state.get(master, {}).items()):
            digest.update(key.encode())
            add(value)
        add({k: v for k, v in optimizer.optimizer.param_groups[index].items() if k != "params"})
    return digest.hexdigest()


def _republish(source_tag_folder: str, save_dir: str, tag: str) -> None:
    """Re-save ``save_dir/tag`` with the files of another checkpoint, through the real commit protocol (lock,
    staging folder, publish by rename, old folder removed)."""
    import shutil

    from zero_bnb.checkpoint.commit import local_commit

    with local_commit(save_dir, tag, replace=True) as staging:
        for name in os.listdir(source_tag_folder):
            source = os.path.join(source_tag_folder, name)
            (shutil.copytree if os.path.isdir(source) else shutil.copyfile)(source, os.path.join(staging, name))


@contextlib.contextmanager
def _then(owner, name: str, action, *, between_ranks: bool = False):
    """While active, ``owner.name`` runs as before and then rank 0 runs ``action()`` (a step of a concurrent save)
    before any rank goes on; ``between_ranks``: after rank 0's call and before the other ranks'. Every rank must
    call ``owner.name`` (the load's steps do, inside ``agree``)."""
    real = owner.__dict__[name]
    function = real.__func__ if isinstance(real, staticmethod) else real

    def patched(*args, **kwargs):
        rank = dist.get_rank()
        if between_ranks and rank != 0:
            dist.barrier()
        try:
            return function(*args, **kwargs)
        finally:
            if not between_ranks:
                dist.barrier()
            if rank == 0:
                action()
            if not between_ranks or rank == 0:
                dist.barrier()

    setattr(owner, name, staticmethod(patched) if isinstance(real, staticmethod) else patched)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _resave_windows(c, out, race: str, outcome) -> None:
    """Each step of a re-save of tag T (T renamed aside; the previous folder removed; T replaced by another
    folder) placed right after each step of a load's opening: the load says the checkpoint was replaced."""
    import shutil

    from zero_bnb.ds import engine as engine_module
    from zero_bnb.format.pinned import PinnedFolder
    from zero_bnb.format.reader import CheckpointReader
    from zero_bnb.format.tags import aside_tag

    engine, rank = c["engine"], c["rank"]
    folder, aside, hold = os.path.join(race, "T"), os.path.join(race, aside_tag("T")), os.path.join(race, "hold")
    manifest = os.path.join(SUBDIR, MANIFEST_NAME)

    def moved_aside():  # a re-save's first rename
        os.rename(folder, aside)

    def removing_previous():  # the previous folder renamed away and being removed, its manifest gone first
        os.rename(folder, aside)
        os.rename(os.path.join(aside, manifest), hold)

    def replaced_by_another_folder():  # another job's folder (no zero_bnb files) now at T
        os.rename(folder, aside)
        os.mkdir(folder)

    def restore():
        if rank == 0:
            if os.path.exists(hold):
                os.rename(hold, os.path.join(aside, manifest))
            if os.path.isdir(aside):
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(aside, folder)
        dist.barrier()

    windows = {
        "after_resolve_tag": (engine_module, "resolve_tag", moved_aside, False),
        "after_kind_check": (CheckpointReader, "exists", moved_aside, False),
        "between_ranks_kind_checks": (CheckpointReader, "exists", replaced_by_another_folder, True),
        "after_pinning": (PinnedFolder, "__init__", removing_previous, False),
    }
    for name, (owner, attribute, action, between) in windows.items():
        with _then(owner, attribute, action, between_ranks=between):
            out[f"resave_window:{name}"] = outcome(_error(lambda: engine.load_checkpoint(race, tag="T")))
        restore()


def _load_during_resave(c, out):
    """A load while the same tag is re-saved loads one whole checkpoint (old or new, the same on every rank) or
    fails saying a concurrent save replaced it: never a mix, never a false "damaged"."""
    import threading

    from zero_bnb.format.reader import CheckpointReader

    rank, workdir, engine = c["rank"], c["workdir"], c["engine"]
    sources, race = os.path.join(workdir, "race_sources"), os.path.join(workdir, "race")
    engine.save_checkpoint(os.path.join(sources, "old"), tag="T")
    train_steps(engine, RUN, 5, 1)
    engine.save_checkpoint(os.path.join(sources, "new"), tag="T")
    references = {}
    for version in ("old", "new"):
        engine.load_checkpoint(os.path.join(sources, version), tag="T")
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, fingerprint(engine))
        references[tuple(gathered)] = version
    if rank == 0:
        _republish(os.path.join(sources, "old", "T"), race, "T")
    dist.barrier()

    def outcome(error):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, fingerprint(engine))
        return error if error is not None else references.get(tuple(gathered), "mixed")

    # Deterministic: rank 0 re-saves the tag right after its checksums, before anything is parsed.
    verify = CheckpointReader.verify

    def verify_then_resave(self, *args, **kwargs):
        read = verify(self, *args, **kwargs)
        if rank == 0:
            _republish(os.path.join(sources, "new", "T"), race, "T")
        return read

    CheckpointReader.verify = verify_then_resave
    try:
        out["resave_after_verify"] = outcome(_error(lambda: engine.load_checkpoint(race, tag="T")))
    finally:
        CheckpointReader.verify = verify
    _resave_windows(c, out, race, outcome)
    # Racing: rank 0 re-saves in a loop (alternating old and new) while both ranks load; bounded by count.
    stop = threading.Event()

    def resave_loop():
        turn = 0
        while not stop.is_set():
            _error(lambda: _republish(os.path.join(sources, ("old", "new")[turn % 2], "T"), race, "T"))
            turn += 1

    thread = threading.Thread(target=resave_loop)
    if rank == 0:
        thread.start()
    try:
        out["resave_race"] = [outcome(_error(lambda: engine.load_checkpoint(race, tag="T"))) for _ in range(8)]
    finally:
        stop.set()
        if rank == 0:
            thread.join()


def _failed_initialize(c, out):
    world = c["world"]
    # A failed initialize leaves the user's optimizer and bitsandbytes' process-wide manager as they were:
    # no chunked update left installed, param groups and override entries restored, other entries untouched.
    out.update(_initialize_failure(world))


def hostile(rank, world, workdir, foreign_pid):
    out: dict = {}
    log = []
    handler = logging.Handler()
    handler.emit = lambda record: log.append(record.getMessage())
    logging.getLogger("zero_bnb").addHandler(handler)
    logging.getLogger("zero_bnb").setLevel(logging.INFO)

    engine = make_engine(world)
    train_steps(engine, RUN, 0, 2)
    save = os.path.join(workdir, "save")
    engine.save_checkpoint(save, tag="A")
    out["listing_before"] = _listing(save)
    context = {"rank": rank, "world": world, "workdir": workdir, "foreign_pid": foreign_pid, "engine": engine,
               "save": save, "log": log}
    run_phases(out, context, _unsafe_tags, _symlinked_tag, _unwritable_folders, _split_folders_and_fifo_lock, _locks,
               _planted_links, _full_disk, _late_mismatch, _code_payload, _hyperparameter_log, _weights_only_loads,
               _scheduler_and_counters, _data_efficiency_entries, _tampered_values, _load_during_resave, _failed_initialize)
    logging.getLogger("zero_bnb").removeHandler(handler)
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        torch.save(gathered, os.path.join(workdir, "hostile.pt"))


def saving_job(rank, world, workdir, seed, rounds):
    """An independent job (its own process group) saving tag ``T`` into the shared folder ``rounds`` times.

    A save refused because the other job is writing is retried (at most 200 times a round), so how the two jobs'
    saves interleave under load decides only how many refusals there are, not whether each job publishes."""
    import time

    engine = make_engine(world)
    train_steps(engine, RUN, 0, seed)  # each job holds other weights
    results = []
    for _ in range(rounds):
        for _attempt in range(200):
            results.append(_error(lambda: engine.save_checkpoint(os.path.join(workdir, "shared"), tag="T")))
            if results[-1] is None:
                break
            time.sleep(0.01 * (1 + seed))  # different pauses, so the jobs do not retry in lockstep
    state = consolidated_state(engine)
    if rank == 0:
        torch.save({"results": results, "fp32": {n: s["fp32"] for n, s in state["params"].items()}},
                   os.path.join(workdir, f"job_{seed}.pt"))



def _initialize_failure(world):
    import bitsandbytes as bnb

    import zero_bnb
    from zero_bnb.testing.toy import build_model, param_groups

    model = build_model()
    optimizer = bnb.optim.Adam8bit(param_groups(model), lr=1e-2)
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.index2config.clear()
    first = optimizer.param_groups[0]["params"][0]
    manager.override_config([first], "optim_bits", 32)
    manager.register_parameters(optimizer.param_groups)  # a position-based entry (0, 0) too
    manager.index2config[(7, 7)] = {"optim_bits": 32}  # another optimizer's position-based override
    before_groups = [list(group["params"]) for group in optimizer.param_groups]
    before_index, before_pid = dict(manager.index2config), dict(manager.pid2config)
    config = RUN.ds_config(world, zero_optimization={"stage": 1, "round_robin_gradients": True})
    error = _error(lambda: zero_bnb.initialize(model=model, optimizer=optimizer, config=config))
    names = {id(param): name for name, param in model.named_parameters()}
    result = {  # (before, after) pairs, parameters by name
        "failed_initialize": error,
        "failed_initialize_groups": ([[names[id(p)] for p in group] for group in before_groups],
                                     [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]),
        "failed_initialize_index2config": (before_index, dict(manager.index2config)),
        "failed_initialize_pid2config": ({names[k]: v for k, v in before_pid.items()},
                                         {names.get(k, k): v for k, v in manager.pid2config.items()}),
        "failed_initialize_update_step": type(optimizer.__dict__.get("update_step")).__name__,
    }
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=RUN.ds_config(world))
    result["initialize_after_failure_isolated"] = (engine.zero_bnb_isolated, names[id(first)])
    result["other_optimizers_override"] = manager.index2config.get((7, 7))
    manager.index2config.clear()
    manager.pid2config.clear()
    return result
