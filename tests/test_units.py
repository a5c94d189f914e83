"""Unit tests of config parsing, the state-kind policy, quantization helpers and the manifest."""

import json

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_bnb.core import quant
from zero_bnb.core.config import (
    DEEPSPEED_ZERO_KEYS,
    OWN_KEYS,
    ZERO_SECTION_KEYS,
    ZeroBnbConfig,
    ZeroBnbConfigError,
    load_ds_config,
    split_config,
)
from zero_bnb.core.state_spec import (
    BNB_ADAM,
    TORCH_ADAM,
    StateKind,
    StateRule,
    UnsupportedOptimizerError,
    classify_state,
    spec_for,
)
from zero_bnb.errors import CheckpointCorruptError, CheckpointFormatError
from zero_bnb.format.durable import FileRecord
from zero_bnb.format.integrity import checksum_shares
from zero_bnb.format.manifest import (
    GroupEntry,
    Manifest,
    ParamEntry,
    StateEntry,
    read_manifest,
    write_manifest,
)

# -- config ------------------------------------------------------------------------------------

def test_keys_at_top_level_and_inside_zero_optimization_are_read_and_stripped():
    top = {"zero_unsharded_state_keys": ["qmap1"], "zero_optimization": {"stage": 1}}
    nested = {"zero_optimization": {"stage": 1, "zero_unsharded_state_keys": ["qmap1"],
                                    "zero_unsharded_state_max_numel": 16}}
    for config in (top, nested):
        parsed, cleaned = split_config(config)
        assert parsed.unsharded_state_keys == ("qmap1",)
        assert "zero_unsharded_state_keys" not in cleaned and "zero_unsharded_state_keys" not in cleaned["zero_optimization"]
        assert cleaned["zero_optimization"] == {"stage": 1}
    assert split_config(nested)[0].unsharded_state_max_numel == 16
    assert "zero_unsharded_state_keys" in nested["zero_optimization"]  # the input is not modified


def test_absent_keys_mean_optimizer_default():
    parsed, _ = split_config({"zero_optimization": {"stage": 1}})
    assert parsed == ZeroBnbConfig()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"zero_unsharded_state_keys": "qmap1"}, "must be a list of state-key names"),
        ({"zero_unsharded_state_keys": ["qmap1", ""]}, "invalid entries"),
        ({"zero_unsharded_state_max_numel": -3}, "non-negative integer"),
        ({"zero_unsharded_state_max_numel": True}, "non-negative integer"),
        ({"zero_unsharded_state_keys": ["qmap1"], "zero_optimization": {"zero_unsharded_state_keys": ["qmap2"]}},
         "set twice with different values"),
    ],
)
def test_bad_config_values_are_named(config, message):
    with pytest.raises(ZeroBnbConfigError, match=message):
        split_config(config)


@pytest.mark.parametrize("typo, closest", [("zero_unsharded_state_key", "zero_unsharded_state_keys"),
                                           ("zero_checkpoint_asynch", "zero_checkpoint_async"),
                                           ("zero_allow_untested_optimiser", "zero_allow_untested_optimizer")])
def test_unknown_top_level_zero_keys_are_refused_naming_the_closest(typo, closest):
    # DeepSpeed ignores unknown top-level keys: a misspelt zero_bnb key would silently do nothing.
    with pytest.raises(ZeroBnbConfigError, match=f"'{typo}' \\(did you mean '{closest}'\\?\\).*Correct or remove"):
        split_config({typo: True, "zero_optimization": {"stage": 1}})
    with pytest.raises(ZeroBnbConfigError, match="'zero_whatever'\\. zero_bnb reads"):  # nothing close: no guess
        split_config({"zero_whatever": 1})
    known = {key: None for key in (*OWN_KEYS, *DEEPSPEED_ZERO_KEYS)} | {"zero_optimization": {"stage": 2}}
    assert split_config(known)[1] == {key: None for key in DEEPSPEED_ZERO_KEYS} | {"zero_optimization": {"stage": 2}}
    assert split_config({"train_batch_size": 8, "zeroes": 1})[1] == {"train_batch_size": 8, "zeroes": 1}


@pytest.mark.parametrize("key, said", [("Zero_checkpoint_async", "did you mean 'zero_checkpoint_async'"),
                                       ("ZERO_CHECKPOINT_ASYNC", "did you mean 'zero_checkpoint_async'"),
                                       (" zero_checkpoint_async", "did you mean 'zero_checkpoint_async'"),
                                       ("zero-checkpoint-async", "did you mean 'zero_checkpoint_async'"),
                                       ("zero_stage", 'a zero_optimization field: put it there as "stage"'),
                                       ("zero_hpz_partition_size", "a zero_optimization field: put it there as "
                                                                   '"zero_hpz_partition_size"')])
def test_other_spellings_of_zero_keys_and_misplaced_zero_optimization_fields_are_refused(key, said):
    # The adversarial probe: these were accepted and did nothing, or got a misleading guess.
    with pytest.raises(ZeroBnbConfigError, match=said.replace("(", "\\(")):
        split_config({key: 1})


def test_zero_optimization_fields_named_zero_are_deepspeeds():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = {name for name in DeepSpeedZeroConfig.model_fields if name.startswith("zero_")}
    assert fields == {key for key, field in ZERO_SECTION_KEYS.items() if key == field}, fields


def test_deepspeed_top_level_zero_keys_are_the_installed_deepspeeds():
    from deepspeed.runtime import constants

    installed = {value for name, value in vars(constants).items()
                 if isinstance(value, str) and value.startswith("zero_") and name.isupper()}
    assert installed <= set(DEEPSPEED_ZERO_KEYS), installed - set(DEEPSPEED_ZERO_KEYS)


def test_config_file_errors_name_the_path(tmp_path):
    with pytest.raises(ZeroBnbConfigError, match="does not exist"):
        load_ds_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ZeroBnbConfigError, match="not valid JSON"):
        load_ds_config(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert load_ds_config(good) == {"zero_optimization": {"stage": 1}}


# -- state kinds -------------------------------------------------------------------------------

NO_RULE = StateRule()


def _classify(key, value, rule=NO_RULE, spec=BNB_ADAM, partition=4096):
    return classify_state(key, value, spec=spec, rule=rule, partition_numel=partition)[0]


def test_exact_names_win_then_threshold_then_declaration():
    absmax = torch.zeros(16)
    assert _classify("absmax1", absmax) is StateKind.BLOCKWISE
    assert _classify("absmax1", absmax, StateRule(max_numel=256)) is StateKind.REPLICATED
    assert _classify("state1", torch.zeros(4096, dtype=torch.uint8), StateRule(frozenset({"state1"}))) is StateKind.REPLICATED
    assert _classify("qmap1", torch.zeros(256)) is StateKind.REPLICATED
    assert _classify("step", 3) is StateKind.COUNTER
    assert _classify("unorm_vec", torch.zeros(1)) is StateKind.PARTITION_SCALAR


def test_undeclared_state_is_classified_by_shape_or_refused():
    assert _classify("extra", torch.zeros(4096), spec=TORCH_ADAM) is StateKind.ELEMENTWISE
    assert _classify("extra", torch.tensor(1.0), spec=TORCH_ADAM) is StateKind.COUNTER
    with pytest.raises(UnsupportedOptimizerError, match=r"'extra' \(shape \(7,\).*zero_unsharded_state_keys"):
        _classify("extra", torch.zeros(7), spec=TORCH_ADAM)


def test_spec_lookup_and_refusals():
    params = [torch.nn.Parameter(torch.zeros(10))]
    assert spec_for(bnb.optim.Adam8bit(params)) is BNB_ADAM
    assert spec_for(bnb.optim.AdamW8bit(params)) is BNB_ADAM
    assert spec_for(torch.optim.AdamW(params)) is TORCH_ADAM
    with pytest.raises(UnsupportedOptimizerError, match="no state declaration for torch.optim.sgd.SGD"):
        spec_for(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(UnsupportedOptimizerError, match="max_unorm=0.5.*max_unorm=0.0"):
        spec_for(_with_unorm(params))
    assert spec_for(bnb.optim.PagedAdamW8bit(params)) is BNB_ADAM  # paged state is ordinary tensors to zero_bnb


def _with_unorm(params):
    optimizer = bnb.optim.Adam8bit(params)
    optimizer.args.max_unorm = 0.5
    return optimizer


# -- quantization ------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), signed=st.booleans())
def test_dequantize_and_quantize_match_bitsandbytes(n, signed):
    qmap = F.create_dynamic_map(signed=signed)
    values = torch.randn(n, generator=torch.Generator().manual_seed(n))
    values = values if signed else values.abs()
    codes, absmax = quant.quantize(values, qmap, 256)
    expected_codes, expected = F.quantize_blockwise(values, code=qmap, blocksize=256)
    assert torch.equal(codes, expected_codes) and torch.equal(absmax, expected.absmax)
    ours = quant.dequantize(codes, absmax, qmap, 256)
    theirs = F.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=256)
    assert torch.equal(ours, theirs)


def test_zero_code_and_errors():
    assert quant.zero_code(F.create_dynamic_map(signed=True)) == 127
    assert quant.zero_code(F.create_dynamic_map(signed=False)) == 0
    with pytest.raises(ValueError, match="no exact zero"):
        quant.zero_code(torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="need absmax of shape \\(2,\\), got \\(1,\\)"):
        quant.dequantize(torch.zeros(300, dtype=torch.uint8), torch.ones(1), torch.ones(256), 256)


# -- manifest ----------------------------------------------------------------------------------

def _manifest(**changes):
    group = GroupEntry(
        numel=10, params=(ParamEntry("w", (2, 5), 0),),
        states=(StateEntry("state1", StateKind.ELEMENTWISE, "uint8", "declared"),),
        element_ranges=((0, 10),), block_ranges=((0, 1),),
        hyperparameters={"lr": 0.01, "betas": [0.9, 0.995]},
    )
    fields = {"dp_world_size": 1, "block_size": 256, "optimizer_class": "x.Adam8bit", "optimizer_spec": "spec",
              "groups": (group,), "shards": ("shard_00000-of-00001.pt",), "versions": {"torch": "2"},
              "files": (FileRecord("zero_bnb/shard_00000-of-00001.pt", 12, "ab" * 32),),
              "non_finite": {"w": ["fp32"]}}
    return Manifest(**{**fields, **changes})


def test_manifest_round_trips_and_rejects_unknown_versions(tmp_path):
    write_manifest(_manifest(), str(tmp_path), root=str(tmp_path))
    assert read_manifest(str(tmp_path)) == _manifest()
    (tmp_path / "manifest.json").write_text(_manifest(format_version=99).to_json())
    with pytest.raises(CheckpointFormatError, match="format_version=99.*reads versions \\[1, 2, 3, 4\\]"):
        read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text(_manifest(format_name="other").to_json())
    with pytest.raises(CheckpointFormatError, match="not a zero_bnb manifest"):
        read_manifest(str(tmp_path))
    with pytest.raises(CheckpointFormatError, match="not a complete zero_bnb checkpoint"):
        read_manifest(str(tmp_path / "nowhere"))


def test_manifest_detects_any_edit_of_its_own_text(tmp_path):
    text = _manifest().to_json()
    edited = text.replace('"lr": 0.01', '"lr": 0.02')
    assert edited != text
    for damaged, message in ((edited, "was modified or damaged"), ("{", "does not start with")):
        (tmp_path / "manifest.json").write_text(damaged)
        with pytest.raises(CheckpointCorruptError, match=message):
            read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_bytes(b"\xff" + text.encode())
    with pytest.raises(CheckpointCorruptError, match="not UTF-8"):
        read_manifest(str(tmp_path))


@given(sizes=st.lists(st.integers(0, 10**9), max_size=40), world=st.integers(1, 16))
def test_checksum_shares_cover_every_file_once_and_balance_bytes(sizes, world):
    files = tuple(FileRecord(f"f{i}", size, "") for i, size in enumerate(sizes))
    shares = checksum_shares(files, world)
    assert sorted(i for share in shares for i in share) == list(range(len(files)))
    loads = [sum(files[i].size for i in share) for share in shares]
    # greedy largest-first: no rank exceeds the ideal share by more than the largest file
    assert max(loads, default=0) <= sum(sizes) / world + max(sizes, default=0)


def test_checkpoint_safety_keys_are_read_and_validated():
    parsed, cleaned = split_config({"zero_nonfinite_check": "warn",
                                    "zero_optimization": {"stage": 1, "zero_checkpoint_verify": False}})
    assert (parsed.nonfinite_check, parsed.checkpoint_verify) == ("warn", False)
    assert cleaned == {"zero_optimization": {"stage": 1}}
    assert (ZeroBnbConfig().nonfinite_check, ZeroBnbConfig().checkpoint_verify) == ("error", True)
    with pytest.raises(ZeroBnbConfigError, match=r"zero_nonfinite_check must be one of \['error', 'warn', 'off'\], got 'loud'"):
        split_config({"zero_nonfinite_check": "loud"})
    with pytest.raises(ZeroBnbConfigError, match="zero_checkpoint_verify must be true or false, got 'yes'"):
        split_config({"zero_checkpoint_verify": "yes"})


def test_stacked_moments_of_a_real_ademamix_step_dequantize_and_requantize_like_bitsandbytes():
    """AdEMAMix8bit keeps two moments in one (2, n) state1 with a (2, blocks) absmax1; each row is its own stream
    of blocks (n spans a partial block). Reference: bitsandbytes' own dequantization of each row."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5000))
    optimizer = bnb.optim.AdEMAMix8bit([param], lr=1e-3, min_8bit_size=1)
    for _ in range(3):
        param.grad = torch.randn(5000)
        optimizer.step()
    state = optimizer.state[param]
    codes, absmax, qmap = state["state1"], state["absmax1"], state["qmap1"]
    assert codes.shape == (2, 5000) and absmax.shape == (2, 20)
    values = quant.dequantize(codes, absmax, qmap, 256)
    for row in range(2):
        reference = F.dequantize_blockwise(codes[row], absmax=absmax[row], code=qmap, blocksize=256)
        assert torch.equal(values[row], reference), row
    again_codes, again_absmax = quant.quantize(values, qmap, 256)
    assert again_codes.shape == codes.shape and again_absmax.shape == absmax.shape
    for row in range(2):  # each row quantized by bitsandbytes on its own grid: the same codes and absmax
        expected_codes, expected = F.quantize_blockwise(values[row].contiguous(), code=qmap, blocksize=256)
        assert torch.equal(again_codes[row], expected_codes) and torch.equal(again_absmax[row], expected.absmax), row
    changed = values.clone()
    changed[1] *= 3
    assert torch.equal(quant.quantize(changed, qmap, 256)[0][0], again_codes[0])  # rows do not share blocks


# -- errors name their real kind ----------------------------------------------------------------

@pytest.mark.parametrize(("error", "kind"), [
    (OSError(28, "No space left on device"), "the disk is full (ENOSPC)"),
    (PermissionError(13, "Permission denied"), "permission denied (EACCES)"),
    (OSError(24, "Too many open files"), "too many open files (EMFILE)"),
    (OSError(30, "Read-only file system"), "read-only (EROFS)"),
    (MemoryError(), "out of memory"),
    (AttributeError("Can't pickle local object 'f.<locals>.<lambda>'"), "cannot be saved (client_state"),
    (__import__("pickle").PicklingError("Can't pickle <function <lambda>>"), "cannot be saved (client_state"),
    (KeyError("exp_avg"), "probably a bug: the full traceback is in this rank's log"),
    (CheckpointFormatError("bad"), "refused"),
])
def test_failure_kind_names_the_environment_the_data_or_a_bug(error, kind):
    from zero_bnb.errors import failure_kind

    assert kind in failure_kind(error)


@pytest.mark.parametrize(("raised", "kind"), [
    (PermissionError(13, "Permission denied"), "permission denied (EACCES)"),
    (OSError(24, "Too many open files"), "too many open files (EMFILE)"),
    (MemoryError(), "out of memory"),
])
def test_safe_load_reports_a_machine_failure_as_such_not_as_a_damaged_file(tmp_path, monkeypatch, raised, kind):
    """Running as root here, chmod cannot make a file unreadable: torch.load raises what the OS would."""
    from zero_bnb.errors import CheckpointError
    from zero_bnb.format.unpickle import safe_load

    path = tmp_path / "shard.pt"
    torch.save({"x": torch.zeros(3)}, path)

    def refuse(*args, **kwargs):
        raise raised

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(CheckpointError) as caught:
        safe_load(str(path), "shard file")
    assert type(caught.value) is CheckpointError and caught.value.__cause__ is raised
    message = str(caught.value)
    assert kind in message and "damaged" not in message and "says nothing about the file's content" in message


def test_safe_load_still_calls_a_truncated_file_damaged(tmp_path):
    from zero_bnb.format.unpickle import safe_load

    path = tmp_path / "shard.pt"
    torch.save({"x": torch.zeros(300)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointCorruptError, match="the file is damaged"):
        safe_load(str(path), "shard file")


# -- pinned folders ------------------------------------------------------------------------------


def test_a_pinned_folder_with_more_files_than_it_holds_open_still_reads_only_the_pinned_save(tmp_path):
    """Beyond MAX_HELD files (a save at DP > 253), files are opened relative to the pinned folder at each read:
    after a re-save replaced the folder they still read the old save, a planted link is refused, a file removed
    with the old folder reads as replaced (never as another save's bytes), and no descriptor is leaked."""
    import os

    from zero_bnb.errors import CheckpointFormatError, CheckpointReplacedError
    from zero_bnb.format.pinned import MAX_HELD, PinnedFolder

    count = MAX_HELD + 44
    tag = tmp_path / "tag"
    (tag / "sub").mkdir(parents=True)
    names = [f"sub/shard_{index}.pt" for index in range(count)]
    for index, name in enumerate(names):
        (tag / name).write_bytes(b"old %d" % index)
    descriptors = len(os.listdir("/proc/self/fd"))
    folder = PinnedFolder(str(tag))
    assert all(folder.exists(name) for name in names)
    assert len(os.listdir("/proc/self/fd")) - descriptors == MAX_HELD + 2  # the files held, the tag and sub folders
    os.rename(tag, tmp_path / "old")  # a re-save publishes a new folder under the same name
    (tag / "sub").mkdir(parents=True)
    for index, name in enumerate(names):
        (tag / name).write_bytes(b"new save %d" % index)
    for index, name in enumerate(names):
        assert folder.read(name) == b"old %d" % index, name
        assert folder.size(name) == len(b"old %d" % index)
        with folder.path_of(name) as path, open(path, "rb") as handle:
            assert handle.read() == b"old %d" % index, name
    late = names[-1]  # not held open
    os.remove(tmp_path / "old" / late)
    os.symlink(tag / late, tmp_path / "old" / late)
    with pytest.raises(CheckpointFormatError, match="symbolic link"):
        folder.read(late)
    os.remove(tmp_path / "old" / late)
    with pytest.raises(CheckpointReplacedError, match="replaced by a concurrent save"):
        folder.read(late)
    assert folder.read(names[0]) == b"old 0"  # held open: readable although the old folder is going away
    assert len(os.listdir("/proc/self/fd")) - descriptors == MAX_HELD + 2
    folder.close()
    assert len(os.listdir("/proc/self/fd")) == descriptors


def _signed(data: dict) -> str:
    """Manifest JSON ``data`` with a valid self-checksum, as anyone can write it."""
    import hashlib

    data = {key: value for key, value in data.items() if key != "manifest_sha256"}
    text = json.dumps({"manifest_sha256": "0" * 64, **data}, indent=1)
    return text.replace("0" * 64, hashlib.sha256(text.encode("utf-8")).hexdigest(), 1)


@pytest.mark.parametrize("field,value", [("files", -1), ("groups", 7), ("module_file", 3)])
def test_a_re_signed_manifest_with_a_scalar_for_a_list_is_refused_not_crashed_on(field, value):
    data = json.loads(_manifest().to_json())
    data[field] = value
    with pytest.raises(CheckpointFormatError, match=f"{field} must be"):
        Manifest.from_json(_signed(data))


def test_derived_masters_need_a_listed_module_file_and_a_known_storage():
    derived = _manifest().groups[0].__class__(**{**{f: getattr(_manifest().groups[0], f) for f in (
        "numel", "params", "states", "element_ranges", "block_ranges", "hyperparameters")}, "masters": "module+low16"})
    with pytest.raises(CheckpointFormatError, match="module_file.*is not listed in the manifest's files"):
        _manifest(groups=(derived,)).validate()
    _manifest(groups=(derived,), module_file="zero_bnb/shard_00000-of-00001.pt").validate()  # listed: accepted
    data = json.loads(_manifest().to_json())
    data["groups"][0]["masters"] = "fp8"
    with pytest.raises(CheckpointFormatError, match=r"masters='fp8' is invalid: it must be one of"):
        Manifest.from_json(_signed(data))


def test_safe_load_reads_numpy_random_state_in_deepspeed_files_and_nothing_more(tmp_path):
    """A curriculum data sampler pickles numpy.random.get_state() (an array) into DeepSpeed's model file."""
    import numpy

    from zero_bnb.format.unpickle import safe_load

    path = tmp_path / "mp_rank_00_model_states.pt"
    state = numpy.random.RandomState(5).get_state()
    torch.save({"np_rng_state": state, "step": numpy.int64(3), "half": numpy.arange(4, dtype=numpy.float16)}, path)
    loaded = safe_load(str(path), "DeepSpeed model file", deepspeed_classes=True)
    assert loaded["np_rng_state"][0] == "MT19937" and numpy.array_equal(loaded["np_rng_state"][1], state[1])
    assert loaded["step"] == 3 and loaded["half"].dtype == numpy.float16
    # zero_bnb's own files never hold NumPy objects: refused there, naming the class and the way to allow it.
    with pytest.raises(CheckpointFormatError, match=r"multiarray\._reconstruct.*add_safe_globals"):
        safe_load(str(path), "shard file")
    # Object arrays stay refused, named by their dtype class (not called a damaged file).
    torch.save({"objects": numpy.array([None, 1], dtype=object)}, path)
    with pytest.raises(CheckpointFormatError, match=r"class numpy\.dtypes\.ObjectDType.*add_safe_globals"):
        safe_load(str(path), "DeepSpeed model file", deepspeed_classes=True)


# -- private folders of staged files ---------------------------------------------------------------


def test_a_killed_writers_private_folder_is_removed_by_the_next_writer_and_a_live_ones_is_not(tmp_path, caplog):
    """A writer killed mid-write (SIGKILL, no cleanup) leaves ``.NAME.XXXX.zero_bnb-tmp``; the next StagedFile of NAME
    removes it, but never the folder of a writer that still runs (it holds the folder's flock); without flock support
    nothing is removed and the warning names the folder and the command."""
    import logging
    import os
    import signal

    from zero_bnb.format import publish

    destination = str(tmp_path / "w.safetensors")
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:  # the other writer: stages a file, reports its folder, then waits to be killed
        try:
            staged = publish.StagedFile(destination)
            open(staged.path, "w").write("partial")
            os.write(ready_write, staged.folder.encode())
            signal.pause()
        finally:
            os._exit(1)
    try:
        os.close(ready_write)
        folder = os.read(ready_read, 4096).decode()
        assert os.path.basename(folder).startswith(".w.safetensors.") and os.path.isdir(folder), folder
        with publish.replacing(destination) as temporary:  # while the other writer lives
            open(temporary, "w").write("mine")
        assert os.path.isdir(folder) and open(os.path.join(folder, "w.safetensors")).read() == "partial"
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    (tmp_path / ".w.safetensors.x.y.zero_bnb-tmp").mkdir()  # not a name StagedFile gives: left alone
    (tmp_path / ".w.safetensors.link.zero_bnb-tmp").symlink_to(tmp_path / "elsewhere")
    original, publish.try_flock = publish.try_flock, lambda descriptor, operation: False  # NFS without lockd
    try:
        with caplog.at_level(logging.WARNING, logger="zero_bnb.format.publish"):
            publish.StagedFile(destination).discard()
    finally:
        publish.try_flock = original
    assert os.path.isdir(folder) and f"rm -rf {folder!r}" in caplog.text, caplog.text
    with publish.replacing(destination) as temporary:
        open(temporary, "w").write("after the kill")
    assert sorted(os.listdir(tmp_path)) == [".w.safetensors.link.zero_bnb-tmp", ".w.safetensors.x.y.zero_bnb-tmp",
                                            "w.safetensors"]
    assert open(destination).read() == "after the kill"


def test_staged_files_are_written_where_a_folder_cannot_be_flocked_exclusively(tmp_path, monkeypatch, caplog):
    """Linux's NFS client emulates flock by a byte-range lock, whose exclusive form needs a descriptor open for
    writing: on a folder (read-only) it fails with EBADF. Writes (``latest``, tool outputs) still succeed; a killed
    writer's folder is left, named in a warning with the command to remove it."""
    import errno
    import fcntl
    import logging
    import os

    from zero_bnb.format import publish

    real_flock = fcntl.flock

    def nfs_flock(descriptor, operation):  # what nfs4_proc_lock answers for a write lock on a read-only open
        if operation & fcntl.LOCK_EX and fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real_flock(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    left = tmp_path / ".latest.k1ll3d.zero_bnb-tmp"
    left.mkdir()
    with caplog.at_level(logging.WARNING, logger="zero_bnb.format.publish"):
        publish.replace_text("global_step7", str(tmp_path / "latest"))
    assert (tmp_path / "latest").read_text() == "global_step7"
    assert left.is_dir() and f"rm -rf {str(left)!r}" in caplog.text, caplog.text
    assert sorted(os.listdir(tmp_path)) == [left.name, "latest"]


def test_the_consolidated_view_refuses_step_counters_that_differ_between_ranks():
    # issue 44: the counters used to be read from rank 0 alone, so a rank that skipped a step passed every check
    from zero_bnb.testing.consolidate import _agreed

    assert _agreed([3, 3, None], "step") == 3  # None: a rank whose partition of the group is empty
    assert torch.equal(_agreed([torch.tensor(2.0), torch.tensor(2.0)], "step"), torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"group 0's 'step' differs between the data-parallel ranks: \[3, 2\]"):
        _agreed([3, 2], "group 0's 'step'")
    with pytest.raises(ValueError, match="differs"):
        _agreed([torch.tensor(2.0), 2.0], "step")
