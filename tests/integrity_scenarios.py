"""One DP=2 launch that feeds a real engine bad checkpoints, failing saves and NaN state.

Each check records ``"ErrorClass: message"`` (or ``None``) per rank; rank 0 writes all
ranks' records to ``integrity.pt`` for the tests to assert on.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil

import bitsandbytes as bnb
import torch
import torch.distributed as dist
from scenarios import _error, make_engine, run_phases

import zero_bnb
from zero_bnb.format import digests, durable
from zero_bnb.format.manifest import MANIFEST_NAME, SUBDIR, read_manifest, write_manifest
from zero_bnb.testing.consolidate import consolidated_state, state_differences
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import LEARNING_RATE as LR
from zero_bnb.testing.toy import build_engine, param_groups, train_steps

SHARD_1 = os.path.join("A", SUBDIR, "shard_00001-of-00002.pt")
REPLICATED = os.path.join("A", SUBDIR, "replicated.pt")
MODEL = os.path.join("A", "mp_rank_00_model_states.pt")
MANIFEST = os.path.join("A", SUBDIR, "manifest.json")


def _flip(path: str, offset_fraction: float = 0.5) -> None:
    with open(path, "r+b") as handle:
        data = bytearray(handle.read())
        data[int(len(data) * offset_fraction)] ^= 0x10
        handle.seek(0)
        handle.write(data)


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _rewrite_manifest(folder: str, **changes) -> None:
    zero_folder = os.path.join(folder, "A", SUBDIR)
    manifest = dataclasses.replace(read_manifest(zero_folder), **changes)
    os.remove(os.path.join(zero_folder, MANIFEST_NAME))  # zero_bnb's writers only create files
    write_manifest(manifest, zero_folder, root=os.path.join(folder, "A"))


def _rewrite_block_size(folder: str, block_size: int) -> None:
    """A consistent manifest for another block size (block ranges re-derived), as another bnb release would write."""
    manifest = read_manifest(os.path.join(folder, "A", SUBDIR))
    groups = tuple(dataclasses.replace(group, block_ranges=tuple(
        (start // block_size, -(-end // block_size)) for start, end in group.element_ranges)) for group in manifest.groups)
    _rewrite_manifest(folder, block_size=block_size, groups=groups)


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


DAMAGES = {
    "flipped_shard_of_rank_1": lambda f: _flip(os.path.join(f, SHARD_1)),
    "truncated_replicated": lambda f: _truncate(os.path.join(f, REPLICATED)),
    "flipped_model_states": lambda f: _flip(os.path.join(f, MODEL), 0.9),
    "flipped_manifest": lambda f: _flip(os.path.join(f, MANIFEST)),
    "missing_rank_file": lambda f: os.remove(os.path.join(f, SHARD_1)),
    "damaged_latest": lambda f: _write(os.path.join(f, "latest"), "A\x00\x17"),
    "latest_names_missing_tag": lambda f: _write(os.path.join(f, "latest"), "global_step99"),
    "unknown_format_version": lambda f: _rewrite_manifest(f, format_version=99),
    "other_block_size": lambda f: _rewrite_block_size(f, 128),
}


def _fail_when(event_wanted: str, file_wanted: str, occurrence: int = 1):
    """An I/O hook raising ``OSError`` at the ``occurrence``-th ``event_wanted`` on a file named ``file_wanted``."""
    seen = [0]

    def hook(event: str, path: str) -> None:
        if event == event_wanted and os.path.basename(path).startswith(file_wanted):
            seen[0] += 1
            if seen[0] == occurrence:
                raise OSError(28, f"injected: no space left on device while {event} {os.path.basename(path)}")

    return hook


#: (failing rank, event, file-name prefix, occurrence, tag saved): one phase of a save each;
#: tag "A" re-saves the existing tag (its folder is moved aside, then must come back).
SAVE_FAILURES = (
    (1, "mkdir", "zero_bnb", 1, "B"),
    (1, "write", "shard_00001", 5, "B"),
    (0, "write", "mp_rank_00_model_states", 3, "B"),
    (0, "fsync", "replicated", 1, "B"),
    (0, "create", "manifest", 1, "B"),
    (0, "rename", ".B", 1, "B"),
    (0, "rename", ".A", 1, "A"),
)


def _listing(folder: str) -> tuple[list[str], str]:
    """Every entry of ``folder`` (hidden ones too) and what ``latest`` names."""
    with open(os.path.join(folder, "latest")) as handle:
        return sorted(os.listdir(folder)), handle.read()


def _wrong_shape_engine(world):
    model = torch.nn.Sequential(
        torch.nn.Linear(60, 160), torch.nn.GELU(), torch.nn.Linear(160, 96), torch.nn.GELU(), torch.nn.Linear(96, 91)
    )
    optimizer = bnb.optim.Adam8bit(param_groups(model), lr=LR)
    engine, *_ = zero_bnb.initialize(model=model, optimizer=optimizer, config=RUN.ds_config(world))
    return engine


def _bad_checkpoints(c, out):
    """Bad checkpoints: refused on every rank before anything changes."""
    rank, world, workdir, engine, good = c["rank"], c["world"], c["workdir"], c["engine"], c["good"]
    before = consolidated_state(engine)
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for name, damage in DAMAGES.items():
        folder = os.path.join(workdir, name)
        if rank == 0:
            shutil.copytree(good, folder)
            damage(folder)
        dist.barrier()
        out[name] = _error(lambda folder=folder: engine.load_checkpoint(folder))
    out["wrong_model"] = _error(lambda: _wrong_shape_engine(world).load_checkpoint(good))
    adamw = build_engine(world, torch.optim.AdamW)
    train_steps(adamw, RUN, 0, 1)
    adamw.save_checkpoint(os.path.join(workdir, "adamw"), tag="A")
    amsgrad = build_engine(world, functools.partial(torch.optim.AdamW, amsgrad=True))
    out["amsgrad_mismatch"] = _error(lambda: amsgrad.load_checkpoint(os.path.join(workdir, "adamw")))
    after = consolidated_state(engine)
    if rank == 0:
        out["state_changes"] = state_differences(before, after)[1]
    out["weights_changed"] = [n for n, p in engine.module.named_parameters() if not torch.equal(p, weights[n])]
    # ... and trains on exactly like a twin that never saw them (no lock, hook or half-swapped state left behind).
    twin = make_engine(world)
    train_steps(twin, RUN, 0, 3)
    out["losses_after_failed_loads"] = (train_steps(engine, RUN, 3, 1), train_steps(twin, RUN, 3, 1))


def _failing_saves(c, out):
    """A failing save (an I/O error on one rank, in each phase) leaves the previous checkpoint."""
    rank, engine, good = c["rank"], c["engine"], c["good"]
    for victim, event, file_prefix, occurrence, tag in SAVE_FAILURES:
        label = f"save_error:{victim}:{event}:{file_prefix}"
        if rank == victim:
            durable.set_io_hook(_fail_when(event, file_prefix, occurrence))
        out[label] = _error(lambda tag=tag: engine.save_checkpoint(good, tag=tag))
        durable.set_io_hook(None)
        out[label + ":listing"] = _listing(good)
    out["a_after_errors"] = _error(lambda: zero_bnb.verify_checkpoint(good, "A"))
    out["save_after_errors"] = _error(lambda: engine.save_checkpoint(good, tag="D"))
    out["verify_after_errors"] = _error(lambda: zero_bnb.verify_checkpoint(good))
    out["listing_after_errors"] = _listing(good)


def _replicated_by_name(c, out):
    """Replicated keys tagged by name but differing across ranks: refused before writing."""
    world, workdir = c["world"], c["workdir"]
    by_name = make_engine(world, zero_unsharded_state_keys=["qmap1", "qmap2", "absmax1"])
    train_steps(by_name, RUN, 0, 1)
    out["replicated_by_name"] = _error(lambda: by_name.save_checkpoint(os.path.join(workdir, "by_name"), tag="x"))
    folder = os.path.join(workdir, "by_name")
    out["replicated_by_name_listing"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else None


def _nan_state(c, out):
    """NaN in one rank's master weights: refused by default, saved and recorded with "warn"."""
    rank, engine, good = c["rank"], c["engine"], c["good"]
    master = engine.optimizer.master_partition(0)
    entries = engine.optimizer.param_entries(0, engine.param_names)
    start = engine.optimizer.geometry(0).element_range(1)[0]
    out["nan_param"] = next(e.name for e in entries if e.offset <= start < e.offset + e.numel)
    saved_value = master[0].item()
    if rank == 1:
        master.data[0] = float("nan")
    out["nan_error"] = _error(lambda: engine.save_checkpoint(good, tag="nan"))
    out["nan_listing"] = _listing(good)
    engine.zero_bnb_config = dataclasses.replace(engine.zero_bnb_config, nonfinite_check="warn")
    out["nan_warn"] = _error(lambda: engine.save_checkpoint(good, tag="nan", save_latest=False))
    out["nan_manifest"] = read_manifest(os.path.join(good, "nan", SUBDIR)).non_finite
    if rank == 1:
        master.data[0] = saved_value


def _causes_and_switches(c, out):
    """An unpicklable client_state names its kind and keeps its cause; ``zero_nonfinite_check: "off"`` saves NaN
    unrecorded; loading a checkpoint saved with NaN warns; ``zero_checkpoint_verify: false`` skips checksums only."""
    rank, workdir, engine, good = c["rank"], c["workdir"], c["engine"], c["good"]
    try:
        engine.save_checkpoint(good, tag="E", client_state={"callback": lambda: None})
        out["unpicklable"] = None
    except Exception as error:  # noqa: BLE001 - the message and its cause are what the test checks
        out["unpicklable"] = f"{type(error).__name__}: {error}"
        out[f"unpicklable_cause:{rank}"] = None if error.__cause__ is None else type(error.__cause__).__name__
    out["unpicklable_listing"] = _listing(good)
    config = engine.zero_bnb_config
    master = engine.optimizer.master_partition(0)
    saved_value = master[0].item()
    if rank == 1:
        master.data[0] = float("nan")
    engine.zero_bnb_config = dataclasses.replace(config, nonfinite_check="off")
    out["nan_off"] = _error(lambda: engine.save_checkpoint(good, tag="nan_off", save_latest=False))
    out["nan_off_manifest"] = read_manifest(os.path.join(good, "nan_off", SUBDIR)).non_finite
    if rank == 1:
        master.data[0] = saved_value
    engine.zero_bnb_config = config
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("zero_bnb").addHandler(handler)
    try:
        out["nan_load"] = _error(lambda: engine.load_checkpoint(good, tag="nan"))
    finally:
        logging.getLogger("zero_bnb").removeHandler(handler)
    out[f"nan_load_warnings:{rank}"] = [m for m in seen if "NaN/Inf" in m]
    engine.zero_bnb_config = dataclasses.replace(config, checkpoint_verify=False)
    for name in ("flipped_shard_of_rank_1", "truncated_replicated"):
        folder = os.path.join(workdir, f"unverified_{name}")
        if rank == 0:
            shutil.copytree(good, folder)
            DAMAGES[name](folder)
        dist.barrier()
        out[f"unverified:{name}"] = _error(lambda folder=folder: engine.load_checkpoint(folder, tag="A"))
    engine.zero_bnb_config = config


def _to_format_3(tag_folder: str) -> None:
    """Rewrite a SHA-256 checkpoint's manifest as format version 3 wrote it (the files' records and the shards'
    ``module_sha256`` entries are already that format's): ``module_sha256``, the version, the self-checksum."""
    import hashlib
    import json

    path = os.path.join(tag_folder, SUBDIR, MANIFEST_NAME)
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    data = {key: value for key, value in data.items() if key != "manifest_sha256"}
    data["module_sha256"] = data.pop("module_digest")
    data["format_version"] = 3
    text = json.dumps({"manifest_sha256": "0" * 64, **data}, indent=1)
    os.remove(path)
    _write(path, text.replace("0" * 64, hashlib.sha256(text.encode("utf-8")).hexdigest(), 1))


def _digest_algorithms(c, out):
    """A checkpoint hashed with SHA-256 (the writer without the ``blake3`` package), the same rewritten as format
    version 3, and one hashed with BLAKE3 read where the package is missing."""
    rank, workdir, engine = c["rank"], c["workdir"], c["engine"]
    folder = os.path.join(workdir, "digests")
    saved = consolidated_state(engine)
    writing = digests.writing_algorithm
    digests.writing_algorithm = lambda: digests.SHA256
    try:
        engine.save_checkpoint(folder, tag="sha256")
    finally:
        digests.writing_algorithm = writing
    engine.save_checkpoint(folder, tag="blake3")
    if rank == 0:
        shutil.copytree(os.path.join(folder, "sha256"), os.path.join(folder, "format3"))
        _to_format_3(os.path.join(folder, "format3"))
        shutil.copytree(os.path.join(folder, "format3"), os.path.join(folder, "format3_flipped"))
        _flip(os.path.join(folder, "format3_flipped", SUBDIR, "shard_00001-of-00002.pt"))
    dist.barrier()
    out["digests_folder"] = folder
    train_steps(engine, RUN, 10, 1)  # the engine now differs from the checkpoints
    for tag in ("sha256", "format3", "blake3"):
        out[f"digests:{tag}:verify"] = _error(lambda tag=tag: zero_bnb.verify_checkpoint(folder, tag))
        out[f"digests:{tag}:load"] = _error(lambda tag=tag: engine.load_checkpoint(folder, tag=tag))
        loaded = consolidated_state(engine)  # collective
        if rank == 0:
            out[f"digests:{tag}:differences"] = state_differences(saved, loaded)[1]
    out["digests:format3_flipped:load"] = _error(lambda: engine.load_checkpoint(folder, tag="format3_flipped"))
    package, digests._blake3 = digests._blake3, None
    try:
        out["digests:blake3_without_package:load"] = _error(lambda: engine.load_checkpoint(folder, tag="blake3"))
        out["digests:blake3_without_package:verify"] = _error(lambda: zero_bnb.verify_checkpoint(folder, "blake3"))
        out["digests:sha256_without_package:load"] = _error(lambda: engine.load_checkpoint(folder, tag="sha256"))
    finally:
        digests._blake3 = package


def integrity(rank, world, workdir):
    out: dict = {}
    engine = make_engine(world)
    train_steps(engine, RUN, 0, 2)
    good = os.path.join(workdir, "good")
    engine.save_checkpoint(good, tag="A")
    train_steps(engine, RUN, 2, 1)  # the engine now differs from the checkpoint
    context = {"rank": rank, "world": world, "workdir": workdir, "engine": engine, "good": good}
    run_phases(out, context, _bad_checkpoints, _failing_saves, _replicated_by_name, _nan_state,
               _causes_and_switches, _digest_algorithms)

    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        torch.save(gathered, os.path.join(workdir, "integrity.pt"))
