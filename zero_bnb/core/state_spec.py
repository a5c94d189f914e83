"""What each optimizer-state tensor is, and therefore how it moves between DP sizes.

An optimizer is supported by *declaring* its state keys (:class:`OptimizerSpec`), not by
special cases in the checkpoint code. :func:`classify_state` then applies the user's
``zero_unsharded_state_keys`` / ``zero_unsharded_state_max_numel`` rules on top of the
declaration. Pure Python: no DeepSpeed, no collectives.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = [
    "BNB_KERNEL_MAX_NUMEL",
    "Classification",
    "ClassifiedBy",
    "OptimizerSpec",
    "QuantizedTriple",
    "StateKind",
    "StateRule",
    "UNIVERSAL_TARGETS",
    "UnsupportedOptimizerError",
    "classify_state",
    "declared",
    "family_of",
    "param_in_group",
    "spec_for",
    "spec_for_class",
    "spec_named",
]


class StateKind(str, enum.Enum):
    """How one state entry of a flat partition is saved and re-split (docs/design.md, "The problem")."""

    #: identical on every rank (``qmap1``); saved once, loaded whole everywhere
    REPLICATED = "replicated"
    #: one value per element of the partition (``state1``, ``exp_avg``); merged in flat order
    ELEMENTWISE = "elementwise"
    #: one value per quantization block (``absmax1``); merged on the global block grid
    BLOCKWISE = "blockwise"
    #: one value per partition (``unorm_vec``); cannot be merged exactly, so refused
    PARTITION_SCALAR = "partition_scalar"
    #: a scalar identical on every rank (``step``); restored exactly
    COUNTER = "counter"


class UnsupportedOptimizerError(ValueError):
    """The optimizer (or one of its settings) cannot be checkpointed elastically."""


@dataclass(frozen=True, slots=True)
class QuantizedTriple:
    """An 8-bit state: its codes (element-wise), per-block scales and quantization map."""

    codes: str
    absmax: str
    qmap: str


def _no_check(optimizer: torch.optim.Optimizer) -> None:
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """Declared state layout of one optimizer family.

    Attributes:
        name: short name used in logs and manifests.
        matches: tells whether an optimizer instance belongs to this family.
        kinds: the kind of every state key the optimizer may create.
        quantized: the 8-bit states, so that they can be converted to and from fp32 when a
            new partition size crosses bitsandbytes' ``min_8bit_size``.
        block_size: quantization block size; partitions start on multiples of it. 1 for
            optimizers without block-wise state.
        replicated_by_default: keys to keep whole when the user sets no
            ``zero_unsharded_state_keys`` (the quantization maps).
        check: raises :class:`UnsupportedOptimizerError` for settings that create state
            which cannot be restored at another DP size.
        init_state: creates the empty state of the flat partition parameter exactly as the
            optimizer's own first ``step()`` would (``None``: the loader builds it from the
            checkpoint's dtypes). Called as ``init_state(optimizer, group_index, param)``.
        moment_names: state key -> the name DeepSpeed's universal checkpoint (and
            ``torch.optim.Adam``) gives the same quantity, e.g. ``state1`` -> ``exp_avg``.
        layout_hyperparameters: param-group keys that decide which state keys exist (such as
            ``amsgrad``); a checkpoint must match them, checked before anything is loaded.
        bitsandbytes: the family is bitsandbytes' (chunked updates, per-parameter overrides).
    """

    name: str
    matches: Callable[[torch.optim.Optimizer], bool]
    kinds: Mapping[str, StateKind]
    quantized: tuple[QuantizedTriple, ...] = ()
    block_size: int = 1
    replicated_by_default: tuple[str, ...] = ()
    check: Callable[[torch.optim.Optimizer], None] = _no_check
    init_state: Callable[[torch.optim.Optimizer, int, torch.Tensor], None] | None = None
    moment_names: Mapping[str, str] = field(default_factory=dict)
    layout_hyperparameters: tuple[str, ...] = ()
    #: a bitsandbytes optimizer: steps through ``update_step`` (chunked above 2^31 elements) and
    #: honours ``GlobalOptimManager`` overrides.
    bitsandbytes: bool = False
    #: class names in ``bitsandbytes.optim`` (or ``torch.optim``) of this family, for tools told a name.
    classes: tuple[str, ...] = ()

    def triple_for(self, key: str) -> QuantizedTriple | None:
        """The 8-bit triple in which ``key`` is the codes, absmax or map, if any."""
        for triple in self.quantized:
            if key in (triple.codes, triple.absmax, triple.qmap):
                return triple
        return None

    def same_quantized_state(self) -> dict[str, frozenset[str]]:
        """Per codes or absmax key of an 8-bit triple, the other one: both hold one moment (a NaN scale makes NaN
        values, whichever of them a check looks at)."""
        return {key: frozenset((t.codes, t.absmax)) - {key} for t in self.quantized for key in (t.codes, t.absmax)}


@dataclass(frozen=True, slots=True)
class StateRule:
    """The user's replication rules (``zero_unsharded_state_keys`` and the size threshold)."""

    unsharded_keys: frozenset[str] = field(default_factory=frozenset)
    max_numel: int | None = None


class ClassifiedBy(str, enum.Enum):
    """Which rule gave a state entry its kind (errors choose their fix by it)."""

    NAMED = "zero_unsharded_state_keys"
    THRESHOLD = "zero_unsharded_state_max_numel"
    DECLARED = "declaration"
    UNDECLARED = "shape"


class Classification(NamedTuple):
    """The kind of one state entry, the rule that decided it, and a readable reason."""

    kind: StateKind
    by: ClassifiedBy
    reason: str


def classify_state(
    key: str,
    value: Any,
    *,
    spec: OptimizerSpec,
    rule: StateRule,
    partition_numel: int,
) -> Classification:
    """Kind of one state entry of a flat partition, and why (for the manifest and errors).

    Exact names in ``zero_unsharded_state_keys`` win, then the size threshold, then the
    optimizer's declaration; an undeclared tensor is element-wise only if it has one value
    per partition element, and an undeclared non-tensor is a counter.

    Raises:
        UnsupportedOptimizerError: the entry is an undeclared tensor whose shape does not
            tell its kind.
    """
    if key in rule.unsharded_keys:
        return Classification(StateKind.REPLICATED, ClassifiedBy.NAMED, "listed in zero_unsharded_state_keys")
    is_tensor = isinstance(value, torch.Tensor)
    if is_tensor and rule.max_numel is not None and value.numel() <= rule.max_numel:
        return Classification(StateKind.REPLICATED, ClassifiedBy.THRESHOLD,
                              f"{value.numel()} elements <= zero_unsharded_state_max_numel={rule.max_numel}")
    if key in spec.kinds:
        return Classification(spec.kinds[key], ClassifiedBy.DECLARED, f"declared by {spec.name}")
    if not is_tensor or value.dim() == 0:
        return Classification(StateKind.COUNTER, ClassifiedBy.UNDECLARED, "undeclared scalar")
    if value.numel() == partition_numel:
        return Classification(StateKind.ELEMENTWISE, ClassifiedBy.UNDECLARED,
                              "undeclared, one value per partition element")
    raise UnsupportedOptimizerError(
        f"optimizer state key {key!r} (shape {tuple(value.shape)}, dtype {value.dtype}) is not declared by "
        f"{spec.name} and its size does not match the partition ({partition_numel} elements), so zero_bnb cannot "
        f"tell how to split it. If it is identical on every rank, list it in zero_unsharded_state_keys; "
        f"otherwise declare it in an OptimizerSpec."
    )


# --------------------------------------------------------------------------- declarations


def _bnb_family(base_class: str, optimizer_name: str) -> Callable[[torch.optim.Optimizer], bool]:
    """Matches bitsandbytes optimizers built on ``base_class`` with this ``optimizer_name``."""

    def matches(optimizer: torch.optim.Optimizer) -> bool:
        from bitsandbytes.optim import optimizer as bnb_optimizer

        return (isinstance(optimizer, getattr(bnb_optimizer, base_class))
                and getattr(optimizer, "optimizer_name", None) == optimizer_name)

    return matches


def _check_bnb(optimizer: torch.optim.Optimizer) -> None:
    args = getattr(optimizer, "args", None)
    name = type(optimizer).__name__
    max_unorm = getattr(args, "max_unorm", 0.0)
    if max_unorm and max_unorm > 0.0:
        raise UnsupportedOptimizerError(
            f"{name} was built with max_unorm={max_unorm}: its per-partition update norm "
            f"(unorm_vec) is computed over one rank's partition and cannot be restored at another DP size. "
            f"Build the optimizer with max_unorm=0.0."
        )


def _check_ademamix(optimizer: torch.optim.Optimizer) -> None:
    """bitsandbytes 0.50's ``AdEMAMix32bit``/``PagedAdEMAMix32bit`` derive from ``Optimizer2State``, not
    ``AdEMAMix``, so they allocate one moment where the update needs two (a ``(2, n)`` ``state1``): refused."""
    from bitsandbytes.optim import optimizer as bnb_optimizer

    _check_bnb(optimizer)
    if type(optimizer).init_state is bnb_optimizer.Optimizer2State.init_state:
        name = type(optimizer).__name__
        raise UnsupportedOptimizerError(
            f"bitsandbytes' {name} allocates one moment where AdEMAMix's update needs two (it does not use "
            f"AdEMAMix.init_state), so its step fails (on CPU: 'output with shape [] doesn't match the broadcast "
            f"shape') or reads past its state. Build bitsandbytes.optim.AdEMAMix(params, optim_bits=32"
            f"{', is_paged=True' if 'Paged' in name else ''}) instead: the same optimizer with its state laid out "
            f"right (Trainer's optim=\"ademamix\" does)"
        )


@contextmanager
def param_in_group(optimizer: torch.optim.Optimizer, group_index: int, param: torch.Tensor) -> Iterator[None]:
    """Make ``param`` the first parameter of param group ``group_index`` for the duration of a ``with`` block.

    bitsandbytes looks a parameter's config up by its place in the group; ZeRO stage 3 fills a group's
    ``params`` only while it steps one sub-group. At stages 1/2 the flat partition is already first: no change.
    """
    group = optimizer.param_groups[group_index]
    params = group["params"]
    if params and params[0] is param:
        yield
        return
    group["params"] = [param]
    try:
        yield
    finally:
        group["params"] = params


def _init_bnb_state(optimizer: torch.optim.Optimizer, group_index: int, param: torch.Tensor) -> None:
    with param_in_group(optimizer, group_index, param):
        optimizer.init_state(optimizer.param_groups[group_index], param, group_index, 0)


BNB_BLOCK_SIZE = 256
#: Largest element count bitsandbytes' update kernels take (a signed 32-bit int); larger partitions are updated in
#: pieces (:mod:`zero_bnb.bnb.chunked`).
BNB_KERNEL_MAX_NUMEL = 2**31 - 1
#: bitsandbytes optimizers an fp32 Adam (DeepSpeed universal) checkpoint converts to.
UNIVERSAL_TARGETS = ("AdamW8bit", "Adam8bit")

_BNB_2STATE_KINDS = {
    "step": StateKind.COUNTER,
    "state1": StateKind.ELEMENTWISE,
    "state2": StateKind.ELEMENTWISE,
    "absmax1": StateKind.BLOCKWISE,
    "absmax2": StateKind.BLOCKWISE,
    "qmap1": StateKind.REPLICATED,
    "qmap2": StateKind.REPLICATED,
    "unorm_vec": StateKind.PARTITION_SCALAR,
}
_BNB_1STATE_KINDS = {key: kind for key, kind in _BNB_2STATE_KINDS.items() if not key.endswith("2")}
_TRIPLE_1 = QuantizedTriple("state1", "absmax1", "qmap1")

def _bnb_spec(**declaration: Any) -> OptimizerSpec:
    """A bitsandbytes family: 256-element blocks, its own state initialisation and settings check."""
    return OptimizerSpec(block_size=BNB_BLOCK_SIZE, check=_check_bnb, init_state=_init_bnb_state, bitsandbytes=True,
                         **declaration)


BNB_ADAM = _bnb_spec(
    name="bitsandbytes Adam (Adam8bit, AdamW8bit, Adam32bit, AdamW32bit)",
    matches=_bnb_family("Optimizer2State", "adam"),
    kinds=_BNB_2STATE_KINDS,
    quantized=(_TRIPLE_1, QuantizedTriple("state2", "absmax2", "qmap2")),
    replicated_by_default=("qmap1", "qmap2"),
    moment_names={"state1": "exp_avg", "state2": "exp_avg_sq"},
    classes=("Adam", "AdamW", "Adam8bit", "AdamW8bit", "Adam32bit", "AdamW32bit", "PagedAdam", "PagedAdamW",
             "PagedAdam8bit", "PagedAdamW8bit", "PagedAdam32bit", "PagedAdamW32bit"),
)


def _bnb_one_state(optimizer_name: str, classes: str, moment: str, class_names: tuple[str, ...]) -> OptimizerSpec:
    """A bitsandbytes ``Optimizer1State`` family: ``state1`` (8-bit or fp32) and ``step``."""
    return _bnb_spec(
        name=f"bitsandbytes {classes}",
        classes=class_names,
        matches=_bnb_family("Optimizer1State", optimizer_name),
        kinds=_BNB_1STATE_KINDS,
        quantized=(_TRIPLE_1,),
        replicated_by_default=("qmap1",),
        moment_names={"state1": moment},
    )


BNB_ADEMAMIX = OptimizerSpec(
    block_size=BNB_BLOCK_SIZE, check=_check_ademamix, init_state=_init_bnb_state, bitsandbytes=True,
    name="bitsandbytes AdEMAMix (AdEMAMix8bit, AdEMAMix with optim_bits=32)",
    matches=_bnb_family("Optimizer2State", "ademamix"),
    kinds=_BNB_2STATE_KINDS,  # state1 is (2, partition): the fast and slow moments, split on the last axis
    quantized=BNB_ADAM.quantized,
    replicated_by_default=("qmap1", "qmap2"),
    moment_names={"state1": "exp_avg_fast_slow", "state2": "exp_avg_sq"},
    classes=("AdEMAMix", "AdEMAMix8bit", "AdEMAMix32bit", "PagedAdEMAMix", "PagedAdEMAMix8bit", "PagedAdEMAMix32bit"),
)

BNB_LION = _bnb_one_state("lion", "Lion (Lion8bit, Lion32bit)", "exp_avg",
                          ("Lion", "Lion8bit", "Lion32bit", "PagedLion", "PagedLion8bit", "PagedLion32bit"))
BNB_SGD = _bnb_one_state("momentum", "SGD with momentum (SGD8bit, SGD32bit)", "momentum_buffer",
                         ("SGD", "SGD8bit", "SGD32bit"))
BNB_RMSPROP = _bnb_one_state("rmsprop", "RMSprop (RMSprop8bit, RMSprop32bit)", "square_avg",
                             ("RMSprop", "RMSprop8bit", "RMSprop32bit"))
BNB_ADAGRAD = _bnb_one_state("adagrad", "Adagrad (Adagrad8bit, Adagrad32bit)", "sum",
                             ("Adagrad", "Adagrad8bit", "Adagrad32bit"))

TORCH_ADAM = OptimizerSpec(
    name="torch.optim Adam/AdamW",
    matches=lambda optimizer: type(optimizer) in (torch.optim.Adam, torch.optim.AdamW),
    kinds={
        "step": StateKind.COUNTER,
        "exp_avg": StateKind.ELEMENTWISE,
        "exp_avg_sq": StateKind.ELEMENTWISE,
        "max_exp_avg_sq": StateKind.ELEMENTWISE,
    },
    moment_names={"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    layout_hyperparameters=("amsgrad",),
)

#: Every supported family, most specific first.
SPECS: tuple[OptimizerSpec, ...] = (BNB_ADAM, BNB_ADEMAMIX, BNB_LION, BNB_SGD, BNB_RMSPROP, BNB_ADAGRAD, TORCH_ADAM)


def spec_for_class(class_name: str) -> OptimizerSpec:
    """The bitsandbytes family that ``bitsandbytes.optim.<class_name>`` belongs to (for tools told a name).

    Raises:
        UnsupportedOptimizerError: no bitsandbytes family declares that class; lists those that do.
    """
    for spec in SPECS:
        if spec.bitsandbytes and class_name in spec.classes:
            return spec
    known = sorted(name for spec in SPECS if spec.bitsandbytes for name in spec.classes if "8bit" in name)
    raise UnsupportedOptimizerError(
        f"no bitsandbytes optimizer family zero_bnb declares has a class {class_name!r}; name one of {known}"
    )


def spec_named(name: str) -> OptimizerSpec:
    """The spec whose :attr:`OptimizerSpec.name` is ``name`` (as recorded in a manifest).

    Raises:
        UnsupportedOptimizerError: no such spec in this zero_bnb version.
    """
    for spec in SPECS:
        if spec.name == name:
            return spec
    raise UnsupportedOptimizerError(
        f"the checkpoint was written for optimizer family {name!r}, which this zero_bnb does not know "
        f"(it knows {[spec.name for spec in SPECS]}); use the zero_bnb release that wrote it"
    )


def declared(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` belongs to a family zero_bnb declares (whatever its settings)."""
    return family_of(optimizer) is not None


def family_of(optimizer: Any) -> OptimizerSpec | None:
    """The declared family of ``optimizer`` without checking its settings (``None``: undeclared)."""
    return next((spec for spec in SPECS if spec.matches(optimizer)), None)


def spec_for(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """The declared spec of ``optimizer``, after checking its settings.

    Raises:
        UnsupportedOptimizerError: no spec matches, or a setting cannot be restored elastically.
    """
    spec = family_of(optimizer)
    if spec is not None:
        spec.check(optimizer)
        return spec
    supported = "; ".join(spec.name for spec in SPECS)
    raise UnsupportedOptimizerError(
        f"zero_bnb has no state declaration for {type(optimizer).__module__}.{type(optimizer).__qualname__}. "
        f"Supported: {supported}. Use one of those, or pass the optimizer to deepspeed.initialize directly "
        f"(its checkpoints then load only at the DP size they were saved at)."
    )
