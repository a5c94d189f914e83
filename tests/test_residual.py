"""Masters derived from module weights: the bf16 residual encoding (pure math) and the format's rebuild checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_bnb.core.residual import CHUNK, join_bf16, rounds_to, split_bf16, split_rounded_bf16
from zero_bnb.errors import CheckpointFormatError
from zero_bnb.format.manifest import FORMAT_VERSION, ParamEntry
from zero_bnb.format.masters import (FULL, MODULE, MODULE_LOW16, casts_like_masters, check_module, derive,
                                     derived_problems, module_slice, rebuild, rebuild_into)


def _floats(bits: list[int]) -> torch.Tensor:
    """fp32 tensor with exactly these bit patterns (unsigned 32-bit ints)."""
    signed = [b - (1 << 32) if b >= 1 << 31 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def _bits(values: torch.Tensor) -> list[int]:
    return [b & 0xFFFFFFFF for b in values.view(torch.int32).tolist()]


_EDGES = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001,
          0x80008000, 0x00008000, 0x00018000, 0x007F8000, 0x00808000, 0x3F808000, 0x3F818000, 0x7F7F8000,
          0x7F7F8001, 0x7F7FFFFF, 0xFF7F8000, 0x3F80FFFF, 0x0000FFFF, 0x807FFFFF, 0x3F7FFFFF]
_PATTERNS = st.one_of(st.integers(0, 0xFFFFFFFF), st.sampled_from(_EDGES),
                      st.integers(0, 0xFFFF).map(lambda hi: hi << 16 | 0x8000),  # every kind of tie
                      st.integers(0, 0xFFFF).map(lambda hi: hi << 16 | 0x8001),
                      st.integers(0, 0xFFFF).map(lambda hi: hi << 16 | 0x7FFF))


def _is_nan(bits: int) -> bool:
    return (bits >> 23) & 0xFF == 0xFF and bits & 0x7FFFFF != 0


def _check_exceptions(bits: list[int], index: list[int]) -> None:
    """Exceptions are every tie whose top half is odd (the rounding carried) and NaN that the rounding made
    canonical, nothing else."""
    carried = {i for i, b in enumerate(bits) if b & 0xFFFF == 0x8000 and (b >> 16) & 1 and not _is_nan(b)}
    assert carried <= set(index) <= carried | {i for i, b in enumerate(bits) if _is_nan(b)}
    assert index == sorted(set(index))


@settings(max_examples=300, deadline=None)
@given(st.lists(_PATTERNS, min_size=0, max_size=64))
def test_every_fp32_master_round_trips_through_its_rounding_and_residual(bits):
    master = _floats(bits)
    weight = master.to(torch.bfloat16)  # what DeepSpeed's bit16.copy_(fp32) writes
    residual = split_bf16(master, weight)
    assert _bits(join_bf16(weight, residual)) == bits
    assert rounds_to(master, weight)
    _check_exceptions(bits, residual.index.tolist())
    assert residual.low.dtype == torch.int16 and residual.low.shape == master.shape


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_PATTERNS, st.integers(0, 0xFFFF)), min_size=1, max_size=64))
def test_any_weight_gives_back_its_master_exactly_and_rounds_to_says_when_it_is_not_the_rounding(pairs):
    master = _floats([m for m, _ in pairs])
    weight = torch.tensor([w - (1 << 16) if w >= 1 << 15 else w for _, w in pairs], dtype=torch.int16
                          ).view(torch.bfloat16)
    assert _bits(join_bf16(weight, split_bf16(master, weight))) == [m for m, _ in pairs]
    rounded = master.to(torch.bfloat16).view(torch.int16)
    assert rounds_to(master, weight) == torch.equal(rounded, weight.view(torch.int16))


@pytest.mark.parametrize("low", [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
def test_exhaustive_over_every_top_half(low):
    """All 65 536 sign/exponent/top-mantissa patterns with the low halves around the rounding boundary."""
    bits = [(hi << 16) | low for hi in range(1 << 16)]
    master = _floats(bits)
    weight = master.to(torch.bfloat16)
    residual = split_bf16(master, weight)
    assert _bits(join_bf16(weight, residual)) == bits
    _check_exceptions(bits, residual.index.tolist())


@pytest.mark.parametrize("shift", [1, 0xFFFF, 0x8000])
def test_every_weight_beside_a_master_it_is_not_the_rounding_of_joins_back_exactly(shift):
    """The join's 32-bit arithmetic wraps where the top half does (bf16 0x8000 with a carry gives 0x7FFF...): every
    16-bit weight, next to masters whose top half is off by ``shift``, around the rounding boundary."""
    weights = torch.arange(1 << 16, dtype=torch.int32)
    for low in (0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
        bits = [(((w + shift) & 0xFFFF) << 16) | low for w in range(1 << 16)]
        weight = torch.where(weights >= 1 << 15, weights - (1 << 16), weights).to(torch.int16).view(torch.bfloat16)
        assert _bits(join_bf16(weight, split_bf16(_floats(bits), weight))) == bits


def test_trained_like_weights_need_almost_no_exceptions():
    torch.manual_seed(0)
    master = torch.randn(1 << 20) * 0.02
    weight = master.to(torch.bfloat16)
    residual = split_bf16(master, weight)
    assert residual.index.numel() < 40  # about one tie in 2^17 elements, half of them carried
    assert torch.equal(join_bf16(weight, residual).view(torch.int32), master.view(torch.int32))


def test_chunk_boundaries_change_nothing():
    """Elements on either side of each CHUNK boundary: exceptions found in every chunk, indices increasing, and
    ``rounds_to`` sees a single wrong weight in the last, partial chunk."""
    n = 2 * CHUNK + 40
    torch.manual_seed(1)
    master = torch.randn(n) * 0.02
    edges = _floats(_EDGES)
    for at in (0, CHUNK - len(_EDGES), CHUNK, 2 * CHUNK - 11, n - len(_EDGES)):
        master[at : at + len(_EDGES)] = edges
    weight = master.to(torch.bfloat16)
    assert rounds_to(master, weight)
    weight[CHUNK - 1] = weight[CHUNK]  # not its master's rounding: an exception of the first chunk
    residual = split_bf16(master, weight)
    index = residual.index.tolist()
    assert index == sorted(set(index)) and CHUNK - 1 in index and any(i >= 2 * CHUNK for i in index)
    assert torch.equal(join_bf16(weight, residual).view(torch.int32), master.view(torch.int32))
    late = master.to(torch.bfloat16)
    late[n - 1] = late[n - 2] if late[n - 2] != late[n - 1] else -late[n - 1]
    assert not rounds_to(master, late)


def _same_residual(a, b) -> bool:
    return (torch.equal(a.low, b.low) and torch.equal(a.index, b.index)
            and torch.equal(a.value.view(torch.int32), b.value.view(torch.int32)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_PATTERNS, min_size=0, max_size=64), st.lists(st.integers(0, 63), max_size=3))
def test_split_rounded_is_split_when_the_weight_is_the_rounding_and_none_when_it_is_not(bits, wrong):
    """The one-pass split gives split_bf16's residual for every bit pattern (ties, NaN, Inf, overflow) whose weight
    is its rounding, and None as soon as one weight is not, as rounds_to says."""
    master = _floats(bits)
    weight = master.to(torch.bfloat16)
    assert _same_residual(split_rounded_bf16(master, weight), split_bf16(master, weight))
    for at in (i for i in wrong if i < len(bits)):
        weight.view(torch.int16)[at] ^= 1
    fused = split_rounded_bf16(master, weight)
    assert (fused is None) == (not rounds_to(master, weight))
    if fused is not None:
        assert _same_residual(fused, split_bf16(master, weight))


def test_split_rounded_finds_the_exceptions_of_every_chunk():
    """Ties that carried in every chunk (found among the ties), NaN in one chunk (compared whole, its ties not
    counted twice), and a sum that overflows without any NaN: the residual of split_bf16, indices increasing."""
    n = 3 * CHUNK + 77
    torch.manual_seed(2)
    master = torch.randn(n) * 0.02
    bits = master.view(torch.int32)
    bits[::5003] = (bits[::5003] & ~0xFFFF) | 0x8000
    master[CHUNK + 3] = float("nan")
    master[2 * CHUNK : 2 * CHUNK + 4] = 3e38  # finite, but their sum is not
    weight = master.to(torch.bfloat16)
    fused = split_rounded_bf16(master, weight)
    assert _same_residual(fused, split_bf16(master, weight))
    assert fused.index.numel() > 10 and fused.index.tolist() == sorted(set(fused.index.tolist()))
    assert torch.equal(join_bf16(weight, fused).view(torch.int32), bits)
    weight[n - 1] = weight[n - 1] * 2 + 1  # the last, partial chunk
    assert split_rounded_bf16(master, weight) is None


def _group():
    params = (ParamEntry("a", (3, 4), 0), ParamEntry("b", (5,), 12), ParamEntry("c", (2, 2), 17))
    masters = {p.name: torch.randn(*p.shape) for p in params}
    return params, masters


@pytest.mark.parametrize("storage", [MODULE, MODULE_LOW16])
@pytest.mark.parametrize("start,end", [(0, 21), (5, 14), (12, 17), (13, 21), (21, 21), (0, 0)])
def test_derived_masters_rebuild_exactly_from_the_module_weights(storage, start, end):
    """Any range, empty ones too (a rank that owns no element of a small group at a large DP size)."""
    params, masters = _group()
    dtype = torch.float32 if storage == MODULE else torch.bfloat16
    module = {name: value.to(dtype) for name, value in masters.items()}
    master = module_slice(params, masters, start, end)
    weight = module_slice(params, module, start, end)
    assert weight.dtype == dtype and master.dtype == torch.float32 and weight.numel() == end - start
    derived = derive(storage, master, weight, params, start, end)
    assert derived_problems(derived.to_dict(), storage, end - start, FORMAT_VERSION) == []
    rebuilt = rebuild(storage, derived, params, module, start, end, model_file="m.pt", shard_file="s.pt")
    assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32))


@pytest.mark.parametrize("storage", [MODULE, MODULE_LOW16])
def test_module_weights_back_to_back_in_one_storage_are_read_in_place(storage):
    """DeepSpeed's module weights are views of one flat buffer (and so are those a memory-mapped model file gives
    back): the group's range is one view of it, no copy; the masters rebuild exactly as from separate tensors."""
    params, masters = _group()
    dtype = torch.float32 if storage == MODULE else torch.bfloat16
    flat = torch.cat([masters[p.name].reshape(-1) for p in params]).to(dtype)
    module = {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in params}
    separate = {name: value.to(dtype) for name, value in masters.items()}
    for start, end in [(0, 21), (5, 14), (13, 21)]:
        weight = module_slice(params, module, start, end)
        assert weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert torch.equal(weight, flat[start:end])
        master = module_slice(params, masters, start, end)  # separate tensors: copied
        derived = derive(storage, master, weight, params, start, end)
        assert derived.digests == derive(storage, master, module_slice(params, separate, start, end), params, start,
                                         end).digests
        rebuilt = rebuild(storage, derived, params, module, start, end, model_file="m.pt", shard_file="s.pt")
        assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: module weights on a GPU")
def test_device_weights_back_to_back_are_one_view_moved_by_one_copy():
    """On a GPU, DeepSpeed's flat 16-bit group is one device storage: the rank's range is one view of it (an
    asynchronous save stages it with one copy, or as a view of the model file's staged copy), never a copy per
    parameter; the masters derived from it on the CPU equal those derived from CPU weights."""
    params, masters = _group()
    flat = torch.cat([masters[p.name].reshape(-1) for p in params]).to(torch.bfloat16).cuda()
    module = {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in params}
    weight = module_slice(params, module, 5, 14)
    assert weight.is_cuda and weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    master = module_slice(params, masters, 5, 14)
    on_cpu = module_slice(params, {name: value.cpu() for name, value in module.items()}, 5, 14)
    assert torch.equal(weight.cpu(), on_cpu)
    assert derive(MODULE_LOW16, master, weight.cpu(), params, 5, 14).digests == \
        derive(MODULE_LOW16, master, on_cpu, params, 5, 14).digests


@pytest.mark.parametrize("storage", [MODULE, MODULE_LOW16])
def test_any_part_of_a_range_rebuilds_straight_into_its_destination(storage):
    """A load writes each part of a shard's range it needs into the new partition (no tensor of the whole range):
    every part equals that part of the whole rebuild, the bf16 exceptions (ties, NaN) included."""
    params = (ParamEntry("a", (40, 50), 0), ParamEntry("b", (700,), 2000), ParamEntry("c", (9,), 2700))
    torch.manual_seed(0)
    masters = {p.name: torch.randn(*p.shape) for p in params}
    masters["a"].view(-1)[::7] = _floats([0x3F818000, 0x7FC00001, 0x00018000, 0xFF800000] * 72)[:286]  # exceptions
    dtype = torch.float32 if storage == MODULE else torch.bfloat16
    module = {name: value.to(dtype) for name, value in masters.items()}
    start, end = 13, 2709
    master = module_slice(params, masters, start, end)
    derived = derive(storage, master, module_slice(params, module, start, end), params, start, end)
    assert storage == MODULE or derived.residual.index.numel() > 100
    for offset, length in [(0, end - start), (0, 1), (5, 1990), (1987, 700), (end - start - 3, 3), (200, 0)]:
        out = torch.full((length,), float("nan"))
        rebuild_into(storage, derived, params, module, start, offset, out)
        assert torch.equal(out.view(torch.int32), master[offset : offset + length].view(torch.int32)), (offset, length)


def test_an_edited_model_file_is_named_not_combined_into_wrong_masters():
    params, masters = _group()
    module = {name: value.to(torch.bfloat16) for name, value in masters.items()}
    derived = derive(MODULE_LOW16, module_slice(params, masters, 0, 21), module_slice(params, module, 0, 21),
                     params, 0, 21)
    edited = dict(module, b=module["b"] + 1)
    for check in (rebuild, check_module):  # a load's check without a rebuild refuses the same
        with pytest.raises(CheckpointFormatError, match=r"m\.pt: the module weights of \['b'\].*s\.pt"):
            check(MODULE_LOW16, derived, params, edited, 0, 21, model_file="m.pt", shard_file="s.pt")
    assert check_module(MODULE_LOW16, derived, params, module, 0, 21, model_file="m.pt", shard_file="s.pt") == \
        list(params)
    with pytest.raises(CheckpointFormatError, match=r"c: float32 \(2, 2\)"):
        rebuild(MODULE_LOW16, derived, params, dict(module, c=masters["c"]), 0, 21, model_file="m.pt",
                shard_file="s.pt")
    with pytest.raises(CheckpointFormatError, match="a: missing"):
        rebuild(MODULE_LOW16, derived, params, {k: v for k, v in module.items() if k != "a"}, 0, 21,
                model_file="m.pt", shard_file="s.pt")


def test_malformed_stored_residuals_are_refused():
    params, masters = _group()
    module = {name: value.to(torch.bfloat16) for name, value in masters.items()}
    good = derive(MODULE_LOW16, module_slice(params, masters, 0, 21), module_slice(params, module, 0, 21),
                  params, 0, 21).to_dict()
    assert derived_problems(None, MODULE, 21, FORMAT_VERSION)
    assert derived_problems(dict(good, low16=good["low16"][:-1]), MODULE_LOW16, 21, FORMAT_VERSION)
    assert derived_problems(dict(good, exception_index=torch.tensor([3, 3]), exception_value=torch.zeros(2)),
                            MODULE_LOW16, 21, FORMAT_VERSION)
    assert derived_problems(dict(good, exception_index=torch.tensor([21]), exception_value=torch.zeros(1)),
                            MODULE_LOW16, 21, FORMAT_VERSION)
    assert derived_problems(dict(good, exception_index=torch.tensor([1]), exception_value=torch.zeros(2)),
                            MODULE_LOW16, 21, FORMAT_VERSION)
    assert derived_problems(good, MODULE, 21, FORMAT_VERSION)  # a residual where the manifest says none


def test_module_weights_stand_for_the_masters_cast_only_where_they_are_that_cast():
    """A load copies the model file's weights instead of rebuilding masters only where they are ``master.to(dtype)``
    bit for bit: fp32 module weights are the masters (any cast of them is the masters' cast); bf16 ones are the
    masters' rounding to bf16 only (into fp32 or fp16 parameters the masters must be rebuilt)."""
    master = torch.randn(4096) * 3
    weight = master.to(torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert casts_like_masters(MODULE, dtype)
        same = torch.equal(weight.to(dtype).view(-1).float(), master.to(dtype).float())
        assert casts_like_masters(MODULE_LOW16, dtype) == (dtype == torch.bfloat16)
        assert same == (dtype == torch.bfloat16)  # the bf16 weights are the masters' cast only into bf16
        assert not casts_like_masters(FULL, dtype)
