"""SIGKILL at every phase of a save, and byte-level corruption of every file of a checkpoint."""

from __future__ import annotations

import json
import logging
import os
import shutil
from itertools import pairwise

import fault_injection
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zero_bnb import verify_checkpoint
from zero_bnb.errors import CheckpointError
from zero_bnb.testing.launch import run_distributed

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=65)]

logger = logging.getLogger(__name__)


def kill_points(events: list[dict[str, list[list[str]]]]) -> list[dict]:
    """Kill trials: the first I/O step of every phase (a run of identical steps) and one step inside every longer
    run, for each rank and save mode; for an asynchronous save, whose I/O is a synchronous save's run in the
    background, the first occurrence of each distinct step (the same operation on the same file)."""
    trials = []
    for victim, per_mode in enumerate(events):
        for mode, steps in per_mode.items():
            starts = [i for i in range(len(steps)) if i == 0 or steps[i] != steps[i - 1]]
            if mode.startswith("async"):
                starts = [i for i in starts if steps[i] not in steps[:i]]
            inside = [] if mode.startswith("async") else [
                (a + b) // 2 for a, b in pairwise([*starts, len(steps)]) if b - a > 2]
            trials += [{"mode": mode, "victim": victim, "index": i, "step": steps[i]} for i in sorted({*starts, *inside})]
    return trials


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("kill"))
    run_distributed(fault_injection.reference, 2, workdir)
    with open(os.path.join(workdir, "events.json")) as handle:
        trials = kill_points(json.load(handle))
    results = fault_injection.run_trials(workdir, trials)
    folders = [result["folder"] for result in results]
    run_distributed(fault_injection.verify, 3, workdir, folders)
    with open(os.path.join(workdir, "verified.json")) as handle:
        verified = json.load(handle)
    return workdir, results, verified


def test_killing_a_rank_at_any_step_of_a_save_leaves_the_previous_or_the_new_checkpoint(campaign):
    _, results, verified = campaign
    distinct = {(r["mode"], r["victim"], r["index"]) for r in results}
    # Measured 93 distinct points of synchronous saves (2026-11-23, 92 before the previous folder was renamed before
    # its removal; the count follows the save's I/O steps), and 32 of an asynchronous one (2026-11-27);
    # docs/checkpoints.md claims at least 70 and 30.
    assert sum(not mode.startswith("async") for mode, _, _ in distinct) >= 70, f"only {len(distinct)} kill points"
    assert sum(mode.startswith("async") for mode, _, _ in distinct) >= 30, f"only {len(distinct)} kill points"
    killed = [r for r in results if r["status"][str(r["victim"])] == "SIGKILL"]
    assert len(killed) == len(results), [r for r in results if r not in killed][:3]
    outcomes = {folder: verified.get(folder) for folder in (r["folder"] for r in results)}
    wrong = {folder: outcome for folder, outcome in outcomes.items() if outcome not in ("A", "B")}
    assert not wrong, wrong
    for result in results:  # what a reader finds is exactly what 'latest' and the folders claim
        folder = result["folder"]
        with open(os.path.join(folder, "latest")) as handle:
            latest = handle.read()
        # A new tag: 'latest' moves to B only once B is complete. A re-saved tag: 'latest' stays A, and
        # folder A holds either the previous state or the new one, never a mix.
        assert latest == ("A" if result["mode"].endswith("overwrite") else outcomes[folder]), (result, latest)
        for tag in (name for name in os.listdir(folder) if not name.startswith(".")):
            if os.path.isdir(os.path.join(folder, tag)):
                verify_checkpoint(folder, tag)  # every visible folder is complete
    counts = {state: sum(outcome == state for outcome in outcomes.values()) for state in ("A", "B")}
    assert counts["A"] and counts["B"], counts
    logger.info("kill points: %d, resumed from previous: %d, from new: %d", len(distinct), counts["A"], counts["B"])


_FILES = ["latest", "A/mp_rank_00_model_states.pt", "A/zero_bnb/manifest.json", "A/zero_bnb/replicated.pt",
          "A/zero_bnb/shard_00000-of-00002.pt", "A/zero_bnb/shard_00001-of-00002.pt"]


def test_every_byte_flip_and_truncation_of_every_file_is_detected(campaign, tmp_path):
    workdir = campaign[0]
    folder = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(workdir, "base"), folder)
    verify_checkpoint(folder)
    originals = {}
    for name in _FILES:
        with open(os.path.join(folder, name), "rb") as handle:
            originals[name] = handle.read()
    tally = {"tried": 0, "detected": 0}

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(name=st.sampled_from(_FILES), data=st.data())
    def corrupt(name, data):
        original = originals[name]
        if data.draw(st.booleans(), label="truncate"):
            damaged = original[: data.draw(st.integers(0, len(original) - 1), label="length")]
        else:
            position = data.draw(st.integers(0, len(original) - 1), label="position")
            bit = data.draw(st.integers(0, 7), label="bit")
            damaged = original[:position] + bytes([original[position] ^ (1 << bit)]) + original[position + 1 :]
        path = os.path.join(folder, name)
        with open(path, "wb") as handle:
            handle.write(damaged)
        try:
            tally["tried"] += 1
            with pytest.raises(CheckpointError) as caught:
                verify_checkpoint(folder)
            tally["detected"] += 1
            assert os.path.basename(name) in str(caught.value), caught.value
        finally:
            with open(path, "wb") as handle:
                handle.write(original)

    corrupt()
    assert tally["tried"] >= 300 and tally["detected"] == tally["tried"], tally
    logger.info("corruptions tried: %d, detected: %d", tally["tried"], tally["detected"])
