"""zero_bnb: bitsandbytes 8-bit optimizers under DeepSpeed ZeRO stages 1 and 2, with checkpoints
that resume at any data-parallel size, bit for bit.

Quick start::

    import bitsandbytes as bnb, zero_bnb
    optimizer = bnb.optim.Adam8bit(model.parameters(), lr=1e-3)
    engine, optimizer, _, _ = zero_bnb.initialize(model=model, optimizer=optimizer, config="ds_config.json")
    engine.save_checkpoint("ckpt")   # on N ranks
    engine.load_checkpoint("ckpt")   # later, on any number of ranks

Front doors: ``zero_bnb.enable()`` (or ``with zero_bnb.enabled():``) makes transformers' Trainer,
Accelerate and any ``deepspeed.initialize`` call build zero_bnb's engine; ``import zero_bnb.lightning``
registers ``strategy="deepspeed_zero_bnb_stage_1"`` (and ``_2``) for Lightning.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from zero_bnb.config import ZeroBnbConfig, ZeroBnbConfigError
from zero_bnb.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointSaveError,
    CheckpointUsageError,
    NonFiniteStateError,
    ReplicatedStateMismatch,
)
from zero_bnb.initialize import initialize
from zero_bnb.load import verify_checkpoint
from zero_bnb.state_spec import StateKind, UnsupportedOptimizerError
from zero_bnb.substitute import disable, enable, enabled, is_enabled

try:
    __version__ = _metadata.version("zero_bnb")
except _metadata.PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointUsageError",
    "NonFiniteStateError",
    "ReplicatedStateMismatch",
    "StateKind",
    "UnsupportedOptimizerError",
    "ZeroBnbConfig",
    "ZeroBnbConfigError",
    "__version__",
    "disable",
    "enable",
    "enabled",
    "initialize",
    "is_enabled",
    "verify_checkpoint",
]
