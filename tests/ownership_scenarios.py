"""Saves into tag folders zero_bnb did not write (issue 31, F1): one launch at DP=2, every case in turn."""

from __future__ import annotations

import os

import bitsandbytes as bnb
import deepspeed
import torch.distributed as dist
from scenarios import _error, _save_result

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
    engine.destroy()
    _save_result(os.path.join(workdir, "ownership.pt"), out)
