"""zero_bnb: bitsandbytes 8-bit optimizers under DeepSpeed ZeRO stages 1, 2 and 3, with checkpoints
that resume at any data-parallel size, bit for bit.

Quick start::

    import bitsandbytes as bnb, zero_bnb
    optimizer = bnb.optim.Adam8bit(model.parameters(), lr=1e-3)
    engine, optimizer, _, _ = zero_bnb.initialize(model=model, optimizer=optimizer, config="ds_config.json")
    engine.save_checkpoint("ckpt")   # on N ranks
    engine.load_checkpoint("ckpt")   # later, on any number of ranks

Front doors: ``zero_bnb.enable()`` (or ``with zero_bnb.enabled():``) makes transformers' Trainer,
Accelerate and any ``deepspeed.initialize`` call build zero_bnb's engine; ``import zero_bnb.lightning``
registers Lightning strategies for ZeRO stages 1 to 3, ``strategy="deepspeed_zero_bnb_stage_1"`` (``_2``, ``_3``),
each with an ``_offload`` variant (stage 3's offloads the parameters too).
"""

from __future__ import annotations

from importlib import metadata as _metadata

from zero_bnb.core.config import ZeroBnbConfig, ZeroBnbConfigError
from zero_bnb.core.state_spec import StateKind, UnsupportedOptimizerError
from zero_bnb.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointReplacedError,
    CheckpointSaveError,
    CheckpointUsageError,
    NonFiniteStateError,
    ReplicatedStateMismatch,
)
from zero_bnb.format.reader import verify_checkpoint
from zero_bnb.versions import UnsupportedVersionError

#: Public names whose modules import DeepSpeed: imported on first use, so that ``import zero_bnb``
#: (and ``zero-bnb inspect`` / ``verify``) does not pay DeepSpeed's import time.
_LAZY = {
    "describe": "zero_bnb.ds.describe",
    "initialize": "zero_bnb.ds.initialize",
    "enable": "zero_bnb.integrations.substitute",
    "disable": "zero_bnb.integrations.substitute",
    "enabled": "zero_bnb.integrations.substitute",
    "is_enabled": "zero_bnb.integrations.substitute",
    "Preemption": "zero_bnb.integrations.preemption",
    "save_on_preemption": "zero_bnb.integrations.preemption",
    "PreemptionCallback": "zero_bnb.integrations.hf_preemption",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zero_bnb' has no attribute {name!r}")

try:
    __version__ = _metadata.version("zero_bnb")
except _metadata.PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointReplacedError",
    "CheckpointSaveError",
    "CheckpointUsageError",
    "NonFiniteStateError",
    "Preemption",
    "PreemptionCallback",
    "ReplicatedStateMismatch",
    "StateKind",
    "UnsupportedOptimizerError",
    "UnsupportedVersionError",
    "ZeroBnbConfig",
    "ZeroBnbConfigError",
    "__version__",
    "describe",
    "disable",
    "enable",
    "enabled",
    "initialize",
    "is_enabled",
    "save_on_preemption",
    "verify_checkpoint",
]
