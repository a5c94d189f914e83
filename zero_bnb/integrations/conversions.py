"""The conversion habits users bring, on zero_bnb checkpoints: DeepSpeed's and Lightning's ``zero_to_fp32``.

Stock DeepSpeed reads the fp32 master weights from its ``*_optim_states.pt`` files, which a
zero_bnb checkpoint does not have, so both of these fail with ``can't find *_optim_states.pt
files``:

* ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)``
  (and ``load_state_dict_from_zero_checkpoint``, which calls it);
* ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir,
  output_file, tag)``.

:func:`route_deepspeed_zero_to_fp32` (installed by ``zero_bnb.enable()`` / ``enabled()`` and by
``import zero_bnb.lightning``) and :func:`route_lightning_convert` (by ``import zero_bnb.lightning``)
replace those module attributes by functions with the same signature that read zero_bnb checkpoints
through :mod:`zero_bnb.tools.recovery` and pass every other checkpoint to the original. They stay
installed: they change nothing for the checkpoints stock DeepSpeed can read. A name imported with
``from ... import`` before the route was installed keeps the original function.

Local, single process, no collectives.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

import torch

from zero_bnb.checkpoint.derived import DERIVED_PARAMS_KEY
from zero_bnb.errors import CheckpointError
from zero_bnb.format.stock_files import model_file_of
from zero_bnb.format.unpickle import safe_load
from zero_bnb.tools.checkpoint_paths import detect, locate
from zero_bnb.tools.outputs import replacing_file
from zero_bnb.tools.recovery import get_fp32_state_dict_from_zero_checkpoint

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "is_zero_bnb_checkpoint", "route_deepspeed_zero_to_fp32",
           "route_lightning_convert"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()

#: Keys of DeepSpeed's model file that are not the Lightning checkpoint (Lightning's list, plus zero_bnb's own).
_DEEPSPEED_STATES = ("module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps",
                     "global_steps", "dp_world_size", "mp_world_size", DERIVED_PARAMS_KEY)


def is_zero_bnb_checkpoint(checkpoint_dir: Any, tag: str | None = None) -> bool:
    """Whether ``checkpoint_dir`` (a save folder, or a tag folder when ``tag`` is None) holds a zero_bnb checkpoint.

    ``False`` for anything else, unreadable paths included (the original function then reports those).
    """
    try:
        return detect(os.fspath(checkpoint_dir), tag) == "zero_bnb"
    except (CheckpointError, OSError, TypeError):
        return False


def _fp32_state_dict(checkpoint_dir, tag=None, exclude_frozen_parameters=False, lazy_mode=False):
    """DeepSpeed's signature; ``lazy_mode`` gives real tensors (they have ``contiguous()`` like DeepSpeed's lazy ones)."""
    return get_fp32_state_dict_from_zero_checkpoint(os.fspath(checkpoint_dir), tag, exclude_frozen_parameters)


def route_deepspeed_zero_to_fp32() -> None:
    """Make ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` read zero_bnb checkpoints too.

    Idempotent. Local: call it in the process that converts.
    """
    import deepspeed.utils.zero_to_fp32 as stock

    with _LOCK:
        if not getattr(stock.get_fp32_state_dict_from_zero_checkpoint, "_zero_bnb_route", False):
            original = stock.get_fp32_state_dict_from_zero_checkpoint

            @functools.wraps(original)
            def routed(checkpoint_dir, tag=None, exclude_frozen_parameters=False, lazy_mode=False):
                if is_zero_bnb_checkpoint(checkpoint_dir, tag):
                    return _fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters, lazy_mode)
                return original(checkpoint_dir, tag, exclude_frozen_parameters, lazy_mode)

            routed._zero_bnb_route = True
            stock.get_fp32_state_dict_from_zero_checkpoint = routed


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Any, output_file: Any,
                                               tag: str | None = None) -> dict[str, Any]:
    """Lightning's function of that name for a zero_bnb checkpoint: the Lightning checkpoint with fp32 weights.

    Writes ``torch.save`` of the Lightning checkpoint kept in DeepSpeed's model file (without
    DeepSpeed's own entries) with ``"state_dict"`` set to every parameter's fp32 master weight,
    so ``LightningModule.load_from_checkpoint(output_file)`` works without DeepSpeed. The model
    file is read with ``weights_only=True``: a checkpoint whose hyper-parameters hold other classes
    is refused, naming the class (allow it with ``torch.serialization.add_safe_globals``).
    The output replaces ``output_file`` only once complete.
    """
    checkpoint_dir = os.fspath(checkpoint_dir)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    save_dir, folder_tag = locate(checkpoint_dir, tag)
    _, model_file = model_file_of(os.path.join(save_dir, folder_tag))  # rank 0's at ZeRO stage 3
    client_state = safe_load(model_file, "DeepSpeed model file", deepspeed_classes=True)
    client_state = {key: value for key, value in client_state.items() if key not in _DEEPSPEED_STATES}
    client_state["state_dict"] = {key.removeprefix("_forward_module."): value for key, value in state_dict.items()}
    with replacing_file(os.fspath(output_file)) as temporary:
        torch.save(client_state, temporary)
    logger.info("zero_bnb: wrote the fp32 Lightning checkpoint of %s to %s", os.path.join(save_dir, folder_tag),
                output_file)
    return client_state


def route_lightning_convert() -> None:
    """Make ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` read zero_bnb
    checkpoints too (the original handles the rest). Idempotent; local."""
    import lightning.pytorch.utilities.deepspeed as lightning_utilities

    with _LOCK:
        if not getattr(lightning_utilities.convert_zero_checkpoint_to_fp32_state_dict, "_zero_bnb_route", False):
            original = lightning_utilities.convert_zero_checkpoint_to_fp32_state_dict

            @functools.wraps(original)
            def routed(checkpoint_dir, output_file, tag=None):
                if is_zero_bnb_checkpoint(checkpoint_dir, tag):
                    return convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag)
                return original(checkpoint_dir, output_file, tag)

            routed._zero_bnb_route = True
            lightning_utilities.convert_zero_checkpoint_to_fp32_state_dict = routed
