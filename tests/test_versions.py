"""Supported dependency ranges: one table (zero_bnb.versions.SUPPORTED), the same in pyproject.toml and the
default environment, and the check zero_bnb.initialize makes (refuse known-broken, warn once for untested)."""

from __future__ import annotations

import logging
import os
import tomllib
from importlib import metadata

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zero_bnb
from zero_bnb import versions
from zero_bnb.versions import SUPPORTED, UnsupportedVersionError, check_supported, release

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared() -> dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return {req.split(">=")[0]: req for req in requirements if ">=" in req}


def test_pyproject_declares_the_supported_table():
    declared = _declared()
    for name, entry in SUPPORTED.items():
        assert declared[name] == entry.requirement, f"pyproject.toml has {declared[name]!r}, the table {entry.requirement!r}"


def test_the_default_environment_is_the_newest_tested_release_of_each():
    with open(os.path.join(ROOT, "scripts", "defaults.txt"), encoding="utf-8") as handle:
        pins = dict(line.strip().split("==") for line in handle if "==" in line and not line.startswith("#"))
    assert pins == {name: entry.newest for name, entry in SUPPORTED.items() if name != "torch"}
    assert release(torch.__version__) == release(SUPPORTED["torch"].newest)  # the one CPU wheel (scripts/setup.sh)


def test_installed_releases_are_inside_the_tested_range():
    """Holds in every cell of scripts/compat.sh: each cell installs releases the table lists as tested."""
    assert check_supported(optional=("transformers", "accelerate", "lightning")) == []


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=5), st.sampled_from(["", "+cpu", "rc1", ".dev0", "a0+git1"]))
def test_release_reads_the_numeric_part_of_any_version(parts, suffix):
    assert release(".".join(map(str, parts)) + suffix) == tuple(parts)


def test_release_refuses_a_version_without_a_number():
    with pytest.raises(ValueError, match="'unknown'"):
        release("unknown")


def test_a_known_broken_release_is_refused_naming_version_range_cause_and_fix():
    with pytest.raises(UnsupportedVersionError) as caught:
        check_supported({"bitsandbytes": "0.49.2"})
    message = str(caught.value)
    for part in ("bitsandbytes 0.49.2 is installed", "bitsandbytes>=0.50.0", "tested 0.50.0 to 0.50.2",
                 "no CPU update", "pip install 'bitsandbytes>=0.50.0,<0.51'"):
        assert part in message, message
    with pytest.raises(UnsupportedVersionError, match="torch 2.4.1.*safe_globals.*pip install 'torch>=2.6,<3'"):
        check_supported({"torch": "2.4.1+cu121"})


def test_untested_releases_warn_once_per_process(caplog):
    caplog.set_level(logging.WARNING, logger="zero_bnb.versions")
    newer = {"deepspeed": "0.19.9", "transformers": "5.30.0.dev0"}
    first = check_supported(newer)
    assert len(first) == 2 and "deepspeed 0.19.9 is newer than the newest release" in first[0]
    assert "tested 0.17.0 to 0.19.8" in first[0] and "pip install 'deepspeed>=0.17.0,<0.20'" in first[0]
    assert "zero_bnb[hf]" in first[1]
    assert check_supported(newer) == first  # returned every time, logged once
    assert [r.getMessage() for r in caplog.records].count(f"zero_bnb: {first[0]}") == 1
    older = check_supported({"deepspeed": "0.16.9"})  # older than tested, but no known failure: a warning only
    assert len(older) == 1 and "older than the oldest release" in older[0]


def test_initialize_refuses_a_known_broken_release_before_deepspeed_starts(monkeypatch):
    real = metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda name: "0.45.5" if name == "bitsandbytes" else real(name))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedVersionError, match="bitsandbytes 0.45.5 is installed"):
        zero_bnb.initialize(model=model, optimizer=optimizer, config={"train_batch_size": 2,
                                                                        "zero_optimization": {"stage": 1}})
    assert not torch.distributed.is_initialized()  # nothing was started


def test_an_untested_release_is_logged_by_rank_0_only(caplog, monkeypatch):
    # Issue 34: unpinned, every rank of a job printed the same warning about transformers.
    from zero_bnb import versions

    caplog.set_level(logging.WARNING, logger="zero_bnb.versions")
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setenv("RANK", "1")
    assert len(check_supported({"transformers": "5.99.0"})) == 1
    assert not caplog.records
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setenv("RANK", "0")
    check_supported({"transformers": "5.99.0"})
    assert len(caplog.records) == 1
