"""zero_bnb's own config keys, read from (and stripped out of) a DeepSpeed config.

zero_bnb's keys (``zero_unsharded_state_keys``, ``zero_unsharded_state_max_numel``,
``zero_nonfinite_check``, ``zero_checkpoint_verify``, ``zero_derived_module_weights``,
``zero_cpu_update``, ``zero_gpu_update``, ``zero_update_max_numel``, ``zero_checkpoint_async``,
``zero_checkpoint_async_max_staging_mb``) may sit at the top level of the DeepSpeed config (stock
DeepSpeed ignores unknown top-level keys, so one JSON serves both) or inside ``zero_optimization`` (which
stock DeepSpeed would reject, so they are removed before DeepSpeed validates the config).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zero_bnb.core.state_spec import BNB_BLOCK_SIZE, BNB_KERNEL_MAX_NUMEL, declared, spec_for

__all__ = [
    "CHECKPOINT_ASYNC",
    "CHECKPOINT_ASYNC_MAX_STAGING_MB",
    "CHECKPOINT_VERIFY",
    "CPU_UPDATE",
    "CPU_UPDATE_MODES",
    "DEEPSPEED_ZERO_KEYS",
    "DERIVED_MODULE_WEIGHTS",
    "GPU_UPDATE",
    "GPU_UPDATE_MODES",
    "NONFINITE_CHECK",
    "OWN_KEYS",
    "UNSHARDED_KEYS",
    "UNSHARDED_MAX_NUMEL",
    "UPDATE_MAX_NUMEL",
    "ZERO_SECTION_KEYS",
    "ZeroBnbConfig",
    "ZeroBnbConfigError",
    "load_ds_config",
    "prepare_offload",
    "refuse_optimizer_section",
    "refuse_unknown_keys",
    "split_config",
]

UNSHARDED_KEYS = "zero_unsharded_state_keys"
UNSHARDED_MAX_NUMEL = "zero_unsharded_state_max_numel"
NONFINITE_CHECK = "zero_nonfinite_check"
CHECKPOINT_VERIFY = "zero_checkpoint_verify"
DERIVED_MODULE_WEIGHTS = "zero_derived_module_weights"
CPU_UPDATE = "zero_cpu_update"
GPU_UPDATE = "zero_gpu_update"
UPDATE_MAX_NUMEL = "zero_update_max_numel"
CHECKPOINT_ASYNC = "zero_checkpoint_async"
CHECKPOINT_ASYNC_MAX_STAGING_MB = "zero_checkpoint_async_max_staging_mb"
#: Values of ``zero_cpu_update``.
CPU_UPDATE_MODES = ("auto", "fused", "bitsandbytes")
#: Values of ``zero_gpu_update``.
GPU_UPDATE_MODES = ("auto", "fused", "bitsandbytes")
#: zero_bnb's keys: it owns the ``zero_`` prefix at the top level of the config, beside DeepSpeed's own.
OWN_KEYS = (UNSHARDED_KEYS, UNSHARDED_MAX_NUMEL, NONFINITE_CHECK, CHECKPOINT_VERIFY, DERIVED_MODULE_WEIGHTS,
            CPU_UPDATE, GPU_UPDATE, UPDATE_MAX_NUMEL, CHECKPOINT_ASYNC, CHECKPOINT_ASYNC_MAX_STAGING_MB)
#: DeepSpeed's top-level keys that start with ``zero_`` (``deepspeed.runtime.constants``; a test checks the list
#: against the installed DeepSpeed). Any other top-level ``zero_`` key is a typo: DeepSpeed ignores unknown top-level
#: keys, so a misspelt zero_bnb key would silently do nothing.
DEEPSPEED_ZERO_KEYS = ("zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer")
#: Fields of DeepSpeed's ``zero_optimization`` section that start with ``zero_`` (checked against the installed
#: DeepSpeed by a test), and Accelerate's name for the stage: at the top level they are put back where they belong.
ZERO_SECTION_KEYS = {"zero_hpz_partition_size": "zero_hpz_partition_size", "zero_quantized_weights":
                     "zero_quantized_weights", "zero_quantized_nontrainable_weights": "zero_quantized_nontrainable_weights",
                     "zero_quantized_gradients": "zero_quantized_gradients", "zero_stage": "stage"}
_NONFINITE_MODES = ("error", "warn", "off")
#: DeepSpeed's top-level key that makes it refuse every client optimizer under optimizer offload.
FORCE_DS_CPU_OPTIMIZER = "zero_force_ds_cpu_optimizer"


class ZeroBnbConfigError(ValueError):
    """A zero_bnb config value is malformed or contradicts another."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroBnbConfig:
    """zero_bnb settings taken from the DeepSpeed config.

    Attributes:
        unsharded_state_keys: exact optimizer-state key names kept whole on every rank (never
            sliced or merged), for example ``("qmap1", "qmap2")``. ``None`` means "the
            optimizer's declared default" (the quantization maps for bitsandbytes).
        unsharded_state_max_numel: tensor states with at most this many elements are also
            kept whole. ``None`` disables the size rule. Beware: a small partition's
            ``absmax`` falls under a threshold too; such a key differs across ranks and is
            refused when the checkpoint is saved.
        nonfinite_check: what a save does when master weights or float optimizer state hold
            NaN/Inf: ``"error"`` (default) refuses to save and names the parameters, ``"warn"``
            saves, logs them and records them in the manifest, ``"off"`` skips the scan.
        checkpoint_verify: whether a load checks every file's digest against the manifest
            (the work is split across ranks) before it touches the model. Size and format
            checks run either way.
        derived_module_weights: whether DeepSpeed's model file leaves out the trained module
            weights (the shards then hold the fp32 masters whole; a load rebuilds the module weights
            from them). Only fp16 training saves bytes with it (2 per parameter): by default fp32 and
            bf16 checkpoints already store each weight once, the masters derived from the module
            weights (``zero_bnb.format.masters``), and the engine warns that the key is useless there.
            Default ``False``: the model file holds the weights, as stock DeepSpeed's does, so stock
            ``load_checkpoint``, ``load_module_only`` and other readers see them.
        cpu_update: how a bitsandbytes 8-bit update whose state lives on the CPU (optimizer offload, CPU
            training) runs: ``"auto"`` (default) with zero_bnb's fused kernel (``zero_bnb.kernels``: the
            arithmetic of bitsandbytes' CUDA kernel, compiled on first use) or, when it cannot be built,
            bitsandbytes' CPU path with one warning; ``"fused"`` the kernel or an error; ``"bitsandbytes"``
            bitsandbytes' own CPU path (what stock DeepSpeed runs).
        gpu_update: how a bitsandbytes 8-bit update whose parameter and state live on a GPU runs: ``"auto"``
            (default) with zero_bnb's Triton kernel (``zero_bnb.kernels.triton_update``: the same arithmetic and state
            format, one pass over memory) for the families and GPU generations a GPU measurement showed faster than
            bitsandbytes' CUDA kernel (``zero_bnb.kernels.update.GPU_FUSED_FASTER``: none yet, so bitsandbytes'
            kernel runs), else bitsandbytes' kernel; ``"fused"`` the Triton kernel for every family (an error where
            Triton is missing or older than 3.0); ``"bitsandbytes"`` bitsandbytes' kernel. Paged state always takes
            bitsandbytes' kernel.
        update_max_numel: the largest piece of a partition one bitsandbytes update call steps
            (:mod:`zero_bnb.bnb.chunked`; rounded down to whole 256-element blocks). The default is the
            kernels' limit, 2^31 - 1 elements: larger partitions are updated in block-aligned pieces, with
            the result of one call. A smaller value bounds the fp32 temporaries of bitsandbytes' CPU path
            (it dequantizes both moments of what it steps into new tensors) and lets a test exercise the
            piecewise update on a small model; the result does not depend on it.
        checkpoint_async: whether ``save_checkpoint`` returns once every rank's state is copied into host
            memory (:mod:`zero_bnb.checkpoint.staging`), writing, checksumming, fsyncing and committing the
            checkpoint in a background thread (:mod:`zero_bnb.checkpoint.background`) while training goes on.
            Default ``False``: the save returns when the checkpoint is committed.
        checkpoint_async_max_staging_mb: the most host memory (MiB) one asynchronous save may stage; a save
            that needs more runs synchronously instead, with a warning. ``None`` (default): no limit.
    """

    unsharded_state_keys: tuple[str, ...] | None = None
    unsharded_state_max_numel: int | None = None
    nonfinite_check: str = "error"
    checkpoint_verify: bool = True
    derived_module_weights: bool = False
    cpu_update: str = "auto"
    gpu_update: str = "auto"
    update_max_numel: int = BNB_KERNEL_MAX_NUMEL
    checkpoint_async: bool = False
    checkpoint_async_max_staging_mb: float | None = None

    def __post_init__(self) -> None:
        keys = self.unsharded_state_keys
        if keys is not None:
            bad = [k for k in keys if not isinstance(k, str) or not k]
            if bad:
                raise ZeroBnbConfigError(
                    f"{UNSHARDED_KEYS} must list non-empty state-key names such as [\"qmap1\", \"qmap2\"]; "
                    f"got invalid entries {bad!r} in {list(keys)!r}"
                )
        limit = self.unsharded_state_max_numel
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ZeroBnbConfigError(
                f"{UNSHARDED_MAX_NUMEL} must be a non-negative integer number of elements (for example 256), "
                f"got {limit!r}"
            )
        if self.nonfinite_check not in _NONFINITE_MODES:
            raise ZeroBnbConfigError(
                f"{NONFINITE_CHECK} must be one of {list(_NONFINITE_MODES)}, got {self.nonfinite_check!r}"
            )
        if self.cpu_update not in CPU_UPDATE_MODES:
            raise ZeroBnbConfigError(
                f"{CPU_UPDATE} must be one of {list(CPU_UPDATE_MODES)}, got {self.cpu_update!r}"
            )
        if self.gpu_update not in GPU_UPDATE_MODES:
            raise ZeroBnbConfigError(
                f"{GPU_UPDATE} must be one of {list(GPU_UPDATE_MODES)}, got {self.gpu_update!r}"
            )
        pieces = self.update_max_numel
        if isinstance(pieces, bool) or not isinstance(pieces, int) or not BNB_BLOCK_SIZE <= pieces <= BNB_KERNEL_MAX_NUMEL:
            raise ZeroBnbConfigError(
                f"{UPDATE_MAX_NUMEL} must be an integer number of elements from {BNB_BLOCK_SIZE} (one quantization "
                f"block) to {BNB_KERNEL_MAX_NUMEL} (bitsandbytes' kernel limit, the default), got {pieces!r}"
            )
        staging = self.checkpoint_async_max_staging_mb
        if staging is not None and (isinstance(staging, bool) or not isinstance(staging, (int, float))
                                    or not 0 <= staging < float("inf")):
            raise ZeroBnbConfigError(
                f"{CHECKPOINT_ASYNC_MAX_STAGING_MB} must be a non-negative number of MiB (for example 4096), or absent "
                f"for no limit; got {staging!r}"
            )
        for key, value in ((CHECKPOINT_VERIFY, self.checkpoint_verify), (DERIVED_MODULE_WEIGHTS, self.derived_module_weights),
                           (CHECKPOINT_ASYNC, self.checkpoint_async)):
            if not isinstance(value, bool):
                raise ZeroBnbConfigError(f"{key} must be true or false, got {value!r}")


def load_ds_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A private deep copy of a DeepSpeed config given as a dict or a JSON file path."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ZeroBnbConfigError(f"DeepSpeed config file {path!r} does not exist; pass a dict or an existing JSON path")
    with open(path, encoding="utf-8") as handle:
        try:
            loaded = json.load(handle)
        except json.JSONDecodeError as error:
            raise ZeroBnbConfigError(f"DeepSpeed config file {path!r} is not valid JSON: {error}") from error
    if not isinstance(loaded, dict):
        raise ZeroBnbConfigError(f"DeepSpeed config file {path!r} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


def split_config(ds_config: Mapping[str, Any]) -> tuple[ZeroBnbConfig, dict[str, Any]]:
    """Separate zero_bnb's keys from a DeepSpeed config dict.

    Returns:
        The parsed :class:`ZeroBnbConfig` and a copy of ``ds_config`` without zero_bnb's keys,
        ready for DeepSpeed's own validation. The input is not modified.

    Raises:
        ZeroBnbConfigError: a value is malformed, a key is given both at the top level and
            inside ``zero_optimization`` with different values, or a top-level key starting with ``zero_`` is
            neither zero_bnb's nor DeepSpeed's (a typo that would silently do nothing).
    """
    refuse_unknown_keys(ds_config)
    cleaned = copy.deepcopy(dict(ds_config))
    zero_section = cleaned.get("zero_optimization")
    found: dict[str, Any] = {}
    for key in OWN_KEYS:
        top = cleaned.pop(key, None)
        nested = zero_section.pop(key, None) if isinstance(zero_section, dict) else None
        if top is not None and nested is not None and top != nested:
            raise ZeroBnbConfigError(
                f"{key} is set twice with different values: {top!r} at the top level and {nested!r} inside "
                f"zero_optimization; keep one of them"
            )
        value = top if top is not None else nested
        if value is not None:
            found[key] = value

    keys = found.get(UNSHARDED_KEYS)
    if keys is not None:
        if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
            raise ZeroBnbConfigError(
                f"{UNSHARDED_KEYS} must be a list of state-key names such as [\"qmap1\", \"qmap2\"], got {keys!r}"
            )
        keys = tuple(keys)
    optional = {
        field: found[key]
        for field, key in (("nonfinite_check", NONFINITE_CHECK), ("checkpoint_verify", CHECKPOINT_VERIFY),
                           ("derived_module_weights", DERIVED_MODULE_WEIGHTS), ("cpu_update", CPU_UPDATE),
                           ("gpu_update", GPU_UPDATE),
                           ("update_max_numel", UPDATE_MAX_NUMEL), ("checkpoint_async", CHECKPOINT_ASYNC),
                           ("checkpoint_async_max_staging_mb", CHECKPOINT_ASYNC_MAX_STAGING_MB))
        if key in found
    }
    parsed = ZeroBnbConfig(
        unsharded_state_keys=keys, unsharded_state_max_numel=found.get(UNSHARDED_MAX_NUMEL), **optional
    )
    return parsed, cleaned


def refuse_unknown_keys(ds_config: Mapping[str, Any]) -> None:
    """Refuse top-level keys that look like ``zero_*`` (in any case, with hyphens or surrounding spaces) and are
    neither zero_bnb's (:data:`OWN_KEYS`) nor DeepSpeed's (:data:`DEEPSPEED_ZERO_KEYS`), naming the closest known key,
    or ``zero_optimization`` for one of its own fields put at the top level. Local, pure.

    DeepSpeed ignores unknown top-level keys (its validator checks only inside its sections), so
    ``"zero_checkpoint_asynch": true`` would leave saves synchronous without a word.

    Raises:
        ZeroBnbConfigError: naming each unknown key, its closest known key and the known keys.
    """
    known = (*OWN_KEYS, *DEEPSPEED_ZERO_KEYS)
    unknown = sorted((key for key in ds_config if isinstance(key, str) and key not in known
                      and _normalized(key).startswith("zero_")), key=str)
    if not unknown:
        return
    guesses = []
    for key in unknown:
        if _normalized(key) in ZERO_SECTION_KEYS:
            field = ZERO_SECTION_KEYS[_normalized(key)]
            guesses.append(f"{key!r} (a zero_optimization field: put it there as \"{field}\")")
            continue
        close = difflib.get_close_matches(_normalized(key), known, n=1, cutoff=0.6)
        guesses.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise ZeroBnbConfigError(
        f"unknown top-level key{'s' if len(unknown) > 1 else ''} in the DeepSpeed config: {', '.join(guesses)}. zero_bnb "
        f"reads the top-level keys that start with zero_ and DeepSpeed would silently ignore a misspelt one; the known "
        f"keys are zero_bnb's {', '.join(OWN_KEYS)} and DeepSpeed's {', '.join(DEEPSPEED_ZERO_KEYS)}. Correct or "
        f"remove the key"
    )


def _normalized(key: str) -> str:
    """``key`` as a config key it may be a misspelling of: lower case, hyphens as underscores, no surrounding space."""
    return key.strip().lower().replace("-", "_")


def refuse_optimizer_section(ds_config: Mapping[str, Any], client_optimizer: Any) -> None:
    """Refuse a DeepSpeed ``"optimizer"`` section that would replace or shadow the bitsandbytes optimizer.

    With a client optimizer DeepSpeed silently ignores the section; without one it builds its own
    optimizer from it (FusedAdam for ``"type": "Adam"``/``"AdamW"``) and transformers' ``Trainer``
    ignores ``TrainingArguments.optim``. ``"params": {"torch_adam": true}`` (which builds
    ``torch.optim.Adam``/``AdamW``, a family zero_bnb declares) is allowed without a client optimizer.

    Raises:
        ZeroBnbConfigError: naming the section and the fix.
    """
    section = ds_config.get("optimizer")
    if not section:
        return
    shown = json.dumps(section, default=str)
    if client_optimizer is not None:
        name = f"{type(client_optimizer).__module__}.{type(client_optimizer).__qualname__}"
        raise ZeroBnbConfigError(
            f"the DeepSpeed config has an \"optimizer\" section ({shown}) and a client optimizer ({name}) was passed: "
            f"DeepSpeed would train with the client optimizer and silently ignore the section. Remove the \"optimizer\" "
            f"section from the DeepSpeed config (set lr, betas, weight decay on the optimizer itself)"
        )
    params = section.get("params", {}) if isinstance(section, Mapping) else {}
    if isinstance(params, Mapping) and params.get("torch_adam") is True:
        return
    raise ZeroBnbConfigError(
        f"the DeepSpeed config has an \"optimizer\" section ({shown}): DeepSpeed builds its own optimizer from it "
        f"(FusedAdam for Adam/AdamW), not a bitsandbytes one, and transformers' Trainer then ignores "
        f"TrainingArguments.optim (e.g. optim=\"adamw_bnb_8bit\"). Remove the \"optimizer\" section from the "
        f"DeepSpeed config (ds.json): Trainer then builds the optimizer named by optim=; with Accelerate or your own "
        f"loop pass a bitsandbytes optimizer, e.g. optimizer=bnb.optim.AdamW8bit(model.parameters(), lr=...)"
    )


def _offload_section(zero: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    section = zero.get(key)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ZeroBnbConfigError(
            f"zero_optimization.{key} must be an object such as {{\"device\": \"cpu\", \"pin_memory\": true}}, "
            f"got {section!r}"
        )
    return section


def prepare_offload(ds_config: dict[str, Any], client_optimizer: Any) -> bool:
    """Accept ``zero_optimization.offload_optimizer: {"device": "cpu"}`` for a client optimizer; refuse the rest.

    At ZeRO stages 1 and 2 DeepSpeed keeps each rank's fp32 partition and the base optimizer's
    state in CPU memory and steps the base optimizer there; a bitsandbytes optimizer then keeps
    its 8-bit state on the CPU. DeepSpeed refuses a client optimizer under offload unless
    ``zero_force_ds_cpu_optimizer`` is false (its default, true, asks for its own
    ``DeepSpeedCPUAdam``), so this sets it to false, as ``zero_allow_untested_optimizer`` is set
    for client optimizers. Settings DeepSpeed cannot honour at stages 1 and 2 are refused:
    ``device: "nvme"`` (DeepSpeed then skips the optimizer state on load), a partial ``ratio``,
    ``super_offload`` and ``offload_param`` (ZeRO-3 features it would ignore), and an explicit
    ``zero_force_ds_cpu_optimizer: true`` next to an optimizer zero_bnb declares. At stage 3 DeepSpeed honours
    ``offload_param`` too; :func:`zero_bnb.ds.stage3.refuse_stage3_settings` decides what is refused there
    (before this runs). Local, pure.

    Args:
        ds_config: the DeepSpeed config (zero_bnb's keys removed); changed in place.
        client_optimizer: the optimizer passed to ``initialize`` (``None``: DeepSpeed builds one; under offload
            an optimizer zero_bnb does not declare is refused here, by :func:`~zero_bnb.core.state_spec.spec_for`,
            before DeepSpeed would ask for ``zero_force_ds_cpu_optimizer: false``; an optimizer factory, a
            callable DeepSpeed calls with the parameters, is checked once DeepSpeed has built the optimizer).

    Returns:
        Whether the optimizer state is offloaded to the CPU.

    Raises:
        ZeroBnbConfigError: naming the setting, its value and the alternative.
        UnsupportedOptimizerError: the state is offloaded and ``client_optimizer`` is not declared.
    """
    zero = ds_config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        return False
    param = _offload_section(zero, "offload_param")
    stage3 = zero.get("stage") == 3  # zero_bnb.ds.stage3.refuse_stage3_settings decides stage 3's offload settings
    if param is not None and str(param.get("device", "none")) != "none" and not stage3:
        raise ZeroBnbConfigError(
            f"zero_optimization.offload_param.device={param.get('device')!r} offloads parameters, a ZeRO stage 3 "
            f"feature that DeepSpeed ignores at stages 1 and 2 (zero_bnb's stages); remove offload_param. "
            f"zero_optimization.offload_optimizer: {{\"device\": \"cpu\"}} moves the optimizer state and step to the CPU"
        )
    section = _offload_section(zero, "offload_optimizer")
    device = str(section.get("device", "none")) if section is not None else "none"
    if section is None and zero.get("cpu_offload") is True:  # DeepSpeed's deprecated spelling of device "cpu"
        device = "cpu"
    if device == "none":
        return False
    if device == "nvme":
        raise ZeroBnbConfigError(
            "zero_optimization.offload_optimizer.device=\"nvme\" is ZeRO-Infinity's NVMe offload (ZeRO stage 3); at "
            "stages 1 and 2 DeepSpeed keeps the state in CPU memory anyway and skips the optimizer state when it loads "
            "a checkpoint. Set \"device\": \"cpu\" (with zero_bnb the 8-bit state takes a quarter of fp32 Adam's "
            "CPU memory)"
        )
    if device != "cpu":
        raise ZeroBnbConfigError(
            f"zero_optimization.offload_optimizer.device must be \"cpu\" or \"none\" with zero_bnb, got {device!r}"
        )
    section = section or {}
    ratio = section.get("ratio", 1.0)
    if ratio != 1.0:
        raise ZeroBnbConfigError(
            f"zero_optimization.offload_optimizer.ratio={ratio!r} asks for partial offload, a ZeRO stage 3 feature "
            f"that DeepSpeed ignores at stages 1 and 2 (everything is offloaded); remove ratio"
        )
    if section.get("super_offload"):
        raise ZeroBnbConfigError(
            "zero_optimization.offload_optimizer.super_offload=true is a ZeRO stage 3 feature that DeepSpeed ignores "
            "at stages 1 and 2; remove it"
        )
    if isinstance(client_optimizer, torch.optim.Optimizer) and not declared(client_optimizer):
        spec_for(client_optimizer)  # refused here, naming what zero_bnb supports, before DeepSpeed's own message
    # An optimizer factory (a callable DeepSpeed calls with the parameters) is checked once DeepSpeed has built it.
    if client_optimizer is not None:
        if ds_config.get(FORCE_DS_CPU_OPTIMIZER, False) is not False:
            name = f"{type(client_optimizer).__module__}.{type(client_optimizer).__qualname__}"
            raise ZeroBnbConfigError(
                f"the config sets {FORCE_DS_CPU_OPTIMIZER}={ds_config[FORCE_DS_CPU_OPTIMIZER]!r}, which makes DeepSpeed "
                f"refuse the client optimizer ({name}) under optimizer offload and ask for its own fp32 "
                f"DeepSpeedCPUAdam; remove the key (zero_bnb sets it to false so that your optimizer steps the "
                f"offloaded partitions)"
            )
        ds_config[FORCE_DS_CPU_OPTIMIZER] = False
    return True
