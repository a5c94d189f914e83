"""Preemption through every front door: the whole job SIGKILLed at each distinct I/O step of a save (zero_bnb's files
and the front door's own), synchronous and asynchronous, then the front door's own automatic resume at DP=3
(``tests/front_door_kills.py`` runs the campaigns; the plain engine's is ``tests/test_faults.py``)."""

from __future__ import annotations

import logging

import front_door_kills as kills
import pytest
from front_door_kills import FIRST, SECOND, STEPS
from scenarios import within, worst_relative
from test_front_doors_hf import RESUMED_BOUND
from test_front_doors_lightning import LIGHTNING_BOUND

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=130)]

logger = logging.getLogger(__name__)

#: Resumed losses at DP=3 against the uninterrupted run at DP=2 (relative): the front doors' own resume bounds.
BOUNDS = {"trainer": RESUMED_BOUND, "accelerate": RESUMED_BOUND, "lightning": LIGHTNING_BOUND}
#: Kill points measured on 2026-11-29 (synchronous + asynchronous, both ranks): Trainer 58, Accelerate 46,
#: Lightning 62; the campaign must keep about these many (the count follows the saves' I/O steps).
MINIMUM_KILL_POINTS = {"trainer": 54, "accelerate": 42, "lightning": 58}


@pytest.fixture(scope="module")
def campaigns(tmp_path_factory):
    return kills.run_campaigns(str(tmp_path_factory.mktemp("front_door_kills")), list(kills.DOORS))


def _expected(campaign: dict, trial: dict, door: kills.Door) -> set[int]:
    """The steps a trial may resume from: rank 0's kill points are ordered against the step that completes the save
    under test (SECOND after it, FIRST up to it); rank 1's are not ordered against rank 0's, so either."""
    if trial["victim"] != 0:
        return {FIRST, SECOND}
    steps = [tuple(step) for step in campaign["reference"][trial["mode"]]["steps"]["0"]]
    return {SECOND} if steps.index(tuple(trial["step"])) > steps.index(door.complete_at) else {FIRST}


@pytest.mark.parametrize("door", list(kills.DOORS))
def test_a_job_killed_at_any_step_of_a_save_resumes_automatically_from_the_newest_complete_checkpoint(campaigns, door):
    campaign, spec = campaigns[door], kills.DOORS[door]
    trials = campaign["trials"]
    for mode, reference in campaign["reference"].items():
        assert set(reference["status"].values()) == {"exit 0"}, (mode, reference["status"])
        assert spec.complete_at in [tuple(step) for step in reference["steps"]["0"]], reference["steps"]["0"]
    assert len(trials) >= MINIMUM_KILL_POINTS[door], len(trials)
    assert {trial["mode"] for trial in trials} == set(kills.MODES)
    worst, outcomes = 0.0, {mode: set() for mode in kills.MODES}
    for trial in trials:
        label = (trial["mode"], trial["victim"], trial["step"], trial["folder"])
        assert set(trial["status"].values()) == {"SIGKILL"}, (label, trial["status"])  # the whole job died there
        resume = trial["resume"]
        assert set(resume["status"].values()) == {"exit 0"} and resume["result"], (label, resume)
        resumed = resume["result"]["resumed_from"]
        assert resumed in _expected(campaign, trial, spec), (label, resumed, trial["pick"])
        if door != "lightning":  # the folder the front door's finder picked is the one the resume loaded
            assert spec.step_of(trial["pick"]) == resumed, (label, trial["pick"], resumed)
        if resumed == SECOND:  # never a checkpoint that is not byte for byte the complete one
            assert trial["pick_content"] == campaign["reference"][trial["mode"]]["complete"][trial["pick"]], label
        else:  # the older checkpoint (Lightning: or last.ckpt, saved with it and not re-saved yet)
            assert trial["pick"] in (spec.first, *(["last.ckpt"] if door == "lightning" else [])), (label, trial["pick"])
        reference = campaign["reference"][trial["mode"]]["losses"]
        losses = resume["result"]["losses"]
        steps = [str(step) for step in range(resumed + 1, STEPS + 1)]
        assert sorted(losses, key=int) == steps, (label, losses)
        worst = max(worst, worst_relative([reference[step] for step in steps], [losses[step] for step in steps]))
        outcomes[trial["mode"]].add(resumed)
    assert all(found == {FIRST, SECOND} for found in outcomes.values()), outcomes
    within(f"{door}: resumed losses at DP=3 vs the uninterrupted run (rel.)", worst, BOUNDS[door])
    logger.info("%s: %d kill points (%s), %d resumes", door, len(trials),
                {mode: sum(t["mode"] == mode for t in trials) for mode in kills.MODES},
                len({trial["resume"]["folder"] for trial in trials}))


@pytest.mark.parametrize("door", list(kills.DOORS))
def test_the_preemption_one_liner_saves_at_the_next_step_on_sigterm_and_exits_143(campaigns, door):
    """The front door's one-liner, with no other save, and a real SIGTERM to the whole job during step SECOND: every
    rank exits 143 after a checkpoint of step SECOND, which the front door's automatic resume at DP=3 continues."""
    run = campaigns[door]["preempted"]
    assert set(run["status"].values()) == {"exit 143"}, run["status"]
    assert set(run["resume_status"].values()) == {"exit 0"} and run["result"], run
    assert run["result"]["resumed_from"] == SECOND, run["result"]
    reference, losses = campaigns[door]["reference"]["async"]["losses"], run["result"]["losses"]
    steps = [str(step) for step in range(SECOND + 1, STEPS + 1)]
    assert sorted(losses, key=int) == steps, losses
    within(f"{door}: losses resumed after SIGTERM vs the uninterrupted run (rel.)",
           worst_relative([reference[step] for step in steps], [losses[step] for step in steps]), BOUNDS[door])


@pytest.mark.parametrize("door", list(kills.DOORS))
def test_a_failed_last_asynchronous_save_is_raised_by_the_end_of_training(campaigns, door):
    """The story's last save fails in rank 1's background writer (a full disk): the end of Trainer's train() and
    Lightning's fit() (Accelerate: the script's wait_for_checkpoint) raises it on every rank instead of returning."""
    lost = campaigns[door]["lost"]
    assert set(lost["status"].values()) == {"exit 0"}, lost  # each rank recorded what was raised
    for rank, record in enumerate(lost["ranks"]):
        assert record and record["raised"] and record["raised"].startswith("CheckpointSaveError"), (rank, record)
        assert "no space left on device" in record["raised"], (rank, record)
