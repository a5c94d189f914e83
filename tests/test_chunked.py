"""Partitions above bitsandbytes' 32-bit element limit: updated in block-aligned pieces, exactly."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_bnb.bnb.chunked import ChunkedUpdate
from zero_bnb.core.state_spec import spec_for

OPTIMIZERS = {"Adam8bit": bnb.optim.Adam8bit, "Lion8bit": bnb.optim.Lion8bit, "Adam32bit": bnb.optim.Adam32bit,
              "RMSprop8bit": bnb.optim.RMSprop8bit}


def _run(optimizer_cls, numel: int, limit: int | None, steps: int, device: str = "cpu"):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, device=device))
    optimizer = optimizer_cls([param], lr=1e-2)
    if limit is not None:
        optimizer.update_step = ChunkedUpdate(optimizer, spec_for(optimizer), limit)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        param.grad = torch.randn(numel, generator=generator).to(device)
        optimizer.step()
    return param.detach().clone(), {k: (v.clone() if torch.is_tensor(v) else v) for k, v in optimizer.state[param].items()}


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), numel=st.integers(4096, 20000), blocks=st.integers(1, 20),
       steps=st.integers(1, 3))
def test_chunked_update_equals_the_unchunked_one(name, numel, blocks, steps):
    limit = blocks * 256 + 17  # rounded down to whole blocks inside
    reference = _run(OPTIMIZERS[name], numel, None, steps)
    chunked = _run(OPTIMIZERS[name], numel, limit, steps)
    assert torch.equal(reference[0], chunked[0])
    assert reference[1].keys() == chunked[1].keys()
    for key, value in reference[1].items():
        assert torch.equal(value, chunked[1][key]) if torch.is_tensor(value) else value == chunked[1][key], key


def test_limit_below_one_block_is_refused():
    optimizer = bnb.optim.Adam8bit([torch.nn.Parameter(torch.zeros(10))])
    with pytest.raises(ValueError, match="smaller than one quantization block"):
        ChunkedUpdate(optimizer, spec_for(optimizer), 100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 60 * 2**30,
                    reason="needs a CUDA device with >= 60 GiB to hold a 2^31 + 4096-element partition and its state")
def test_a_real_partition_above_2_31_elements_on_gpu():
    numel = 2**31 + 4096
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, device="cuda"))
    tail = torch.nn.Parameter(param.detach()[-8192:].clone())
    big, small = bnb.optim.Adam8bit([param], lr=1e-2), bnb.optim.Adam8bit([tail], lr=1e-2)
    big.update_step = ChunkedUpdate(big, spec_for(big))
    grad = torch.randn(8192, device="cuda")
    param.grad = torch.zeros_like(param)
    param.grad[-8192:] = grad
    tail.grad = grad.clone()
    big.step()
    small.step()
    # Blocks are independent: the last 32 blocks of the huge partition update exactly like a standalone tensor.
    assert torch.equal(param.detach()[-8192:], tail.detach())
    assert torch.equal(big.state[param]["state1"][-8192:], small.state[tail]["state1"])


def test_a_partition_above_the_limit_is_really_split():
    optimizer = bnb.optim.Adam8bit([torch.nn.Parameter(torch.randn(5000))], lr=1e-2)
    chunked = ChunkedUpdate(optimizer, spec_for(optimizer), 1024)
    sizes = []
    original = chunked.original
    chunked.original = lambda group, p, g, i: (sizes.append(p.numel()), original(group, p, g, i))
    optimizer.update_step = chunked
    optimizer.param_groups[0]["params"][0].grad = torch.randn(5000)
    optimizer.step()
    assert sizes == [1024, 1024, 1024, 1024, 904]
    assert next(iter(optimizer.state.values()))["step"] == 1


def test_pieces_of_paged_state_stay_tagged_paged():
    # bitsandbytes' CUDA path accepts a CPU tensor over managed memory only when it carries is_paged; a slice would
    # lose the tag and a paged partition above the limit would fail on a GPU.
    param = torch.nn.Parameter(torch.randn(5000))
    optimizer = bnb.optim.Adam8bit([param], lr=1e-2)
    param.grad = torch.randn(5000)
    optimizer.step()
    for key in ("state1", "state2", "absmax1", "absmax2"):
        optimizer.state[param][key].is_paged, optimizer.state[param][key].page_deviceid = True, 0
    chunked = ChunkedUpdate(optimizer, spec_for(optimizer), 1024)
    seen = []
    chunked.original = lambda group, p, g, i: seen.append(
        {key: (getattr(value, "is_paged", False), getattr(value, "page_deviceid", None))
         for key, value in optimizer.state[p].items() if key in ("state1", "state2", "absmax1", "absmax2")})
    optimizer.update_step = chunked
    optimizer.step()
    assert len(seen) == 5 and all(tags == {key: (True, 0) for key in tags} and len(tags) == 4 for tags in seen), seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="paged optimizer state needs CUDA managed memory")
@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedLion8bit"])
def test_a_paged_optimizer_on_gpu_updates_in_pieces_exactly(name):
    numel = 300_000  # >= 1e5 elements: bitsandbytes pages this state
    optimizer_cls = getattr(bnb.optim, name)
    reference = _run(optimizer_cls, numel, None, 3, device="cuda")
    chunked = _run(optimizer_cls, numel, 64 * 256, 3, device="cuda")
    assert getattr(reference[1]["state1"], "is_paged", False) or reference[1]["state1"].device.type == "cpu"
    assert torch.equal(reference[0], chunked[0])
    for key, value in reference[1].items():
        assert torch.equal(value, chunked[1][key]) if torch.is_tensor(value) else value == chunked[1][key], key


def test_stacked_moments_cannot_be_split_and_say_why():
    param = torch.nn.Parameter(torch.randn(5000))
    optimizer = bnb.optim.AdEMAMix8bit([param], lr=1e-3)
    optimizer.update_step = ChunkedUpdate(optimizer, spec_for(optimizer), 1024)
    param.grad = torch.randn(5000)
    with pytest.raises(ValueError, match=r"state '(state1|absmax1)' has shape \(2, .*use a larger DP size"):
        optimizer.step()


def test_zero_update_max_numel_is_validated_and_stripped_from_the_deepspeed_config():
    from zero_bnb.core.config import ZeroBnbConfigError, split_config

    parsed, cleaned = split_config({"zero_optimization": {"stage": 1, "zero_update_max_numel": 1000}})
    assert parsed.update_max_numel == 1000 and cleaned == {"zero_optimization": {"stage": 1}}
    assert split_config({})[0].update_max_numel == 2**31 - 1
    for bad in (255, 2**31, "1000", True, 1e6):
        with pytest.raises(ZeroBnbConfigError) as error:
            split_config({"zero_update_max_numel": bad})
        assert str(error.value) == ("zero_update_max_numel must be an integer number of elements from 256 (one "
                                    f"quantization block) to 2147483647 (bitsandbytes' kernel limit, the default), "
                                    f"got {bad!r}")
