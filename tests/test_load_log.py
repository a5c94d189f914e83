"""What a load logs when the DP size, the ZeRO stage or a moment's precision changes (issue 34, point 5): a real
zero_bnb ZeRO-2 checkpoint saved at DP=3 and loaded at DP=2 at stages 3 and 2 (``load_log_scenarios``); the
sentence itself (:mod:`zero_bnb.checkpoint.precision`) and the saved stage read from a hostile model file."""

from __future__ import annotations

import json
import logging
import os
import types

import load_log_scenarios
import pytest

from zero_bnb.checkpoint.model_file import saved_zero_stage
from zero_bnb.checkpoint.precision import Conversion, describe_conversions
from zero_bnb.ds.precision_plan import announce_precision
from zero_bnb.testing.launch import run_distributed

pytestmark = pytest.mark.launch

ROOT = "zero_bnb: checkpoint {folder} (saved at DP=3, ZeRO stage 2; now DP=2, ZeRO stage {stage}): "
PRECISION = ("this run keeps it in another precision (bitsandbytes' min_8bit_size, decided per partition at ZeRO "
             "stages 1/2 and per whole parameter at stage 3, or a 32-bit override)")


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("load_log")
    run_distributed(load_log_scenarios.save_stage2, 3, str(workdir))
    run_distributed(load_log_scenarios.load_elsewhere, 2, str(workdir))
    return json.loads((workdir / "load_log_dp2.json").read_text()), os.path.join(workdir, "stage2", "saved")


@pytest.fixture(scope="module")
def init_logs(logged):
    _, folder = logged
    workdir = os.path.dirname(os.path.dirname(folder))
    return [json.loads(open(os.path.join(workdir, f"init_log_rank{rank}.json")).read()) for rank in range(3)]


def test_initialize_warns_once_when_an_8bit_optimizer_keeps_fp32_state_below_min_8bit_size(init_logs):
    # Issue 42, point 6: at DP=3 the toy's last group (8,640 elements) has 3,072-element partitions on rank 0, under
    # bitsandbytes' min_8bit_size (4096): its "8-bit" Adam keeps fp32 moments, which only zero-bnb inspect showed.
    # The bias group (346 elements) is fp32 at every DP size, as bitsandbytes keeps each small bias alone.
    rank0 = init_logs[0]
    warnings = [message for level, _, message in rank0["log"] if level == "WARNING"]
    assert warnings == [
        "zero_bnb: the 8-bit optimizer keeps fp32 state (4 bytes per moment, not 1) for 8986 of its 33946 elements: "
        "group 1 (256 elements a partition at DP=3), group 2 (3072 elements a partition at DP=3; 8-bit while DP <= 2) "
        "are below bitsandbytes' min_8bit_size=4096 (under ZeRO stages 1 and 2 the tensor bitsandbytes sees is each "
        "rank's partition of a flat group). To keep them 8-bit pass a smaller min_8bit_size to the optimizer, e.g. "
        "bnb.optim.AdamW8bit(params, lr=..., min_8bit_size=256) (partitions shrink as DP grows: it holds at this DP "
        "size or fewer), or train at DP <= 2; zero_bnb.describe(engine)['below_min_8bit_size'] lists them"
    ], warnings
    assert all(not any(level == "WARNING" for level, *_ in other["log"]) for other in init_logs[1:])  # rank 0 says it
    records = [{"group": 1, "numel": 346, "partition_numel": 256, "min_8bit_size": 4096, "eight_bit_up_to_dp": None,
                "decided_on": "partition"},
               {"group": 2, "numel": 8640, "partition_numel": 3072, "min_8bit_size": 4096, "eight_bit_up_to_dp": 2,
                "decided_on": "partition"}]
    assert [entry["below"] for entry in init_logs][0] == records  # describe() before and after steps
    assert [entry["after_steps"] for entry in init_logs][0] == records
    # every rank's describe() lists the same groups (its own partition's size)
    assert all([r["group"] for r in entry["below"]] == [1, 2] for entry in init_logs), init_logs


class _Plans:
    """A ZeRO wrapper's precision plans as announce_precision reads them (num_groups, dp_size, geometry,
    state_precision): the sentence is pure formatting of these."""

    def __init__(self, dp_size, plans, numels):
        self.num_groups, self.dp_size, self._plans, self._numels = len(plans), dp_size, plans, numels

    def state_precision(self, index):
        return self._plans[index]

    def geometry(self, index):
        return types.SimpleNamespace(numel=self._numels[index])


def _plan(partition, eight_bit, up_to=None, whole=False):
    plan = {"optim_bits": 8, "min_8bit_size": 4096, "partition_numel": partition, "eight_bit": eight_bit,
            "eight_bit_up_to_dp": up_to}
    return plan | {"decided_on": "whole parameter"} if whole else plan


def test_the_warning_names_whole_parameters_at_stage_3_and_fewer_ranks_only_where_they_help(caplog):
    # The adversarial probe: at stage 3 it said "256 elements a parameter" (the rank's padded slice) of a
    # 400-element parameter and suggested min_8bit_size=256, which left a 20-element bias fp32; "or train at fewer
    # ranks" was said where no DP size keeps the state 8-bit.
    caplog.set_level(logging.WARNING, logger="zero_bnb.ds.precision_plan")
    announce_precision(_Plans(2, [_plan(256, False, whole=True), _plan(256, False, whole=True)], [400, 20]))
    [warning] = [record.getMessage() for record in caplog.records]
    assert "group 0 (400 elements a parameter), group 1 (20 elements a parameter) are below" in warning, warning
    assert "min_8bit_size=20)" in warning and "fewer" not in warning and "DP <=" not in warning, warning
    caplog.clear()
    announce_precision(_Plans(2, [_plan(512, False), _plan(5000, True)], [1000, 10000]))  # tiny at any DP size
    assert not caplog.records  # the biases of a larger model: fp32 under bitsandbytes' own rule too
    announce_precision(_Plans(1, [_plan(1000, False)], [1000]))  # a tiny model at DP=1: fewer ranks cannot help
    [warning] = [record.getMessage() for record in caplog.records]
    assert "min_8bit_size=1000) (partitions shrink" in warning and "DP <=" not in warning, warning


def test_no_warning_where_the_state_is_8bit_or_bitsandbytes_alone_decides(logged):
    # At DP=2 the same ZeRO-2 group is 8-bit; at stage 3 only the biases are fp32 (bitsandbytes' own per-tensor rule,
    # most elements 8-bit): the plan is logged at INFO, no warning.
    records, _ = logged
    for name in ("stage2", "stage3"):
        assert not [message for level, _, message in records[f"{name}_init"] if level == "WARNING"], records[f"{name}_init"]
        assert any(level == "INFO" and "state (optim_bits=8" in message for level, _, message in records[f"{name}_init"])
    assert [entry["group"] for entry in records["stage2_below"]] == [1]  # the bias group only
    assert [entry["group"] for entry in records["stage3_below"]] == [2, 3, 4]  # the three biases (by parameter)
    assert {entry["decided_on"] for entry in records["stage3_below"]} == {"whole parameter"}


def _from_engine(records, level):
    return [message for lev, name, message in records if name == "zero_bnb.ds.engine" and lev == level
            and "checkpoint" in message]


def test_a_stage2_checkpoint_loaded_at_stage3_elsewhere_names_the_real_sizes_stages_and_dtypes(logged):
    # Issue 34: "... in another precision than the checkpoint (saved at DP=1, now DP=1); converted state1: fp32 ->
    # 8-bit" for this checkpoint, saved at DP=3 with 8-bit state (the regrouped state's DP and dtype, not the saved).
    records, folder = logged
    [info] = _from_engine(records["stage3"], "INFO")
    assert info.startswith(f"zero_bnb: loaded checkpoint {folder} saved at DP=3 into DP=2 at ZeRO stage 3 (from ZeRO "
                           f"stage 2: every tensor re-split, mapped by parameter name); optimizer state loaded; "
                           f"rank 0's optimizer state 8-bit in 3 of 6 groups"), info
    [warning] = _from_engine(records["stage3"], "WARNING")
    # stage 3's groups: 0.weight, 2.weight (8-bit when saved, in the first group), the three biases (fp32 both times,
    # copied: not listed), 4.weight (saved fp32: its DP=3 partition had 2,880 elements; 8-bit now, whole parameter)
    assert warning == ROOT.format(folder=folder, stage=3) + (
        "optimizer state of 3 of 6 groups not loaded as saved: state1, state2: 8-bit (uint8) -> 8-bit (uint8) in "
        "groups 0, 1 (regrouped by parameter name: dequantized, then quantized again once on this run's block grid); "
        f"state1, state2: fp32 -> 8-bit (uint8) in group 5 (quantized once: {PRECISION}; regrouped by parameter name)"
    ), warning
    assert not any("another precision than the checkpoint" in message for *_, message in records["stage3"])
    # Issue 42: the regroup module's WARNING repeated this one; it is INFO now (one WARNING per load)
    assert [name for level, name, _ in records["stage3"] if level == "WARNING"] == ["zero_bnb.ds.engine"]
    assert any(level == "INFO" and name == "zero_bnb.checkpoint.regroup" for level, name, _ in records["stage3"])


def test_the_same_stage_at_another_dp_size_names_the_group_whose_precision_changed(logged):
    records, folder = logged
    [info] = _from_engine(records["stage2"], "INFO")
    assert info.startswith(f"zero_bnb: loaded checkpoint {folder} saved at DP=3 into DP=2 at ZeRO stage 2 (every "
                           f"tensor re-split); optimizer state loaded; rank 0's optimizer state 8-bit in 2 of 3 "
                           f"groups"), info
    [warning] = _from_engine(records["stage2"], "WARNING")
    assert warning == ROOT.format(folder=folder, stage=2) + (
        f"optimizer state of 1 of 3 groups not loaded as saved: state1, state2: fp32 -> 8-bit (uint8) in group 2 "
        f"(quantized once: {PRECISION})"), warning


def test_the_sentence_groups_alike_conversions_and_counts_long_lists():
    assert describe_conversions([[], []]) is None
    down = [Conversion("state1", ("uint8",), "float32", False), Conversion("state2", ("uint8",), "float32", False)]
    mixed = [Conversion("state1", ("float32", "uint8"), "uint8", True)]
    said = describe_conversions([down] * 11 + [[]] + [mixed])
    assert said == (
        "optimizer state of 12 of 13 groups not loaded as saved: state1, state2: 8-bit (uint8) -> fp32 in groups 0, 1, "
        f"2, 3, 4, 5, 6, 7 and 3 more (dequantized (exact): {PRECISION}); state1: fp32 and 8-bit (uint8) -> 8-bit "
        f"(uint8) in group 12 (quantized once: {PRECISION}; regrouped by parameter name)"), said


@pytest.mark.parametrize("model_states", [None, [], {}, {"ds_config": "stage 3"}, {"ds_config": {"zero_optimization": 2}},
                                          {"ds_config": {"zero_optimization": {"stage": "3"}}},
                                          {"ds_config": {"zero_optimization": {"stage": True}}},
                                          {"ds_config": {"zero_optimization": {"stage": 7}}}])
def test_a_model_file_that_does_not_say_its_stage_gives_none(model_states):
    assert saved_zero_stage(model_states) is None


def test_the_saved_stage_comes_from_deepspeeds_config_in_the_model_file():
    assert saved_zero_stage({"ds_config": {"zero_optimization": {"stage": 2}}}) == 2
