"""How a checkpoint stores the fp32 master weights: whole, or derived from DeepSpeed's module weights.

DeepSpeed's model file already holds every trained module weight, and DeepSpeed makes it from the
master weight (``bit16.copy_(fp32)``): in fp32 training it *is* the master, in bf16 training it is
the master rounded to nearest even. So a group's masters are stored one of three ways (the
manifest's ``GroupEntry.masters``):

* :data:`FULL` (``"fp32"``): the shard holds the fp32 masters (fp16 training, and any group whose
  module weights are not the masters' rounding when the checkpoint is saved);
* :data:`MODULE` (``"module"``): fp32 training; the masters are the module weights of the model file;
* :data:`MODULE_LOW16` (``"module+low16"``): bf16 training; the shard holds each master's bottom
  16 bits and a short exception list (:mod:`zero_bnb.core.residual`), the model file the rest.

A derived shard group records a digest of the module weights it was split against, per parameter
(``module_blake3``, or ``module_sha256``: :mod:`zero_bnb.format.digests`), so a model file edited or
replaced after the save is named, never combined into wrong masters. Local functions, no collectives.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zero_bnb.core.residual import Residual, join_bf16, split_bf16
from zero_bnb.errors import CheckpointFormatError
from zero_bnb.format import digests as _digests

__all__ = ["FULL", "MODULE", "MODULE_BYTES", "MODULE_LOW16", "SHARD_BYTES", "STORAGES", "DerivedMasters", "casts_like_masters",
           "check_module", "derive", "derived_problems", "module_dtype", "module_slice", "piece_digest", "piece_digests", "rebuild",
           "rebuild_into"]

FULL = "fp32"
MODULE = "module"
MODULE_LOW16 = "module+low16"
#: Every way a group's masters may be stored.
STORAGES = (FULL, MODULE, MODULE_LOW16)
#: Bytes per element each storage needs at least in the shards, and in the model file.
SHARD_BYTES = {FULL: 4, MODULE: 0, MODULE_LOW16: 2}
MODULE_BYTES = {FULL: 0, MODULE: 4, MODULE_LOW16: 2}
_MODULE_DTYPES = {MODULE: torch.float32, MODULE_LOW16: torch.bfloat16}
_LOW, _INDEX, _VALUE = "low16", "exception_index", "exception_value"
#: The key of a derived group's piece digests, by algorithm.
_DIGEST_KEYS = {f"module_{algorithm}": algorithm for algorithm in _digests.ALGORITHMS}


def module_dtype(storage: str) -> torch.dtype | None:
    """The dtype the module weights must have for ``storage`` (``None`` for :data:`FULL`)."""
    return _MODULE_DTYPES.get(storage)


@dataclass(frozen=True, slots=True)
class DerivedMasters:
    """The master-weight part of one shard group stored as :data:`MODULE` or :data:`MODULE_LOW16`.

    ``digests`` maps each parameter overlapping the shard's range to the ``algorithm`` digest of its
    module weights there; ``residual`` is ``None`` for :data:`MODULE`.
    """

    digests: Mapping[str, str]
    residual: Residual | None = None
    algorithm: str = _digests.SHA256

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {f"module_{self.algorithm}": dict(self.digests)}
        if self.residual is not None:
            data.update({_LOW: self.residual.low, _INDEX: self.residual.index, _VALUE: self.residual.value})
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DerivedMasters:
        """The entry :meth:`to_dict` made (checked by :func:`derived_problems`: one digest key)."""
        key = next(key for key in _DIGEST_KEYS if key in data)
        residual = Residual(data[_LOW], data[_INDEX], data[_VALUE]) if _LOW in data else None
        return cls(dict(data[key]), residual, _DIGEST_KEYS[key])

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (the residual and its exceptions)."""
        r = self.residual
        return 0 if r is None else r.low.nbytes + r.index.nbytes + r.value.nbytes


def _overlaps(params, start: int, end: int) -> Iterator[tuple[Any, int, int]]:
    """Each parameter (``ParamEntry``) overlapping the global range ``[start, end)``, with its overlap ``[lo, hi)``."""
    for param in params:
        lo, hi = max(start, param.offset), min(end, param.offset + param.numel)
        if lo < hi:
            yield param, lo, hi


def _pieces(params, tensors: Mapping[str, torch.Tensor], start: int, end: int) -> Iterator[tuple[str, torch.Tensor]]:
    for param, lo, hi in _overlaps(params, start, end):
        yield param.name, tensors[param.name].detach().reshape(-1)[lo - param.offset : hi - param.offset]


def piece_digest(piece: torch.Tensor, algorithm: str | None = None, *, what: str = "this checkpoint") -> str:
    """The ``algorithm`` digest (hex; by default the one this process writes,
    :func:`~zero_bnb.format.digests.writing_algorithm`) of a module-weight piece's bytes, as a derived shard group
    records it; ``what`` names the file that records it in an error (a missing ``blake3`` package)."""
    algorithm = algorithm or _digests.writing_algorithm()
    return _digests.hexdigest(algorithm, piece.to("cpu").contiguous().view(torch.uint8).numpy(), what=what)


def module_slice(params, tensors: Mapping[str, torch.Tensor], start: int, end: int) -> torch.Tensor:
    """The global element range ``[start, end)`` of a flat group whose parameters (``ParamEntry``, in flat
    order) have module weights ``tensors`` (name -> tensor), as one 1-D tensor: a view where the pieces lie back
    to back in one storage (DeepSpeed's flat 16-bit groups, on the device or in the model file it saves them
    into), on the pieces' device; else a new CPU tensor; of the weights' dtype even when the range is empty (a
    rank may own no element of a small group). Read it, never write it."""
    pieces = [piece for _, piece in _pieces(params, tensors, start, end)]
    span = _span(pieces)
    if span is not None:
        return span
    if not pieces:
        return torch.empty(0, dtype=next((tensors[p.name].dtype for p in params if p.name in tensors), torch.float32))
    return torch.cat([piece.to("cpu") for piece in pieces])


def _span(pieces: list[torch.Tensor]) -> torch.Tensor | None:
    """One view of ``pieces`` (1-D) if each starts where the previous one ends in the same storage (a device's
    too: one copy of the view then moves the whole range, instead of a copy per piece)."""
    if not pieces:
        return None
    first = pieces[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for piece in pieces:
        if (piece.device != first.device or piece.dtype != first.dtype or piece.stride() != (1,)
                or piece.untyped_storage().data_ptr() != storage or piece.storage_offset() != offset):
            return None
        offset += piece.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,))


def piece_digests(params, weight: torch.Tensor, start: int, end: int) -> dict[str, str]:
    """:func:`piece_digest` of each parameter's piece of ``weight`` (:func:`module_slice` of the range ``[start, end)``),
    by name: what a derived shard group records."""
    return {p.name: piece_digest(weight[lo - start : hi - start]) for p, lo, hi in _overlaps(params, start, end)}


def derive(storage: str, master: torch.Tensor, weight: torch.Tensor, params, start: int, end: int, *,
           residual: Residual | None = None, digests: Mapping[str, str] | None = None) -> DerivedMasters:
    """What a shard stores for the masters ``master`` (1-D fp32, CPU, the range ``[start, end)``) of a group
    stored as ``storage`` (:data:`MODULE` or :data:`MODULE_LOW16`), beside its module weights ``weight``
    (:func:`module_slice` of them: each parameter's piece is hashed from it, no second copy). The caller has
    checked that the weights are the masters' rounding (``core.residual.rounds_to``), and may pass what it made
    meanwhile: the :data:`MODULE_LOW16` ``residual`` (``core.residual.split_rounded_bf16``) and the
    :func:`piece_digests`; what it does not pass is made here."""
    algorithm = _digests.writing_algorithm()  # what piece_digests used, made here or by the caller
    digests = piece_digests(params, weight, start, end) if digests is None else dict(digests)
    if storage == MODULE:
        return DerivedMasters(digests, algorithm=algorithm)
    return DerivedMasters(digests, split_bf16(master, weight) if residual is None else residual, algorithm)


def check_module(storage: str, derived: DerivedMasters, params, module: Mapping[str, Any], start: int, end: int, *,
                 model_file: str, shard_file: str) -> list:
    """Check that the model file's ``module`` dict holds, for the range ``[start, end)``, the module weights a shard
    group stored as ``storage`` was saved against (dtype, shape, digest of each piece); returns the parameters
    (``ParamEntry``) overlapping the range. The pieces are hashed even where the whole model file was verified: the
    manifest records what the save wrote, but a manifest can be re-signed with the edited file's digest (its
    ``module_digest`` too); the per-piece digests in the shard are what binds the masters to the weights.

    Raises:
        CheckpointFormatError: a module weight is missing or has another shape or dtype.
            Also: a module weight differs from the one the shard was saved against (the model file was
            edited or replaced after the save), naming the parameters; or the digests are BLAKE3 and the
            ``blake3`` package is not installed.
    """
    dtype = module_dtype(storage)
    overlapping = [p for p, _, _ in _overlaps(params, start, end)]
    wrong = [f"{p.name}: {_describe(module.get(p.name))}" for p in overlapping
             if not (isinstance(module.get(p.name), torch.Tensor) and module[p.name].dtype == dtype
                     and tuple(module[p.name].shape) == tuple(p.shape))]
    if wrong:
        raise CheckpointFormatError(
            f"{model_file}: the master weights of this checkpoint are derived from its module weights, which must be "
            f"{str(dtype).removeprefix('torch.')} tensors of the saved shapes, but {wrong[:5]}; the model file was "
            f"edited or replaced after the save. Restore it, or load an earlier tag"
        )
    changed = [name for name, piece in _pieces(overlapping, module, start, end)
               if derived.digests.get(name) != piece_digest(piece, derived.algorithm, what=shard_file)]
    if changed or set(derived.digests) != {p.name for p in overlapping}:
        raise CheckpointFormatError(
            f"{model_file}: the module weights of {(changed or sorted(derived.digests))[:5]} are not the ones the "
            f"master weights in {shard_file} were saved against ({derived.algorithm} differs); the model file was "
            f"edited or replaced after the save, so the masters cannot be rebuilt. Restore the original model file, "
            f"or load an earlier tag"
        )
    return overlapping


def rebuild(storage: str, derived: DerivedMasters, params, module: Mapping[str, Any], start: int, end: int, *,
            model_file: str, shard_file: str) -> torch.Tensor:
    """The fp32 masters of the range ``[start, end)`` from the model file's ``module`` dict and ``derived``,
    after :func:`check_module` (which raises what this raises); fp32 ones are the module weights themselves (a view
    where they lie back to back: :func:`module_slice`)."""
    overlapping = check_module(storage, derived, params, module, start, end, model_file=model_file,
                               shard_file=shard_file)
    weight = module_slice(overlapping, module, start, end)
    return weight if storage == MODULE else join_bf16(weight, derived.residual)


def rebuild_into(storage: str, derived: DerivedMasters, params, module: Mapping[str, Any], start: int, offset: int,
                 out: torch.Tensor) -> None:
    """Write the fp32 masters of elements ``[offset, offset + len(out))`` of a shard group's range (which starts at
    global element ``start``) into ``out`` (1-D contiguous float32): no tensor of the whole range is made. Call
    after :func:`check_module` passed for the range."""
    lo = start + offset
    weight = module_slice(params, module, lo, lo + out.numel())
    if storage == MODULE:
        out.copy_(weight)
    else:
        join_bf16(weight, derived.residual.part(offset, offset + out.numel()), out=out)


def casts_like_masters(storage: str, dtype: torch.dtype) -> bool:
    """Whether module weights stored for ``storage`` are, bit for bit, the masters cast to ``dtype``: fp32 module
    weights are the masters (any cast of them is the masters' cast); bf16 ones are the masters' rounding to bf16."""
    return storage == MODULE or (storage == MODULE_LOW16 and dtype == torch.bfloat16)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    return "missing" if value is None else type(value).__name__


def derived_problems(data: Any, storage: str, length: int, format_version: int) -> list[str]:
    """What is wrong with a shard group's stored ``masters`` entry for ``storage`` and ``length`` saved elements, in
    a checkpoint of ``format_version`` (one digest key, SHA-256 before version 4; digests 64 lowercase hex digits;
    no other keys; dtypes and shapes; exception indices increasing and in range). Reads the small exception list
    only."""
    allowed = _DIGEST_KEYS if format_version >= 4 else {"module_sha256": _digests.SHA256}
    keys = [key for key in allowed if isinstance(data, dict) and key in data]
    if len(keys) != 1 or not isinstance(data[keys[0]], dict) or not all(
            isinstance(k, str) and _digests.is_hex(v) for k, v in data[keys[0]].items()):
        return [f"'masters' is not {{'module_<algorithm>': {{name: digest of 64 lowercase hex digits}}, ...}} with "
                f"one algorithm of {sorted(allowed.values())} (format version {format_version})"]
    expected = {keys[0]} if storage == MODULE else {keys[0], _LOW, _INDEX, _VALUE}
    if set(data) != expected:
        return [f"'masters' holds {sorted(data)}, not {sorted(expected)}"]
    if storage == MODULE:
        return []
    low, index, value = data.get(_LOW), data.get(_INDEX), data.get(_VALUE)
    if not (isinstance(low, torch.Tensor) and low.dtype == torch.int16 and tuple(low.shape) == (length,)):
        return [f"'masters' {_LOW!r} must be int16 ({length},), is {_describe(low)}"]
    if not (isinstance(index, torch.Tensor) and index.dtype == torch.int64 and index.dim() == 1
            and isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.shape == index.shape):
        return [f"'masters' exceptions must be int64 and float32 of one length, are {_describe(index)} and "
                f"{_describe(value)}"]
    if index.numel() and (int(index[0]) < 0 or int(index[-1]) >= length or bool((index[1:] <= index[:-1]).any())):
        return [f"'masters' {_INDEX!r} must increase within [0, {length})"]
    return []
