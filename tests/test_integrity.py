"""Checkpoints that never lie: damaged input, failing saves, NaN state (one real DP=2 launch)."""

from __future__ import annotations

import hashlib
import json
import os

import blake3
import pytest
import torch
from integrity_scenarios import DAMAGES, SAVE_FAILURES, integrity
from scenarios import result

from zero_bnb.format import digests
from zero_bnb.testing.launch import run_distributed

pytestmark = pytest.mark.launch

EXPECTED = {
    "flipped_shard_of_rank_1": ("CheckpointCorruptError", f"zero_bnb/shard_00001-of-00002.pt ({digests.writing_algorithm()}",
                                "differs from what was saved"),
    "truncated_replicated": ("CheckpointCorruptError", "zero_bnb/replicated.pt has", "truncated"),
    "flipped_model_states": ("CheckpointCorruptError", f"mp_rank_00_model_states.pt ({digests.writing_algorithm()}",),
    "flipped_manifest": ("CheckpointCorruptError", "manifest.json",),
    "missing_rank_file": ("CheckpointCorruptError", "zero_bnb/shard_00001-of-00002.pt is missing", "load an earlier tag"),
    "damaged_latest": ("CheckpointFormatError", "latest is damaged", "pass tag= explicitly"),
    "latest_names_missing_tag": ("CheckpointFormatError", "'global_step99'", "does not exist", "tags in", "['A']"),
    "unknown_format_version": ("CheckpointFormatError", "format_version=99", "reads versions [1, 2, 3, 4]"),
    "other_block_size": ("CheckpointMismatchError", "block size is 128, the optimizer's 256"),
    "wrong_model": ("CheckpointMismatchError", "4.weight: saved (90, 96), model (91, 96)", "4.bias"),
    "amsgrad_mismatch": ("CheckpointMismatchError", "group 0 was saved with amsgrad=False", "amsgrad=True"),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("integrity")
    run_distributed(integrity, 2, str(workdir))
    return torch.load(workdir / "integrity.pt", weights_only=False)


def _same_on_every_rank(ranks, key):
    return result(ranks, key)


@pytest.mark.parametrize("case", [*DAMAGES, "wrong_model", "amsgrad_mismatch"])
def test_bad_checkpoints_are_refused_on_every_rank_with_a_clear_error(ranks, case):
    message = _same_on_every_rank(ranks, case)
    assert message is not None, f"{case} was loaded silently"
    name, *parts = EXPECTED[case]
    assert message.startswith(name + ":"), message
    for part in parts:
        assert part in message, (part, message)


def test_failed_loads_leave_the_engine_unchanged(ranks):
    assert result(ranks[:1], "state_changes") == []
    assert result(ranks, "weights_changed") == []
    engine_loss, twin_loss = result(ranks, "losses_after_failed_loads")  # trains on exactly like a twin
    assert engine_loss == twin_loss and len(engine_loss) == 1, (engine_loss, twin_loss)


@pytest.mark.parametrize("failure", SAVE_FAILURES, ids=lambda f: ":".join(map(str, f[:3])))
def test_a_save_failing_on_one_rank_fails_everywhere_and_keeps_the_previous_checkpoint(ranks, failure):
    label = "save_error:{}:{}:{}".format(*failure[:3])
    message = _same_on_every_rank(ranks, label)
    assert message is not None and message.startswith("CheckpointSaveError:"), message
    assert "injected: no space left on device" in message and f"rank(s) [{failure[0]}]" in message
    assert "[the disk is full (ENOSPC): free space or save elsewhere]" in message  # the kind, not a guess
    assert "the previous checkpoint and 'latest' are unchanged" in message
    assert _same_on_every_rank(ranks, label + ":listing") == (["A", "latest", "zero_to_fp32.py"], "A")


def test_saving_works_again_after_failed_saves(ranks):
    assert _same_on_every_rank(ranks, "a_after_errors") is None
    assert _same_on_every_rank(ranks, "save_after_errors") is None
    assert _same_on_every_rank(ranks, "verify_after_errors") is None
    assert _same_on_every_rank(ranks, "listing_after_errors") == (["A", "D", "latest", "zero_to_fp32.py"], "D")


def test_replicated_key_named_in_config_but_differing_is_refused(ranks):
    message = _same_on_every_rank(ranks, "replicated_by_name")
    assert message.startswith("ReplicatedStateMismatch:")
    for part in ("'absmax1'", "zero_unsharded_state_keys", "remove it from zero_unsharded_state_keys", "rank(s) [1]",
                 "Nothing was saved"):
        assert part in message, part
    assert result(ranks, "replicated_by_name_listing") in (None, []), "nothing may be written"


def test_nan_in_master_weights_is_reported_by_parameter_name(ranks):
    parameter = _same_on_every_rank(ranks, "nan_param")
    message = _same_on_every_rank(ranks, "nan_error")
    assert message.startswith("NonFiniteStateError:") and f"{parameter}: fp32" in message, message
    assert "zero_nonfinite_check" in message
    assert "nan" not in _same_on_every_rank(ranks, "nan_listing")[0]
    assert _same_on_every_rank(ranks, "nan_warn") is None
    assert _same_on_every_rank(ranks, "nan_manifest") == {parameter: ["fp32"]}


def test_an_unpicklable_client_state_is_named_as_such_with_its_cause_chained(ranks):
    message = _same_on_every_rank(ranks, "unpicklable")
    assert message.startswith("CheckpointSaveError:") and "rank(s) [0]" in message, message  # rank 0 writes it
    assert "[an object that cannot be saved (client_state" in message and "disk" not in message, message
    # The rank that failed chains its own exception (the traceback is logged there); the others only read about it.
    causes = [ranks[rank][f"unpicklable_cause:{rank}"] for rank in range(2)]
    assert causes[0] in ("PicklingError", "AttributeError") and causes[1] is None, causes
    assert _same_on_every_rank(ranks, "unpicklable_listing") == (["A", "D", "latest", "nan", "zero_to_fp32.py"], "D")


def test_nonfinite_check_off_saves_nan_unrecorded_and_a_nan_checkpoint_warns_on_load(ranks):
    assert _same_on_every_rank(ranks, "nan_off") is None
    assert _same_on_every_rank(ranks, "nan_off_manifest") == {}
    assert _same_on_every_rank(ranks, "nan_load") is None
    parameter = _same_on_every_rank(ranks, "nan_param")
    warnings = ranks[0]["nan_load_warnings:0"]
    assert len(warnings) == 1 and "was saved with NaN/Inf in" in warnings[0] and parameter in warnings[0], warnings
    assert ranks[1]["nan_load_warnings:1"] == []  # rank 0 warns once for the job


def test_checkpoint_verify_false_skips_only_the_checksums(ranks):
    assert _same_on_every_rank(ranks, "unverified:flipped_shard_of_rank_1") is None  # a changed byte goes unseen
    message = _same_on_every_rank(ranks, "unverified:truncated_replicated")  # size and format checks still run
    assert message.startswith("CheckpointCorruptError:") and "truncated" in message, message


# -- digests: BLAKE3 where the package is, SHA-256 and format 3 still read ----------------------------------------------

_PACKAGES = {"blake3": lambda data: blake3.blake3(data).hexdigest(), "sha256": lambda data: hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("tag", ["blake3", "sha256", "format3"])
def test_every_recorded_digest_is_the_packages_digest_of_the_bytes(ranks, tag):
    """Recomputed here with the ``blake3`` package and hashlib, from the bytes on disk: every file the manifest lists,
    and every module-weight piece a shard binds its derived masters to (the ranges read from the manifest's JSON)."""
    algorithm = "sha256" if tag == "format3" else tag
    tag_folder = os.path.join(_same_on_every_rank(ranks, "digests_folder"), tag)
    with open(os.path.join(tag_folder, "zero_bnb", "manifest.json"), encoding="utf-8") as handle:
        manifest = json.load(handle)
    assert manifest["format_version"] == (3 if tag == "format3" else 4)
    for record in manifest["files"]:
        with open(os.path.join(tag_folder, record["path"]), "rb") as handle:
            content = handle.read()
        assert set(record) == {"path", "size", algorithm}, record
        assert (record["size"], record[algorithm]) == (len(content), _PACKAGES[algorithm](content)), record["path"]
    model = next(r for r in manifest["files"] if r["path"] == manifest["module_file"])
    assert manifest["module_sha256" if tag == "format3" else "module_digest"] == model[algorithm]
    module = torch.load(os.path.join(tag_folder, manifest["module_file"]), weights_only=False)["module"]
    pieces = 0
    for rank, shard in enumerate(manifest["shards"]):
        groups = torch.load(os.path.join(tag_folder, "zero_bnb", shard), weights_only=True)["groups"]
        for group, saved in zip(manifest["groups"], groups):
            assert group["masters"] == "module" and set(saved["masters"]) == {f"module_{algorithm}"}
            start, end = group["element_ranges"][rank]
            expected = {}
            for param in group["params"]:
                numel = module[param["name"]].numel()
                lo, hi = max(start, param["offset"]), min(end, param["offset"] + numel)
                if lo < hi:
                    flat = module[param["name"]].reshape(-1)[lo - param["offset"] : hi - param["offset"]]
                    expected[param["name"]] = _PACKAGES[algorithm](flat.contiguous().numpy().tobytes())
            assert saved["masters"][f"module_{algorithm}"] == expected
            pieces += len(expected)
    assert pieces >= len(manifest["groups"])


@pytest.mark.parametrize("tag", ["sha256", "format3", "blake3"])
def test_checkpoints_of_either_digest_and_format_3_verify_and_load_exactly(ranks, tag):
    assert _same_on_every_rank(ranks, f"digests:{tag}:verify") is None
    assert _same_on_every_rank(ranks, f"digests:{tag}:load") is None
    assert result(ranks[:1], f"digests:{tag}:differences") == []


def test_a_changed_byte_of_a_format_3_checkpoint_is_named_with_its_sha256(ranks):
    message = _same_on_every_rank(ranks, "digests:format3_flipped:load")
    assert message.startswith("CheckpointCorruptError:") and "shard_00001-of-00002.pt (sha256" in message, message


def test_a_blake3_checkpoint_where_the_package_is_missing_names_the_package_and_sha256_still_loads(ranks):
    for key in ("digests:blake3_without_package:load", "digests:blake3_without_package:verify"):
        message = _same_on_every_rank(ranks, key)
        assert message.startswith("CheckpointFormatError:") and "records BLAKE3 digests" in message, message
        assert "pip install 'blake3>=1.0,<2'" in message, message
    assert _same_on_every_rank(ranks, "digests:sha256_without_package:load") is None
