"""Every declared optimizer family: train and save at DP=2, load at DP=3 (one launch per side)."""

from __future__ import annotations

import functools
import os

import bitsandbytes as bnb
import torch
from scenarios import _save_result

from zero_bnb.consolidate import consolidated_state
from zero_bnb.toy import DEFAULT_RUN as RUN
from zero_bnb.toy import build_engine, train_steps

#: name -> optimizer class (with its required arguments); lr is the toy's.
MATRIX = {
    "Adam8bit": bnb.optim.Adam8bit,
    "AdamW8bit": bnb.optim.AdamW8bit,
    "Adam32bit": bnb.optim.Adam32bit,
    "Lion8bit": bnb.optim.Lion8bit,
    "Lion32bit": bnb.optim.Lion32bit,
    "SGD8bit": functools.partial(bnb.optim.SGD8bit, momentum=0.9),
    "RMSprop8bit": bnb.optim.RMSprop8bit,
    "Adagrad8bit": bnb.optim.Adagrad8bit,
    "torch.AdamW": torch.optim.AdamW,
    "torch.Adam": torch.optim.Adam,
}
STEPS = 2


def save_all(rank, world, workdir):
    out = {}
    for name, optimizer in MATRIX.items():
        engine = build_engine(world, optimizer)
        train_steps(engine, RUN, 0, STEPS)
        engine.save_checkpoint(os.path.join(workdir, name), tag="a")
        out[name] = consolidated_state(engine)
    _save_result(os.path.join(workdir, f"saved_dp{world}.pt"), out)


def load_all(rank, world, workdir):
    out = {}
    for name, optimizer in MATRIX.items():
        engine = build_engine(world, optimizer)
        engine.load_checkpoint(os.path.join(workdir, name))
        out[name] = {"state": consolidated_state(engine), "loss": train_steps(engine, RUN, STEPS, 1)[0]}
    _save_result(os.path.join(workdir, f"loaded_dp{world}.pt"), out)
