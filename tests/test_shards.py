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
    new sharded output would be loaded instead of it. Each write removes the earlier zero_bnb output's single file,
    index and shards of another split (those names only, never a folder, and only files it wrote, as its record
    proves), after its own files are in place."""
    import os

    from zero_bnb.tools.shards import write_shards

    state = {"a": torch.arange(300, dtype=torch.float32), "b": torch.ones(300)}
    (tmp_path / "pytorch_model-00001-of-00009.bin").mkdir()  # a folder: not an output file
    others = ["model.safetensors", "pytorch_model-old.bin", "notes.txt"]
    for name in others:
        (tmp_path / name).write_text("kept")
    unrelated = sorted(others + ["pytorch_model-00001-of-00009.bin", ".zero_bnb-outputs.json"])
    out, plan = write_shards(state, str(tmp_path), "pytorch_model.bin", None)
    assert not plan.sharded and sorted(os.listdir(tmp_path)) == sorted(unrelated + ["pytorch_model.bin"])
    write_shards({**state, "c": torch.ones(300)}, str(tmp_path), "pytorch_model.bin", 1500)  # 3 shards
    out, plan = write_shards(state, str(tmp_path), "pytorch_model.bin", 1500)  # 2 shards and the index
    shards = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json"]
    assert plan.sharded and sorted(os.listdir(tmp_path)) == sorted(unrelated + shards)
    assert torch.equal(torch.load(tmp_path / shards[0])["a"], state["a"])
    write_shards(state, str(tmp_path), "pytorch_model.bin", "2TB")
    assert sorted(os.listdir(tmp_path)) == sorted(unrelated + ["pytorch_model.bin"])
    assert torch.equal(torch.load(tmp_path / "pytorch_model.bin")["b"], state["b"])
    assert all((tmp_path / name).read_text() == "kept" for name in others)


def _base_model_folder(folder) -> dict[str, bytes]:
    """A Hugging Face base-model folder: .bin and safetensors shards with their indexes, config, and a link."""
    import os

    files = {"pytorch_model-00001-of-00002.bin": b"base 1", "pytorch_model-00002-of-00002.bin": b"base 2",
             "pytorch_model.bin.index.json": b"{}", "model-00001-of-00002.safetensors": b"st 1",
             "model-00002-of-00002.safetensors": b"st 2", "model.safetensors.index.json": b"{}",
             "config.json": b"{}", "pytorch_model.bin": b"single"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    os.symlink("config.json", folder / "model.safetensors")
    return files


def _contents(folder) -> dict[str, bytes]:
    import os

    return {name: (os.readlink(folder / name).encode() if os.path.islink(folder / name) else (folder / name).read_bytes())
            for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize(("weights_name", "limit"), [("pytorch_model.bin", None), ("pytorch_model.bin", 1500),
                                                     ("model.safetensors", None), ("model.safetensors", 1500)])
def test_another_models_weights_in_the_folder_are_refused_and_nothing_is_touched(tmp_path, weights_name, limit):
    # A1: an export into a base-model folder deleted 7 files and a link it never wrote.
    from zero_bnb.errors import CheckpointUsageError
    from zero_bnb.tools.shards import write_shards

    _base_model_folder(tmp_path)
    before = _contents(tmp_path)
    state = {"a": torch.arange(300, dtype=torch.float32), "b": torch.ones(300)}
    with pytest.raises(CheckpointUsageError, match=r"which zero_bnb did not write there .* Nothing was written. Write "
                                                   r"into another folder, or move those files away yourself"):
        write_shards(state, str(tmp_path), weights_name, limit)
    assert _contents(tmp_path) == before


def test_a_file_replaced_since_zero_bnb_wrote_it_is_not_zero_bnbs_any_more(tmp_path):
    from zero_bnb.errors import CheckpointUsageError
    from zero_bnb.tools.shards import write_shards

    state = {"a": torch.arange(300, dtype=torch.float32)}
    write_shards(state, str(tmp_path), "pytorch_model.bin", None)
    (tmp_path / "pytorch_model.bin").write_bytes(b"a user's own weights")
    with pytest.raises(CheckpointUsageError, match="pytorch_model.bin, which zero_bnb did not write there"):
        write_shards(state, str(tmp_path), "pytorch_model.bin", None)
    assert (tmp_path / "pytorch_model.bin").read_bytes() == b"a user's own weights"


def _hold_lock(folder: str, held, release) -> None:
    from zero_bnb.format.lock import SaveFolderLock

    with SaveFolderLock(folder, "another export"):
        held.set()
        release.wait(60)


def test_a_second_writer_of_one_folder_is_refused_while_the_first_holds_it(tmp_path):
    # A7: two zero_to_fp32 jobs writing one folder at once each deleted the other's shards.
    import multiprocessing

    from zero_bnb.errors import CheckpointSaveError
    from zero_bnb.tools.shards import write_shards

    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(str(tmp_path), held, release))
    holder.start()
    try:
        assert held.wait(30)
        with pytest.raises(CheckpointSaveError, match=f"another export.*pid {holder.pid}|pid {holder.pid}"):
            write_shards({"a": torch.zeros(3)}, str(tmp_path), "pytorch_model.bin", None)
        assert not (tmp_path / "pytorch_model.bin").exists()
    finally:
        release.set()
        holder.join(30)
    write_shards({"a": torch.zeros(3)}, str(tmp_path), "pytorch_model.bin", None)  # free again


def test_a_failure_while_writing_leaves_the_previous_output_whole_and_says_so(tmp_path, monkeypatch):
    # A5: a full disk while writing shard 2 of 3 over an earlier output of the same split left a mix that loaded
    # through a valid index, while the message said the previous file was unchanged.
    import errno
    import os

    from zero_bnb.errors import CheckpointSaveError
    from zero_bnb.tools import shards, views

    old = {name: torch.full((300,), 1.0) for name in "abc"}
    shards.write_shards(old, str(tmp_path), "pytorch_model.bin", 1500)
    before = _contents(tmp_path)
    calls = []
    real = views.write_state_dict

    def full_disk_at_the_second(state, path, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise CheckpointSaveError(f"could not write {path} (OSError: [Errno {errno.ENOSPC}] No space left on "
                                      f"device); nothing was written")
        return real(state, path, **kwargs)

    monkeypatch.setattr(shards, "write_state_dict", full_disk_at_the_second)
    new = {name: torch.full((300,), 2.0) for name in "abc"}
    with pytest.raises(CheckpointSaveError, match="the previous output in .* is unchanged"):
        shards.write_shards(new, str(tmp_path), "pytorch_model.bin", 1500)
    assert _contents(tmp_path) == before  # no hidden file left, nothing replaced

    monkeypatch.setattr(shards, "write_state_dict", real)
    renames = []
    real_replace = os.replace

    def interrupted_after_the_first_rename(source, target):  # the first shard renamed into place, then Ctrl-C
        if os.path.dirname(str(source)) == str(tmp_path) and os.path.basename(str(source)).startswith(".zero_bnb-new-"):
            if renames:
                raise KeyboardInterrupt
            renames.append(target)
        return real_replace(source, target)

    monkeypatch.setattr(shards.os, "replace", interrupted_after_the_first_rename)
    with pytest.raises(CheckpointSaveError, match="the output there is incomplete .*run the export again"):
        shards.write_shards(new, str(tmp_path), "pytorch_model.bin", 1500)
    monkeypatch.setattr(shards.os, "replace", real_replace)
    # No index names a mix: the old index is gone, so from_pretrained finds no complete output instead of a mix.
    assert not (tmp_path / "pytorch_model.bin.index.json").exists()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".zero_bnb-new-")]
    shards.write_shards(new, str(tmp_path), "pytorch_model.bin", 1500)  # the next run completes it
    assert all(torch.equal(torch.load(tmp_path / f"pytorch_model-0000{i}-of-00003.bin")[name], new[name])
               for i, name in zip((1, 2, 3), "abc"))


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
