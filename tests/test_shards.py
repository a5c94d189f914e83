"""``max_shard_size``: the split of a state dict into files, against huggingface_hub's (the one DeepSpeed uses).

The split on real checkpoints, written by ``zero_to_fp32`` and read back by transformers' sharded loader, is in
tests/test_stage3.py (test_zero_to_fp32_splits_a_state_larger_than_max_shard_size_as_deepspeed_does).
"""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_bnb.errors import CheckpointUsageError
from zero_bnb.tools.shards import parse_shard_size, plan_shards

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


@st.composite
def states(draw):
    """A state dict of tensors of various sizes and dtypes; some names tie to an earlier name's tensor. Not empty
    tensors: huggingface_hub takes every empty tensor for one storage (data pointer 0), a split without bytes."""
    state: dict[str, torch.Tensor] = {}
    for index in range(draw(st.integers(0, 12))):
        if state and draw(st.booleans()) and draw(st.booleans()):
            state[f"t{index}"] = state[draw(st.sampled_from(sorted(state)))]
        else:
            state[f"t{index}"] = torch.empty(draw(st.integers(1, 300)), dtype=draw(st.sampled_from(DTYPES)))
    return state


@settings(max_examples=200, deadline=None)
@given(state=states(), limit=st.integers(1, 1500), safetensors=st.booleans())
def test_the_split_is_huggingface_hubs(state, limit, safetensors):
    """The same files, the same names in each, the same total size as huggingface_hub's split."""
    weights_name = "model.safetensors" if safetensors else "pytorch_model.bin"
    pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
    theirs = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=limit)
    ours = plan_shards(state, weights_name, limit)
    if not state:  # huggingface_hub plans no file; zero_bnb writes one empty file (what it always wrote)
        assert ours.files == {weights_name: []} and not ours.sharded
        return
    assert {file: sorted(names) for file, names in ours.files.items()} == {
        file: sorted(names) for file, names in theirs.filename_to_tensors.items()}
    assert list(ours.files) == list(theirs.filename_to_tensors)
    assert ours.sharded == theirs.is_sharded and ours.total_size == theirs.metadata["total_size"]
    assert ours.index()["weight_map"] == theirs.tensor_to_filename


def test_everything_in_one_file_without_a_limit():
    state = {"a": torch.zeros(10**6), "b": torch.zeros(3)}
    assert plan_shards(state, "pytorch_model.bin", None).files == {"pytorch_model.bin": ["a", "b"]}


@pytest.mark.parametrize("size", ["5GB", "500MB", "1.5 kb", "2TB", " 10KB ", 12345])
def test_sizes_are_read_as_huggingface_hub_reads_them(size):
    assert parse_shard_size(size) == (size if isinstance(size, int) else parse_size_to_int(size))


@pytest.mark.parametrize("size", ["5GiB", "5G", "", "GB", "-1GB", "0MB", 0, -5, True, 1.5, None])
def test_a_wrong_size_is_named_with_the_forms_that_work(size):
    with pytest.raises(CheckpointUsageError) as refused:
        parse_shard_size(size)
    assert f"max_shard_size={size!r} is not a size" in str(refused.value) and "'5GB'" in str(refused.value)


def test_an_earlier_outputs_files_that_the_new_one_does_not_use_are_removed(tmp_path):
    """from_pretrained reads a single file before an index: a single pytorch_model.bin left by an earlier run beside a
    new sharded output would be loaded instead of it. Each write removes the earlier output's single file, index and
    shards of another split (only those names, never a folder), after its own files are written."""
    import os

    from zero_bnb.tools.shards import write_shards

    state = {"a": torch.arange(300, dtype=torch.float32), "b": torch.ones(300)}
    (tmp_path / "pytorch_model-00001-of-00009.bin").mkdir()  # a folder: not an output file
    others = ["model.safetensors", "pytorch_model-old.bin", "notes.txt"]
    for name in others:
        (tmp_path / name).write_text("kept")
    unrelated = sorted(others + ["pytorch_model-00001-of-00009.bin"])
    out, plan = write_shards(state, str(tmp_path), "pytorch_model.bin", None)
    assert not plan.sharded and sorted(os.listdir(tmp_path)) == sorted(unrelated + ["pytorch_model.bin"])
    out, plan = write_shards(state, str(tmp_path), "pytorch_model.bin", 1500)  # 2 shards and the index
    shards = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json"]
    assert plan.sharded and sorted(os.listdir(tmp_path)) == sorted(unrelated + shards)
    assert torch.equal(torch.load(tmp_path / shards[0])["a"], state["a"])
    (tmp_path / "pytorch_model-00003-of-00003.bin").write_text("an earlier split's")
    write_shards(state, str(tmp_path), "pytorch_model.bin", "2TB")
    assert sorted(os.listdir(tmp_path)) == sorted(unrelated + ["pytorch_model.bin"])
    assert torch.equal(torch.load(tmp_path / "pytorch_model.bin")["b"], state["b"])


def test_a_safetensors_file_that_from_pretrained_would_read_first_is_named(tmp_path, caplog):
    """A model.safetensors left by an earlier run with --safe_serialization is read by from_pretrained before a new
    pytorch_model.bin: it is kept (another format: maybe wanted) but named in a warning with the command."""
    import logging

    from zero_bnb.tools.shards import write_shards

    (tmp_path / "model.safetensors").write_text("an earlier run's")
    with caplog.at_level(logging.WARNING, logger="zero_bnb.tools.shards"):
        write_shards({"a": torch.zeros(3)}, str(tmp_path), "pytorch_model.bin", None)
    assert (tmp_path / "model.safetensors").read_text() == "an earlier run's"
    expected = (f"zero_bnb: {tmp_path} also holds model.safetensors, which from_pretrained reads before "
                f"pytorch_model.bin: remove it if an earlier run left it (rm {str(tmp_path / 'model.safetensors')!r})")
    assert [record.getMessage() for record in caplog.records] == [expected]
