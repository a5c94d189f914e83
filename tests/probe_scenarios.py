"""Probe scenarios (adversarial): engine saves into tag folders with hidden user data."""
from __future__ import annotations

import os

import bitsandbytes as bnb
import torch

from zero_bnb.format import durable
from zero_bnb.testing.toy import DEFAULT_RUN as RUN
from zero_bnb.testing.toy import build_engine, train_steps


def plant_deep(folder: str, levels: int = 20) -> str:
    """A user's file nested deeper than PATH_MAX below ``folder``; returns its path relative to ``folder``."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    parts = []
    for level in range(levels):
        name = f"d{level:02d}" + "x" * 230
        os.mkdir(name, dir_fd=fd)
        new = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = new
        parts.append(name)
    file = os.open("thesis.tex", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(file, b"years of work")
    os.close(file)
    os.close(fd)
    return os.path.join(*parts, "thesis.tex")


def deep_exists(folder: str, relative: str) -> bool:
    parts = relative.split(os.sep)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        for part in parts[:-1]:
            new = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = new
        os.stat(parts[-1], dir_fd=fd)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    finally:
        os.close(fd)


def _anywhere(save_dir: str, relative: str) -> list[str]:
    return [name for name in os.listdir(save_dir) if deep_exists(os.path.join(save_dir, name), relative)]


def engine_findings(rank: int, world: int, workdir: str) -> None:
    """Each case in turn on one engine (DP=1); results in workdir/findings.pt; a clean checkpoint in workdir/clean."""
    save_dir = os.path.join(workdir, "ckpt")
    engine = build_engine(world, bnb.optim.Adam8bit)
    train_steps(engine, RUN, 0, 1)
    out = {}
    # 1. A user's folder nested deeper than PATH_MAX inside a pure zero_bnb checkpoint.
    engine.save_checkpoint(save_dir, tag="deep")
    relative = plant_deep(os.path.join(save_dir, "deep"))
    out["deep_planted"] = deep_exists(os.path.join(save_dir, "deep"), relative)
    engine.save_checkpoint(save_dir, tag="deep")
    out["deep_survives_in"] = _anywhere(save_dir, relative)
    # 2. A user's file at a listed path, of the listed size.
    engine.save_checkpoint(save_dir, tag="same")
    target = os.path.join(save_dir, "same", "mp_rank_00_model_states.pt")
    size = os.path.getsize(target)
    mine = (b"my weights, edited in place " * (size // 28 + 1))[:size]
    with open(target, "wb") as handle:
        handle.write(mine)
    engine.save_checkpoint(save_dir, tag="same")
    out["same_size_survives_in"] = [
        name for name in os.listdir(save_dir)
        if os.path.isfile(os.path.join(save_dir, name, "mp_rank_00_model_states.pt"))
        and open(os.path.join(save_dir, name, "mp_rank_00_model_states.pt"), "rb").read() == mine]
    # 3. A user's file written into the tag folder after the last check, as the folder is moved aside.
    engine.save_checkpoint(save_dir, tag="late")
    final = os.path.join(save_dir, "late")

    def hook(event: str, path: str) -> None:
        if event == "rename" and path == final:
            with open(os.path.join(final, "eval_results.json"), "w") as handle:
                handle.write('{"acc": 0.93}')

    durable.set_io_hook(hook)
    try:
        engine.save_checkpoint(save_dir, tag="late")
    finally:
        durable.set_io_hook(None)
    out["late_file_survives_in"] = [os.path.relpath(root, save_dir) for root, _, names in os.walk(save_dir)
                                    if "eval_results.json" in names]
    engine.save_checkpoint(os.path.join(workdir, "clean"), tag="A")
    engine.destroy()
    torch.save(out, os.path.join(workdir, "findings.pt"))
