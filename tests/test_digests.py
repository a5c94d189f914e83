"""Checkpoint digests (zero_bnb.format.digests): BLAKE3 where the package is installed, SHA-256 without it, and
manifests that name each digest's algorithm (format version 4) beside version-3 ones that hold SHA-256 only.
In-process; the engine's saves and loads of both are checked in tests/test_integrity.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import blake3
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_bnb.errors import CheckpointFormatError
from zero_bnb.format import digests, durable
from zero_bnb.format.durable import FileRecord
from zero_bnb.format.manifest import FORMAT_VERSION, Manifest
from zero_bnb.format.masters import MODULE, MODULE_LOW16, DerivedMasters, derive, derived_problems, piece_digest


def test_blake3_is_what_a_process_with_the_package_writes_and_sha256_what_one_without_it_writes(monkeypatch, caplog):
    assert digests.writing_algorithm() == digests.BLAKE3
    monkeypatch.setattr(digests, "_blake3", None)
    monkeypatch.setattr(digests, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="zero_bnb"):
        assert digests.writing_algorithm() == digests.writing_algorithm() == digests.SHA256
    warnings = [r.getMessage() for r in caplog.records if "blake3" in r.getMessage()]
    assert len(warnings) == 1 and "pip install 'blake3>=1.0,<2'" in warnings[0], warnings  # said once


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=3 << 20), threads=st.integers(1, 8))
def test_hashing_in_pieces_or_with_threads_gives_the_packages_digest(data, threads):
    assert digests.hexdigest(digests.SHA256, data) == hashlib.sha256(data).hexdigest()
    assert digests.hexdigest(digests.BLAKE3, data, threads=threads) == blake3.blake3(data).hexdigest()
    for algorithm, package in ((digests.SHA256, hashlib.sha256), (digests.BLAKE3, blake3.blake3)):
        hasher = digests.new(algorithm, threads=threads)
        digests.update_large(hasher, algorithm, memoryview(data), threads=threads)
        assert hasher.hexdigest() == package(data).hexdigest()


@pytest.mark.parametrize(("cores", "variable", "ranks", "threads"), [
    (2, "LOCAL_WORLD_SIZE", "1", 1), (3, "LOCAL_WORLD_SIZE", "1", 1), (4, "LOCAL_WORLD_SIZE", "1", 3),
    (16, "LOCAL_WORLD_SIZE", "1", 8), (16, "LOCAL_WORLD_SIZE", "8", 1), (16, "LOCAL_WORLD_SIZE", "4", 3),
    (64, "LOCAL_WORLD_SIZE", "8", 7), (8, None, None, 7),
    (16, "LOCAL_SIZE", "8", 1), (16, "OMPI_COMM_WORLD_LOCAL_SIZE", "8", 1),  # DeepSpeed's launcher, Open MPI
    (16, "LOCAL_WORLD_SIZE", "garbage", 1), (16, "LOCAL_WORLD_SIZE", "0", 1), (16, "LOCAL_WORLD_SIZE", "-5", 1),
    (16, "LOCAL_WORLD_SIZE", "2.0", 1), (16, "LOCAL_WORLD_SIZE", "1e9", 1), (16, "LOCAL_WORLD_SIZE", "1000000000", 1),
])
def test_blake3_threads_only_where_this_ranks_share_of_the_cores_leaves_two_idle(monkeypatch, cores, variable, ranks,
                                                                               threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if variable is not None:
        monkeypatch.setenv(variable, ranks)
    assert digests.spare_threads() == threads


def test_unknown_algorithms_and_a_missing_package_are_named(monkeypatch):
    with pytest.raises(CheckpointFormatError, match=r"algorithm 'md5'.*knows \['sha256', 'blake3'\]"):
        digests.new("md5")
    monkeypatch.setattr(digests, "_blake3", None)
    with pytest.raises(CheckpointFormatError, match=r"x\.pt records BLAKE3 digests.*pip install 'blake3>=1\.0,<2'"):
        digests.new(digests.BLAKE3, what="x.pt")
    assert digests.new(digests.SHA256).hexdigest() == hashlib.sha256().hexdigest()


@pytest.mark.parametrize("algorithm", digests.ALGORITHMS)
def test_a_written_file_records_its_writers_algorithm(tmp_path, monkeypatch, algorithm):
    monkeypatch.setattr(digests, "writing_algorithm", lambda: algorithm)
    payload = {"w": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB: hashed beside the write
    record = durable.save_torch(payload, str(tmp_path / "a.pt"), root=str(tmp_path))
    content = (tmp_path / "a.pt").read_bytes()
    package = blake3.blake3 if algorithm == digests.BLAKE3 else hashlib.sha256
    assert (record.algorithm, record.size, record.digest) == (algorithm, len(content), package(content).hexdigest())


def _manifest(files) -> Manifest:
    from test_units import _manifest as base

    return dataclasses.replace(base(), files=tuple(files))


def test_a_manifest_names_each_files_algorithm_and_reads_back_equal():
    files = [FileRecord("zero_bnb/shard_00000-of-00001.pt", 12, "ab" * 32, digests.BLAKE3),
             FileRecord("mp_rank_00_model_states.pt", 7, "cd" * 32, digests.SHA256)]
    manifest = _manifest(files)
    text = manifest.to_json()
    data = json.loads(text)
    assert data["format_version"] == 4
    assert data["files"] == [{"path": "zero_bnb/shard_00000-of-00001.pt", "size": 12, "blake3": "ab" * 32},
                             {"path": "mp_rank_00_model_states.pt", "size": 7, "sha256": "cd" * 32}]
    assert Manifest.from_json(text) == manifest


def _signed(data: dict) -> str:
    data = {key: value for key, value in data.items() if key != "manifest_sha256"}
    text = json.dumps({"manifest_sha256": "0" * 64, **data}, indent=1)
    return text.replace("0" * 64, hashlib.sha256(text.encode("utf-8")).hexdigest(), 1)


@pytest.mark.parametrize(("version", "entry", "accepted"), [
    (4, {"blake3": "ab" * 32}, True),
    (4, {"sha256": "ab" * 32}, True),
    (3, {"sha256": "ab" * 32}, True),
    (3, {"blake3": "ab" * 32}, False),  # version 3 holds SHA-256 only
    (4, {"md5": "ab" * 16}, False),
    (4, {"sha256": "ab" * 32, "blake3": "ab" * 32}, False),
    (4, {}, False),
    (4, {"blake3": "AB" * 32}, False),
    (4, {"blake3": "ab" * 31}, False),
    (4, {"blake3": 7}, False),
])
def test_file_records_must_name_one_known_algorithm_with_a_hex_digest(version, entry, accepted):
    data = json.loads(_manifest([FileRecord("zero_bnb/shard_00000-of-00001.pt", 12, "ab" * 32)]).to_json())
    data["format_version"] = version
    if version < 4:
        del data["module_digest"]  # module_sha256 then
    data["files"] = [{"path": "zero_bnb/shard_00000-of-00001.pt", "size": 12, **entry}]
    if accepted:
        (algorithm, digest), = entry.items()
        record = Manifest.from_json(_signed(data)).files[0]
        assert (record.algorithm, record.digest) == (algorithm, digest)
    else:
        with pytest.raises(CheckpointFormatError, match=r"files\[0\]"):
            Manifest.from_json(_signed(data))


def test_a_derived_groups_piece_digests_name_their_algorithm_and_read_back(monkeypatch):
    from zero_bnb.format.manifest import ParamEntry

    params = (ParamEntry("a", (5,), 0), ParamEntry("b", (7,), 5))
    weight = torch.arange(12, dtype=torch.float32)
    for algorithm, package in ((digests.BLAKE3, blake3.blake3), (digests.SHA256, hashlib.sha256)):
        monkeypatch.setattr(digests, "writing_algorithm", lambda algorithm=algorithm: algorithm)
        derived = derive(MODULE, weight, weight, params, 0, 12)
        data = derived.to_dict()
        assert data == {f"module_{algorithm}": {"a": package(weight[:5].numpy().tobytes()).hexdigest(),
                                                "b": package(weight[5:].numpy().tobytes()).hexdigest()}}
        assert derived_problems(data, MODULE, 12, FORMAT_VERSION) == []
        assert bool(derived_problems(data, MODULE, 12, 3)) == (algorithm == digests.BLAKE3)  # SHA-256 only before 4
        assert DerivedMasters.from_dict(data) == derived and derived.algorithm == algorithm
        assert piece_digest(weight[:5], algorithm) == data[f"module_{algorithm}"]["a"]
    for bad in ({"module_sha256": {}, "module_blake3": {}}, {"module_md5": {}}, {"module_blake3": {"a": "AB" * 32}},
                {"module_blake3": {"a": "ab" * 31}}, {"module_blake3": {"a": 7}}, {"module_blake3": {}, "junk": 1}):
        assert derived_problems(bad, MODULE, 12, 4), bad
    low16 = {"module_blake3": {}, "low16": torch.zeros(12, dtype=torch.int16),
             "exception_index": torch.zeros(0, dtype=torch.int64), "exception_value": torch.zeros(0)}
    assert derived_problems(low16, MODULE_LOW16, 12, 4) == []
    assert derived_problems({**low16, "module_md5": {}}, MODULE_LOW16, 12, 4)  # no key beyond the four


@pytest.mark.parametrize(("version", "field", "accepted"), [
    (4, "module_digest", True), (4, "module_sha256", False), (3, "module_sha256", True), (3, "module_digest", False),
])
def test_the_model_files_digest_is_named_as_its_format_version_names_it(version, field, accepted):
    data = json.loads(_manifest([FileRecord("mp_rank_00_model_states.pt", 7, "cd" * 32)]).to_json())
    del data["module_digest"]
    data.update({"format_version": version, "module_file": "mp_rank_00_model_states.pt", field: "cd" * 32})
    data["files"] = [{"path": "mp_rank_00_model_states.pt", "size": 7, "sha256": "cd" * 32},
                     {"path": "zero_bnb/shard_00000-of-00001.pt", "size": 12, "sha256": "ab" * 32}]
    if accepted:
        assert Manifest.from_json(_signed(data)).module_digest == "cd" * 32
        with pytest.raises(CheckpointFormatError, match="module_digest=.*64 lowercase hex digits"):
            Manifest.from_json(_signed({**data, field: "CD" * 32}))
    else:
        with pytest.raises(CheckpointFormatError, match=f"{field} is not a field of format version {version}"):
            Manifest.from_json(_signed(data))
