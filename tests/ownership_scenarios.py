"""Saves into tag folders zero_bnb did not write (issue 31, F1): one launch at DP=2, every case in turn."""

from __future__ import annotations

import json
import os
import shutil

import bitsandbytes as bnb
import deepspeed
import torch.distributed as dist
from async_scenarios import _remove_staging_when
from hostile_scenarios import resign
from scenarios import _error, _save_result

from zero_bnb.format import durable

from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import build_engine, build_model, param_groups, train_steps

DOCUMENTS = {"taxes.pdf": b"%PDF", "notes.txt": b"mine", "photos/cat.jpg": b"\xff\xd8", "a.md": b"#", "b.md": b"#",
             "c.md": b"#"}


def _tree(folder: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


def _plant(folder: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "wb") as handle:
            handle.write(data)


def _dirs(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, name), folder) for root, names, _ in os.walk(folder)
                  for name in names)


def _probe_findings(rank: int, save_dir: str, engine, out: dict) -> None:
    """What an adversarial probe of the kept-files step found (issue 42, point 3)."""
    import zero_bnb.checkpoint.commit as commit

    # An empty folder of the user's, one listed file owned by another user (root only) and a link planted for the
    # zero_bnb/ folder of a copy: kept, never removed or followed.
    engine.save_checkpoint(save_dir, tag="probe")
    dist.barrier()
    if rank == 0:
        os.makedirs(os.path.join(save_dir, "probe", "my_empty", "deeper"))
        _plant(os.path.join(save_dir, "probe"), {"notes.txt": b"mine"})
        if os.geteuid() == 0:
            os.chown(os.path.join(save_dir, "probe", "mp_rank_00_model_states.pt"), 65534, 65534)
    dist.barrier()
    engine.save_checkpoint(save_dir, tag="probe")
    dist.barrier()
    [kept] = [name for name in sorted(os.listdir(save_dir)) if name.startswith("probe.replaced-")]
    out["probe_kept"] = (_dirs(os.path.join(save_dir, kept)), sorted(_tree(os.path.join(save_dir, kept))))
    out["probe_root"] = os.geteuid() == 0
    # A save killed between its two renames left the tag at its hidden name, with a user's file: the next save keeps
    # it whole until the new checkpoint is in place; killed before that (the rename of the new one fails here), the
    # previous checkpoint is whole under the visible name.
    engine.save_checkpoint(save_dir, tag="left")
    dist.barrier()
    if rank == 0:
        _plant(os.path.join(save_dir, "left"), {"notes.txt": b"mine"})
        os.rename(os.path.join(save_dir, "left"), os.path.join(save_dir, ".left.zero_bnb-replaced"))
    dist.barrier()
    whole = sorted(_tree(os.path.join(save_dir, ".left.zero_bnb-replaced")))
    original = commit.publish_folder

    def killed(*args):
        raise OSError(5, "injected: killed before the new folder's rename")

    commit.publish_folder = killed
    try:
        out["left_error"] = _error(lambda: engine.save_checkpoint(save_dir, tag="left"))
    finally:
        commit.publish_folder = original
    dist.barrier()
    [kept] = [name for name in sorted(os.listdir(save_dir)) if name.startswith("left.replaced-")]
    out["left_kept_whole"] = sorted(_tree(os.path.join(save_dir, kept))) == whole and "notes.txt" in whole
    # Removing zero_bnb's own files from a kept folder fails (a read-only folder for another user): the new checkpoint
    # is saved and 'latest' names it all the same.
    original_remove = commit.remove_own_files

    def refused(folder):
        raise PermissionError(13, "injected: permission denied", folder)

    if rank == 0:
        _plant(os.path.join(save_dir, "mine"), {"again.json": b"{}"})
    dist.barrier()
    commit.remove_own_files = refused
    try:
        out["strip_failed"] = _error(lambda: engine.save_checkpoint(save_dir, tag="mine"))
    finally:
        commit.remove_own_files = original_remove
    out["strip_failed_latest"] = open(os.path.join(save_dir, "latest")).read()
    # The staging folder removed by something else at the save's first file: named as the cause (the shard's folder
    # was made again under the removed path, and the commit blamed ranks saving into different folders).
    if rank == 0:
        durable.set_io_hook(_remove_staging_when("create", ""))
    try:
        out["staging_removed_early"] = _error(lambda: engine.save_checkpoint(save_dir, tag="early"))
    finally:
        durable.set_io_hook(None)


def saves_over_foreign_folders(rank: int, world: int, workdir: str) -> None:
    out: dict = {}
    save_dir = os.path.join(workdir, "ckpt")
    engine = build_engine(world, bnb.optim.Adam8bit)
    train_steps(engine, RUN, 0, 1)
    # A user's folder at the tag: refused, untouched.
    if rank == 0:
        _plant(os.path.join(save_dir, "Documents"), DOCUMENTS)
    dist.barrier()
    out["documents_error"] = _error(lambda: engine.save_checkpoint(save_dir, tag="Documents"))
    dist.barrier()
    out["documents_after"] = _tree(os.path.join(save_dir, "Documents"))
    # A stock DeepSpeed checkpoint at the tag, with a user's file in it: kept whole beside the new checkpoint.
    model = build_model()
    stock = deepspeed.initialize(model=model, optimizer=bnb.optim.Adam8bit(param_groups(model)),
                                 config={**RUN.ds_config(world), "zero_allow_untested_optimizer": True})[0]
    train_steps(stock, RUN, 0, 1)
    stock.save_checkpoint(save_dir, tag="stock")
    stock.destroy()
    if rank == 0:
        _plant(os.path.join(save_dir, "stock"), {"my_eval.json": b"{\"acc\": 0.9}"})
    dist.barrier()
    stock_files = _tree(os.path.join(save_dir, "stock"))
    engine.save_checkpoint(save_dir, tag="stock")
    dist.barrier()
    kept = [name for name in sorted(os.listdir(save_dir)) if name.startswith("stock.replaced-")]
    out["stock_kept"] = kept
    out["stock_kept_intact"] = bool(kept) and _tree(os.path.join(save_dir, kept[0])) == stock_files
    out["stock_is_zero_bnb"] = os.path.isfile(os.path.join(save_dir, "stock", "zero_bnb", "manifest.json"))
    # A zero_bnb checkpoint holding only its files: replaced, nothing kept.
    engine.save_checkpoint(save_dir, tag="mine")
    engine.save_checkpoint(save_dir, tag="mine")
    dist.barrier()
    out["mine_kept"] = [name for name in os.listdir(save_dir) if name.startswith("mine.")]
    # ... and with a user's file added: kept whole.
    if rank == 0:
        _plant(os.path.join(save_dir, "mine"), {"my_eval.json": b"{}"})
    dist.barrier()
    engine.save_checkpoint(save_dir, tag="mine")
    dist.barrier()
    kept = [name for name in sorted(os.listdir(save_dir)) if name.startswith("mine.replaced-")]
    out["mine_with_user_file_kept"] = kept
    out["user_file_survives"] = bool(kept) and os.path.isfile(os.path.join(save_dir, kept[0], "my_eval.json"))
    engine.load_checkpoint(save_dir, tag="mine")  # the new one is a complete checkpoint
    out["loaded"] = True
    # Issue 42, point 3: tag "best" saved five times, the user adding a small file after each save: the folders kept
    # hold the user's files, not four copies of the checkpoint.
    for index in range(5):
        engine.save_checkpoint(save_dir, tag="best")
        dist.barrier()
        if rank == 0:
            _plant(os.path.join(save_dir, "best"), {f"eval-{index}.json": b"{\"acc\": 0.%d}" % index})
        dist.barrier()
    out["best_kept"] = {name: _tree(os.path.join(save_dir, name)) for name in sorted(os.listdir(save_dir))
                        if name.startswith("best.")}
    out["best_now"] = sorted(_tree(os.path.join(save_dir, "best")))
    # Issue 42, point 4: a copy of a real checkpoint with the user's files, its manifest re-signed to list them, in a
    # folder another user could write into: the manifest proves nothing unless the running user owns it and no one
    # else can write it (group-writable here; owned by another user where the test runs as root).
    planted = {"notes.txt": b"mine", "taxes/2025.pdf": b"%PDF-1.7"}
    attacks = ["group_writable"] + (["other_owner"] if os.geteuid() == 0 else [])
    for attack in attacks:
        folder = os.path.join(save_dir, f"Documents_{attack}")
        if rank == 0:
            shutil.copytree(os.path.join(save_dir, "mine"), folder)
            _plant(folder, planted)
            manifest_folder = os.path.join(folder, "zero_bnb")
            with open(os.path.join(manifest_folder, "manifest.json"), encoding="utf-8") as handle:
                data = json.load(handle)
            for name in planted:
                size, digest = durable.digest_file(os.path.join(folder, name))
                data["files"].append({"path": name, "size": size, "sha256": digest})
            resign(manifest_folder, data)
            manifest = os.path.join(manifest_folder, "manifest.json")
            if attack == "group_writable":
                os.chmod(manifest, 0o664)
            else:
                os.chmod(manifest, 0o644)
                os.chown(manifest, 65534, 65534)
        dist.barrier()
        engine.save_checkpoint(save_dir, tag=f"Documents_{attack}")
        dist.barrier()
        kept = [name for name in sorted(os.listdir(save_dir)) if name.startswith(f"Documents_{attack}.replaced-")]
        out[f"attack_{attack}"] = {name: data for name, data in _tree(os.path.join(save_dir, kept[0])).items()
                                   if name in planted} if len(kept) == 1 else kept
    out["attacks"] = attacks
    _probe_findings(rank, save_dir, engine, out)
    engine.destroy()
    _save_result(os.path.join(workdir, "ownership.pt"), out)
