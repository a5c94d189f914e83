"""Checkpoint tools: inspect/verify/convert/export through the real CLI, and resuming what they write.

Sources are real checkpoints (zero_bnb and stock DeepSpeed, Adam8bit, DP=2, ZeRO stages 1 and 3); converted
ones are loaded by stock DeepSpeed (universal, ``torch.optim.AdamW``) and by zero_bnb at DP=1 and DP=3. The last
section checks that what the tools say when something goes wrong is what happened (issue 42).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import bitsandbytes.functional as bnb_functional
import pytest
import torch
from convert_scenarios import MORE, ONE_STATE, STEPS, resume_converted, write_sources
from requantized import (ADAM_MAPS, assert_quantized_once, assert_requantized_on_load, group_names, quantized_values,
                         raw_values, relative_rms, stock_flat_values)
from requantized import report as figure
from safetensors.torch import load_file
from scenarios import Recorded, cli, within, worst_relative

import zero_bnb
from zero_bnb.cli import main, zero_to_fp32
from zero_bnb.errors import CheckpointFormatError
from zero_bnb.format.durable import set_io_hook
from zero_bnb.format.manifest import SUBDIR, Manifest, read_manifest

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=11)]

#: Bounds: each at least 5x the worst figure measured under seven instruction-set variants (docs/bounds.md,
#: 2026-11-27). Requantized once (stock partitions off the block grid), relative loss over the following steps: worst
#: 9.38e-5 (the stage-3 rescue resumed at stage 2, its moments requantized once more) and 6.22e-5 (test_elastic);
#: the same path, one bound. For the 2 steps after the resume these tests run: the drift grows with the steps
#: (benchmarks/migration_drift.py: worst 8.9e-5 at the 2nd resumed step, 3.35e-4 at the 8th; docs/checkpoints.md).
REQUANTIZED_LOSS_BOUND = 5e-4
#: The same in bf16 (gradients reduced in bf16 in another order at another DP size): 0 natively (the bf16 losses equal
#: the stock run's), worst 4.32e-4 (DP=3, ATen's default kernels).
BF16_REQUANTIZED_LOSS_BOUND = 2.5e-3
#: Moments requantized once onto another 8-bit block grid are compared exactly: bitsandbytes' quantize_blockwise of the
#: originals on the new grid (tests/requantized.py); their relative RMS error against the originals (up to about 1%;
#: 9e-7 for universal's exp_avg_sq, already 8-bit values quantized again) is reported, not bounded.
#: fp32 AdamW on the exactly dequantized moments (universal checkpoint, stock DeepSpeed) against 8-bit Adam for the
#: next steps, relative loss: worst 2.95e-5 (stage 1 and stage 3 alike). Not quantization noise: the first resumed loss
#: uses identical weights and the second the update from the unquantized fp32 moments on both sides; the gap is the
#: order of weight decay, AdamW's decay-then-step against the fused kernel's step-then-decay (bitsandbytes' CUDA
#: order): lr^2 * wd * step per element. With ``zero_cpu_update: "bitsandbytes"`` (its CPU path decays first, as
#: AdamW does) it measured 1.06e-7 at DP=1 and 0 at DP=3; with weight decay 0, 3.2e-7 (docs/bounds.md).
UNIVERSAL_LOSS_BOUND = 1.5e-4
#: Universal back to zero_bnb (moments requantized once on the global grid, then 3 steps): worst 8.18e-5.
UNIVERSAL_BACK_LOSS_BOUND = 5e-4
from zero_bnb.testing.launch import run_distributed
from zero_bnb.versions import installed, release

#: DeepSpeed before 0.19.7 loads a universal checkpoint's optimizer moments over the fp32 weights' fragment
#: (utils/tensor_fragment.py map_to_flat_opt_states: ``lp._hp_mapping.hp_fragment = hp_fragment``, fixed in 0.19.7 as
#: ``optim_fragment[key] = hp_fragment``): stock DeepSpeed then reads exp_avg_sq as its fp32 weights, whoever wrote it.
STOCK_UNIVERSAL_LOAD_BROKEN = release(installed()["deepspeed"]) < (0, 19, 7)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("convert")
    run_distributed(write_sources, 2, str(workdir))
    killed = workdir / ".weights.safetensors.k1ll3d.zero_bnb-tmp"  # what an export killed mid-write leaves
    killed.mkdir()
    (killed / "weights.safetensors").write_bytes(b"partial")
    runs = {
        "to_universal": cli("convert", workdir / "zero_bnb", "--to", "universal", workdir / "universal" / "s3"),
        "from_universal": cli("convert", workdir / "universal", "--to", "zero_bnb", workdir / "back",
                              "--optimizer", "Adam8bit"),
        "rescue": cli("convert", workdir / "stock" / "s3", "--to", "zero_bnb", workdir / "rescued"),
        **{f"rescue_{family}": cli("convert", workdir / f"stock_{family}", "--to", "zero_bnb",
                                   workdir / f"rescued_{family}", "--optimizer", family) for family in ONE_STATE},
        "rescue_unnamed": cli("convert", workdir / f"stock_{ONE_STATE[0]}", "--to", "zero_bnb", workdir / "unnamed"),
        "rescue3": cli("convert", workdir / "stock3" / "s3", "--to", "zero_bnb", workdir / "rescued3"),
        "rescue3_aligned": cli("convert", workdir / "stock3_aligned", "--to", "zero_bnb", workdir / "rescued3_aligned"),
        "export3_aligned": cli("export", workdir / "rescued3_aligned", "--to", "fp32", workdir / "aligned3.safetensors",
                               "--moments"),
        "rescue3_bf16": cli("convert", workdir / "stock3_bf16", "--to", "zero_bnb", workdir / "rescued3_bf16"),
        "rescue3_offload": cli("convert", workdir / "stock3_offload", "--to", "zero_bnb", workdir / "rescued3_offload"),
        "export3_offload": cli("export", workdir / "rescued3_offload", "--to", "fp32", workdir / "offload3.safetensors",
                               "--moments"),
        "to_universal3": cli("convert", workdir / "zero_bnb3", "--to", "universal", workdir / "universal3" / "s3"),
        "export": cli("export", workdir / "zero_bnb", "--to", "fp32", workdir / "weights.safetensors", "--moments"),
        "inspect": cli("inspect", workdir / "zero_bnb"),
        "inspect_json": cli("inspect", workdir / "zero_bnb" / "s3", "--json"),
        "verify": cli("verify", workdir / "zero_bnb"),
    }
    for dp in (1, 3):
        run_distributed(resume_converted, dp, str(workdir))
    load = lambda name: Recorded(torch.load(workdir / name, weights_only=False))  # noqa: E731
    return workdir, runs, load("sources.pt"), {dp: load(f"resumed_dp{dp}.pt") for dp in (1, 3)}


def _report(text: str) -> dict:
    """The ``key: value`` lines convert prints, values parsed (numbers, dicts of numbers, strings)."""
    parsed = {}
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        with contextlib.suppress(ValueError, SyntaxError):
            parsed[key] = ast.literal_eval(value)
        parsed.setdefault(key, value)
    return parsed


def _ok(runs, name):
    code, out, err = runs[name]
    assert code == 0, (name, out, err)
    return out


def test_inspect_summarises_the_checkpoint(work):
    _, runs, _, _ = work
    text = _ok(runs, "inspect")
    for part in ("saved at DP=2", "block size 256", "33,946 parameters", "Adam8bit", "group 0: 24,960 elements",
                 "0.weight", "(160, 60)", "state state1", "elementwise", "uint8", "state qmap1", "replicated",
                 "state 8-bit", "state fp32", f"bitsandbytes {installed()['bitsandbytes']}", "min_8bit_size 4,096",
                 "8-bit while DP <= 6", "8-bit while DP <= 2"):
        assert part in text, part
    assert "DP <= None" not in text  # a group that is fp32 at every DP size says so
    summary = json.loads(_ok(runs, "inspect_json"))
    assert summary["saved_dp_size"] == 2 and summary["parameters"] == 33946 and len(summary["groups"]) == 3
    states = {s["key"]: s for s in summary["groups"][0]["states"]}
    assert states["state1"]["8bit"] and states["state1"]["bytes"] == 24960 and states["qmap1"]["kind"] == "replicated"
    assert not any(s["8bit"] for s in summary["groups"][1]["states"])
    assert {f["path"] for f in summary["files"]} >= {"mp_rank_00_model_states.pt", "zero_bnb/replicated.pt"}
    assert {(f["algorithm"], len(f["digest"])) for f in summary["files"]} == {("blake3", 64)}
    assert set(summary["versions"]) == {"zero_bnb", "torch", "deepspeed", "bitsandbytes"}
    # fp32 training: the masters are the module weights of DeepSpeed's model file, stored nowhere else
    assert [g["masters"] for g in summary["groups"]] == [{"storage": "module", "bytes": 0}] * 3
    kinds = summary["bytes_by_kind"]
    assert sum(kinds.values()) == summary["bytes"] and kinds["master weights (shards)"] == 0
    assert kinds["optimizer state"] == sum(s["bytes"] for g in summary["groups"] for s in g["states"])
    assert kinds["model file (module weights, DeepSpeed's)"] > 4 * 33946
    assert "masters module" in text and "bytes: master weights (shards) 0 B" in text


def test_checkpoints_of_format_2_with_whole_masters_still_verify_inspect_and_export(work, tmp_path):
    """A checkpoint as zero_bnb wrote it before masters were derived (format 2: no 'masters', every master in the
    shards, SHA-256 digests) reads as it did."""
    import hashlib

    from hostile_scenarios import resign

    workdir, runs, _, _ = work
    _ok(runs, "from_universal")
    old = tmp_path / "old"
    shutil.copytree(workdir / "back", old)
    manifest_path = next(old.glob("*/zero_bnb/manifest.json"))
    data = json.loads(manifest_path.read_text())
    assert [group.pop("masters") for group in data["groups"]] == ["fp32"] * 3 and data.pop("module_file") == ""
    assert data.pop("module_digest") == ""
    for record in data["files"]:
        record.pop("blake3")
        record["sha256"] = hashlib.sha256((manifest_path.parent.parent / record["path"]).read_bytes()).hexdigest()
    resign(str(manifest_path.parent), {**data, "format_version": 2})
    assert "manifest format 2" in _ok([cli("verify", old)], 0)
    summary = json.loads(_ok([cli("inspect", old, "--json")], 0))
    assert summary["format_version"] == 2 and {g["masters"]["storage"] for g in summary["groups"]} == {"fp32"}
    assert {f["algorithm"] for f in summary["files"]} == {"sha256"}
    _ok([cli("export", old, "--to", "fp32", tmp_path / "old.safetensors")], 0)
    _ok([cli("export", workdir / "back", "--to", "fp32", tmp_path / "new.safetensors")], 0)
    before, after = load_file(tmp_path / "old.safetensors"), load_file(tmp_path / "new.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_verify_exit_codes(work, tmp_path):
    workdir, runs, _, _ = work
    assert "OK:" in _ok(runs, "verify") and "4 files match their digests, manifest format 4" in runs["verify"][1]
    damaged = tmp_path / "damaged"
    shutil.copytree(workdir / "zero_bnb", damaged)
    shard = damaged / "s3" / "zero_bnb" / "shard_00001-of-00002.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 1
    shard.write_bytes(bytes(data))
    code, _, err = cli("verify", damaged)
    assert code == 1 and "CheckpointCorruptError" in err and "shard_00001-of-00002.pt (blake3" in err


def test_bad_paths_and_requests_give_clear_errors(work, tmp_path):
    workdir, _, _, _ = work
    cases = [  # exit 1: the checkpoint fails a check; exit 2: the request cannot work as given
        (("inspect", tmp_path / "nowhere"), 2, "is not a folder"),
        (("verify", tmp_path), 2, "holds no 'latest' file and is not a tag folder"),
        (("inspect", workdir / "zero_bnb", "--tag", "s99"), 1, "'s99'"),
        (("convert", workdir / "zero_bnb", "--to", "zero_bnb", tmp_path / "x"), 2, "already a zero_bnb checkpoint"),
        (("convert", workdir / "stock", "--to", "universal", tmp_path / "x"), 2,
         "is a stock DeepSpeed checkpoint, not a zero_bnb one; convert reads"),
        (("export", workdir / "universal", "--to", "fp32", tmp_path / "w.safetensors"), 2,
         "is a DeepSpeed universal checkpoint, not a zero_bnb one; export reads zero_bnb checkpoints. Convert it "
         "first: zero-bnb convert"),
        (("inspect", workdir / "stock"), 2, "stock DeepSpeed checkpoint, not a zero_bnb one; inspect reads"),
        (("verify", workdir / "stock" / "s3"), 2, "Convert it first: zero-bnb convert"),
        (("inspect", workdir / "zero_bnb", "--tag", "../zero_bnb/s3"), 2, "cannot name a checkpoint folder"),
        (("inspect", workdir / "zero_bnb", "--tag", "latest"), 2, "name of the pointer file"),
        (("convert", workdir / "zero_bnb", "--to", "universal", tmp_path / "u", "--out-tag", "x"), 2,
         "--out-tag applies to --to zero_bnb"),
        (("convert", workdir / "rescued_Lion8bit", "--to", "universal", tmp_path / "u"), 2,
         "whose moments ['exp_avg'] are not Adam's ['exp_avg', 'exp_avg_sq']"),
        # ZeRO stage 3: the same checks
        (("convert", workdir / "stock3" / "s3", "--to", "zero_bnb", workdir / "stock3"), 2, "overlaps"),
        (("convert", workdir / "zero_bnb3", "--to", "universal", workdir / "zero_bnb3" / "s3"), 2, "overlaps"),
        (("convert", workdir / "zero_bnb3", "--to", "zero_bnb", tmp_path / "x"), 2, "already a zero_bnb checkpoint"),
        (("convert", workdir / "stock3", "--to", "universal", tmp_path / "x"), 2,
         "is a stock DeepSpeed checkpoint, not a zero_bnb one; convert reads"),
    ]
    for args, expected_code, message in cases:
        code, out, err = cli(*args)
        assert code == expected_code and message in err, (args, out, err)
        assert err.count("\n") == 1, err  # one line
    with pytest.raises(SystemExit) as usage, contextlib.redirect_stderr(io.StringIO()):
        main(["convert", str(workdir / "zero_bnb"), "--to", "onnx", str(tmp_path / "x")])
    assert usage.value.code == 2


def test_export_writes_consolidated_weights_and_dequantized_moments(work):
    workdir, runs, sources, _ = work
    assert "tensors: 18" in _ok(runs, "export")
    assert not (workdir / ".weights.safetensors.k1ll3d.zero_bnb-tmp").exists()  # a killed export's folder: removed
    tensors = load_file(workdir / "weights.safetensors")
    for name, saved in sources["zero_bnb_saved"]["params"].items():
        assert torch.equal(tensors[name], saved["fp32"]), name
        assert torch.equal(tensors[f"{name}.exp_avg"], saved["state1"]), name
        assert torch.equal(tensors[f"{name}.exp_avg_sq"], saved["state2"]), name


@pytest.mark.parametrize("dp", [1, 3])
@pytest.mark.xfail(STOCK_UNIVERSAL_LOAD_BROKEN, raises=AssertionError, strict=True,
                   reason="DeepSpeed < 0.19.7 loads universal checkpoints wrongly (map_to_flat_opt_states)")
def test_stock_deepspeed_loads_the_universal_output_into_adamw_and_trains(work, dp):
    _, runs, sources, resumed = work
    assert "moments: ['exp_avg', 'exp_avg_sq']" in _ok(runs, "to_universal")
    loaded = resumed[dp]
    for name, saved in sources["zero_bnb_saved"]["params"].items():
        assert torch.equal(loaded["universal"][name]["fp32"], saved["fp32"]), name
        assert torch.equal(loaded["universal"][name]["exp_avg"], saved["state1"]), name  # dequantized 8-bit
        assert torch.equal(loaded["universal"][name]["exp_avg_sq"], saved["state2"]), name
    assert loaded["universal_steps"] == [float(3)]
    # fp32 AdamW from the same moments: the same trajectory but for the order of weight decay (UNIVERSAL_LOSS_BOUND;
    # the 1.06e-7 measured before 732d10a compared with bitsandbytes' CPU path, which decays first as AdamW does).
    within(f"universal into fp32 AdamW at DP={dp} vs zero_bnb (rel.)",
           worst_relative(sources["zero_bnb_after"], loaded["universal_after"]), UNIVERSAL_LOSS_BOUND)


@pytest.mark.parametrize("dp", [1, 3])
def test_universal_back_to_zero_bnb_round_trips(work, dp):
    _, runs, sources, resumed = work
    report = _report(_ok(runs, "from_universal"))
    assert report["quantized_elements"] == 2 * (24960 + 8640)  # both moments of the two 8-bit groups
    back = resumed[dp]["back"]
    # The printed errors are the ones the loaded state shows, per state key worst over the quantized groups.
    for key, moment in (("state1", "exp_avg"), ("state2", "exp_avg_sq")):
        worst_abs, worst_rms = 0.0, 0.0
        for names in (["0.weight", "2.weight"], ["4.weight"]):
            original = torch.cat([sources["zero_bnb_saved"]["params"][n][key].flatten() for n in names])
            restored = torch.cat([back["params"][n][key].flatten() for n in names])
            difference = (restored - original).abs()
            worst_abs = max(worst_abs, float(difference.max()))
            worst_rms = max(worst_rms, float(difference.norm()) / float(original.norm()))
        assert report["max_abs_error"][moment] == pytest.approx(worst_abs, rel=1e-6), (key, report, worst_abs)
        assert report["relative_rms_error"][moment] == pytest.approx(worst_rms, rel=1e-5), (key, report, worst_rms)
    for name, saved in sources["zero_bnb_saved"]["params"].items():
        assert torch.equal(back["params"][name]["fp32"], saved["fp32"]), name  # weights: exact
        if name.endswith("bias"):  # the group kept in fp32: nothing was requantized, so exact
            for key in ("state1", "state2"):
                assert torch.equal(back["params"][name][key], saved[key]), (name, key)
    # The 8-bit groups' moments: the universal checkpoint's exact values (the saved codes dequantized) quantized once
    # by the converter on the global grid; loaded as they are (group 2 is fp32 at DP=3: their dequantization).
    saved_raw = sources["zero_bnb_saved"]["raw"]
    for key in ("state1", "state2"):
        worst = max(assert_quantized_once(f"universal back to zero_bnb at DP={dp}: group {group} {key}",
                                          back["raw"][group], key, raw_values(saved_raw[group], key), ADAM_MAPS[key])
                    for group in (0, 2))
        figure(f"universal back to zero_bnb at DP={dp}: {key} vs saved (relative RMS)", worst)
    assert [c["step"] for c in back["counters"]] == [3, 3, 3]
    within(f"universal back to zero_bnb at DP={dp} vs zero_bnb (rel.)",
           worst_relative(sources["zero_bnb_after"], resumed[dp]["back_after"]), UNIVERSAL_BACK_LOSS_BOUND)


def _assert_rescued_flat_groups(tag_folder, rescued: dict, keys, label: str, report: dict | None = None) -> None:
    """A rescued stock ZeRO-1/2 checkpoint, loaded: 8-bit groups hold the stock values (read by bitsandbytes from the
    stock files) quantized once by bitsandbytes on the global grid (their dequantization where the group is fp32 at
    this DP size), fp32 groups the stock values exactly. With ``report`` (what convert printed), its relative RMS errors
    are those. Figures reported."""
    moments = {"state1": "exp_avg", "state2": "exp_avg_sq"}
    for key in keys:
        flats, maps = stock_flat_values(tag_folder, key)
        assert [qmap is not None for qmap in maps] == [True, False, True], (label, key)
        errors = []
        for group, (source, qmap) in enumerate(zip(flats, maps, strict=True)):
            raw = rescued["raw"][group]
            if qmap is None:
                assert torch.equal(raw[key], source), (label, group, key)
            else:
                errors.append(assert_quantized_once(f"{label}: group {group} {key}", raw, key, source, qmap))
        if report is not None:
            assert report["relative_rms_error"][moments[key]] == pytest.approx(max(errors), rel=1e-5), (key, report)
        assert max(errors) > 0, (label, key)
        figure(f"{label}: {key} requantized vs the stock run's (relative RMS)", max(errors))


@pytest.mark.parametrize("dp", [1, 3])
def test_rescued_stock_checkpoint_resumes_at_another_dp_size(work, dp):
    workdir, runs, sources, resumed = work
    report = _report(_ok(runs, "rescue"))
    assert report["saved_dp_size"] == 2
    # The stock partitions (12480 and 4320 elements of the two 8-bit groups) are not block-aligned: the moments were
    # requantized once, exactly as bitsandbytes quantizes the stock values (each rank's partition dequantized with its
    # own absmax and map) on the global grid; the error the report prints is that one's, and not zero.
    assert report["requantized_elements"] == 2 * (24960 + 8640)  # both moments of the two 8-bit groups
    rescued = resumed[dp]["rescued"]
    _assert_rescued_flat_groups(workdir / "stock" / "s3", rescued, ("state1", "state2"), f"rescued stock at DP={dp}",
                                report)
    for name, weight in sources["stock_weights"].items():
        assert torch.equal(rescued["params"][name]["fp32"], weight), name
    assert [c["step"] for c in rescued["counters"]] == [3, 3, 3]
    within(f"rescued stock (requantized once) at DP={dp} vs stock (rel.)",
           worst_relative(sources["stock_after"], resumed[dp]["rescued_after"]), REQUANTIZED_LOSS_BOUND)


@pytest.mark.parametrize("dp", [1, 3])
@pytest.mark.parametrize("family", ONE_STATE)
def test_stock_checkpoints_of_every_declared_family_are_rescued_from_the_declaration(work, dp, family):
    workdir, runs, sources, resumed = work
    assert _report(_ok(runs, f"rescue_{family}"))["saved_dp_size"] == 2
    rescued = resumed[dp][f"rescued_{family}"]
    _assert_rescued_flat_groups(workdir / f"stock_{family}" / "s3", rescued, ("state1",),
                                f"rescued stock {family} at DP={dp}")
    for name, weight in sources[f"stock_{family}_weights"].items():
        assert torch.equal(rescued["params"][name]["fp32"], weight), name
    assert [c["step"] for c in rescued["counters"]] == [STEPS] * len(rescued["counters"])
    within(f"rescued stock {family} at DP={dp} vs stock (rel.)",
           worst_relative(sources[f"stock_{family}_after"], resumed[dp][f"rescued_{family}_after"]), REQUANTIZED_LOSS_BOUND)


def test_a_one_state_stock_checkpoint_needs_its_optimizer_named(work):
    _, runs, _, _ = work
    code, _, err = runs["rescue_unnamed"]
    assert code == 2 and "name the optimizer that wrote it with --optimizer" in err and "Lion8bit" in err, err


def test_model_states_file_holds_the_trained_weights_by_default(work):
    """DeepSpeed's model file keeps the module weights (stock readers, load_module_only); derived is opt-in."""
    workdir, _, sources, _ = work
    model_states = torch.load(workdir / "zero_bnb" / "s3" / "mp_rank_00_model_states.pt", weights_only=False)
    saved = sources["zero_bnb_saved"]["params"]
    for name, tensors in saved.items():
        assert torch.equal(model_states["module"][name], tensors["fp32"]), name
    assert "zero_bnb_derived_params" not in model_states
    derived = torch.load(workdir / "derived" / "s3" / "mp_rank_00_model_states.pt", weights_only=False)
    assert not set(saved) & set(derived["module"]), "with zero_derived_module_weights the shards hold them once"
    assert derived["zero_bnb_derived_params"] == {name: [name, "float32"] for name in saved}


@pytest.mark.parametrize("dp", [1, 3])
def test_derived_module_weights_are_rebuilt_on_load(work, dp):
    """zero_derived_module_weights: true leaves the weights out of the model file; a load rebuilds them exactly."""
    _, _, sources, resumed = work
    saved = sources["derived_saved"]["params"]
    for name, tensors in saved.items():
        assert torch.equal(resumed[dp]["derived"]["params"][name]["fp32"], tensors["fp32"]), name
        assert torch.equal(resumed[dp]["derived_module"][name], tensors["fp32"]), name


def _assert_rescued_per_parameter(stock: dict, rescued: dict, label: str) -> None:
    """A rescued stock ZeRO-3 checkpoint loaded at stage 3 (one group per parameter): each weight's moments are the
    stock run's (:func:`_stock3_moments`) quantized once by bitsandbytes on the weight's own grid, exactly."""
    for group, names in enumerate(group_names(rescued)):
        (name,) = names
        if "weight" in name:
            for key in ("state1", "state2"):
                assert rescued["raw"][group][key].dtype == torch.uint8, (label, name, key)
                assert_quantized_once(f"{label}: {name} {key}", rescued["raw"][group], key, stock[name][key].flatten(),
                                      ADAM_MAPS[key])


def _stock3_moments(tag_folder) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's moments as stock DeepSpeed's ZeRO-3 run held them, read without zero_bnb: every rank's flat
    sub-group state dequantized by bitsandbytes with that rank's own absmax, cut into ``ceil(numel / dp)`` slices."""
    files = sorted(tag_folder.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))  # bf16_zero_pp_rank_... in bf16
    ranks = [torch.load(f, weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]["state"] for f in files]
    shapes = torch.load(tag_folder / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)["param_shapes"]
    moments = {}
    for g, group_shapes in enumerate(shapes):
        flats = {}
        for key, absmax, qmap in (("state1", "absmax1", "qmap1"), ("state2", "absmax2", "qmap2")):
            per_rank = []
            for state in ranks:
                quant = {**state[g], **state[g].get("__bnb_optimizer_quant_state__", {})}
                codes = quant[key]
                per_rank.append(bnb_functional.dequantize_blockwise(codes, absmax=quant[absmax], code=quant[qmap],
                                                                    blocksize=256)
                                if codes.dtype == torch.uint8 else codes.float())
            flats[key] = per_rank
        offset = 0
        for name, shape in group_shapes.items():
            numel, size = shape.numel(), math.ceil(shape.numel() / len(ranks))
            moments[name] = {key: torch.cat([flat[offset : offset + size] for flat in per_rank])[:numel]
                             for key, per_rank in flats.items()}
            offset += size
    return moments


@pytest.mark.parametrize("dp", [1, 3])
def test_rescued_stock_stage3_checkpoint_resumes_at_any_dp_size(work, dp):
    """A stock DeepSpeed ZeRO-3 + Adam8bit checkpoint (DP=2), converted once, resumes under zero_bnb at stage 3 at
    DP=1 and DP=3: masters exact, 8-bit moments requantized once on each parameter's grid, losses as the stock run's;
    the stock checkpoint itself is refused by name with the conversion to run."""
    workdir, runs, sources, resumed = work
    report = _report(_ok(runs, "rescue3"))
    assert report["saved_dp_size"] == 2 and report["zero_stage"] == 3
    # 0.weight and 2.weight share one flat tensor per rank and 4.weight's slices are 4320 elements: no 8-bit block
    # lies on a parameter's grid, so both moments of every weight were requantized once
    assert report["requantized_elements"] == 2 * (9600 + 15360 + 8640)
    rescued = resumed[dp]["rescued3"]
    for name, weight in sources["stock3_weights"].items():
        assert torch.equal(rescued["params"][name]["fp32"], weight), name
    assert [c["step"] for c in rescued["counters"]] == [STEPS] * 6  # one group per parameter
    # precision decided on the whole parameter (weights 8-bit, biases fp32), as zero_bnb's stage 3 keeps it
    assert [g["state1"].dtype for g in rescued["raw"]] == [torch.uint8] * 2 + [torch.float32] * 3 + [torch.uint8]
    # the printed errors are the ones the loaded state shows against the stock run's own (dequantized) moments
    stock = _stock3_moments(workdir / "stock3" / "s3")
    for key, moment in (("state1", "exp_avg"), ("state2", "exp_avg_sq")):
        difference = {n: rescued["params"][n][key].flatten() - stock[n][key] for n in stock}
        worst_abs = max(float(d.abs().max()) for d in difference.values())
        worst_rms = max(float(d.norm() / stock[n][key].norm()) for n, d in difference.items() if "weight" in n)
        assert report["max_abs_error"][moment] == pytest.approx(worst_abs, rel=1e-6), (key, report, worst_abs)
        assert report["relative_rms_error"][moment] == pytest.approx(worst_rms, rel=1e-5), (key, report, worst_rms)
        assert worst_rms > 0
        figure(f"rescued stock ZeRO-3 at DP={dp}: {moment} vs the stock run's (relative RMS)", worst_rms)
        for name in ("0.bias", "2.bias", "4.bias"):  # fp32 in the stock run too: copied exactly
            assert not difference[name].any(), (name, key)
    _assert_rescued_per_parameter(stock, rescued, f"rescued stock ZeRO-3 at DP={dp}")
    within(f"rescued stock ZeRO-3 at DP={dp} vs stock (rel.)",
           worst_relative(sources["stock3_after"], resumed[dp]["rescued3_after"]), REQUANTIZED_LOSS_BOUND)
    refused = resumed[dp]["stock3_direct"]
    assert refused.startswith("CheckpointMismatchError") and "stock DeepSpeed ZeRO stage-3 checkpoint" in refused
    assert "zero-bnb convert" in refused, refused


def test_rescued_stock_stage3_checkpoint_resumes_at_stage2(work):
    workdir, _, sources, resumed = work
    loaded = resumed[3]["rescued3_stage2"]
    for name, weight in sources["stock3_weights"].items():
        assert torch.equal(loaded["params"][name]["fp32"], weight), name
    # stage 2 keeps one flat group per param group: the rescued moments (the stock ones quantized once on each
    # weight's grid; the biases' fp32) are requantized on its grid where the group is 8-bit at DP=3 (the weights of
    # group 0), exactly as bitsandbytes quantizes them, and loaded as they are where it is fp32
    stock = _stock3_moments(workdir / "stock3" / "s3")
    for key in ("state1", "state2"):
        rescued = {name: quantized_values(moments[key], ADAM_MAPS[key]) if "weight" in name else moments[key]
                   for name, moments in stock.items()}
        worst = 0.0
        for group, names in enumerate(group_names(loaded)):
            worst = max(worst, assert_requantized_on_load(
                f"rescued stock ZeRO-3 into stage 2 at DP=3: group {group} {key}", loaded["raw"][group], key,
                torch.cat([rescued[name] for name in names]), ADAM_MAPS[key]))
        assert loaded["raw"][0][key].dtype == torch.uint8
        figure(f"rescued stock ZeRO-3 into stage 2 at DP=3: {key} requantized once more (relative RMS)", worst)
    within("rescued stock ZeRO-3 into stage 2 at DP=3 vs stock (rel.)",
           worst_relative(sources["stock3_after"], resumed[3]["rescued3_stage2_after"]), REQUANTIZED_LOSS_BOUND)


@pytest.mark.parametrize("dp", [1, 3])
def test_rescued_stock_stage3_bf16_checkpoint_resumes_at_any_dp_size(work, dp):
    """Stock DeepSpeed ZeRO-3 in bf16 + Adam8bit (DP=2), converted once, resumes under zero_bnb at stage 3 in bf16 at
    DP=1 and DP=3: the stock run's fp32 masters exactly, bf16 module weights equal to them cast, moments requantized
    once, training on as the stock run does."""
    workdir, runs, sources, resumed = work
    report = _report(_ok(runs, "rescue3_bf16"))
    assert report["saved_dp_size"] == 2 and report["zero_stage"] == 3
    assert report["requantized_elements"] == 2 * (9600 + 15360 + 8640)  # as the fp32 source: the same sub-groups
    rescued, module = resumed[dp]["rescued3_bf16"], resumed[dp]["rescued3_bf16_module"]
    assert rescued["params"].keys() == sources["stock3_bf16_weights"].keys()
    for name, weight in sources["stock3_bf16_weights"].items():
        assert torch.equal(rescued["params"][name]["fp32"], weight), name
        assert module[name].dtype == torch.bfloat16 and torch.equal(module[name], weight.to(torch.bfloat16)), name
    assert [c["step"] for c in rescued["counters"]] == [STEPS] * 6
    assert [g["state1"].dtype for g in rescued["raw"]] == [torch.uint8] * 2 + [torch.float32] * 3 + [torch.uint8]
    stock = _stock3_moments(workdir / "stock3_bf16" / "s3")
    for key in ("state1", "state2"):
        for name in ("0.bias", "2.bias", "4.bias"):  # fp32 state in the stock run too: copied exactly
            assert torch.equal(rescued["params"][name][key].flatten(), stock[name][key]), (name, key)
        figure(f"rescued stock ZeRO-3 bf16 at DP={dp}: {key} vs the stock run's (relative RMS)",
               max(relative_rms(quantized_values(stock[n][key], ADAM_MAPS[key]), stock[n][key])
                   for n in stock if "weight" in n))
    _assert_rescued_per_parameter(stock, rescued, f"rescued stock ZeRO-3 bf16 at DP={dp}")
    within(f"rescued stock ZeRO-3 bf16 at DP={dp} vs stock (rel.)",
           worst_relative(sources["stock3_bf16_after"], resumed[dp]["rescued3_bf16_after"]),
           BF16_REQUANTIZED_LOSS_BOUND)


def test_stock_stage3_state_already_on_the_block_grid_is_rescued_exactly(work):
    """With sub_group_size 4000 each weight has a flat tensor of its own; 2.weight's slices (7680 elements = 30
    blocks) start on blocks of the parameter and of the flat tensor, so its codes and absmax are taken as they are."""
    workdir, runs, _, _ = work
    report = _report(_ok(runs, "rescue3_aligned"))
    assert report["requantized_elements"] == 2 * (9600 + 8640)  # 0.weight (4800-element slices) and 4.weight only
    _ok(runs, "export3_aligned")
    exported = load_file(workdir / "aligned3.safetensors")
    stock = _stock3_moments(workdir / "stock3_aligned" / "s3")
    for key, moment in (("state1", "exp_avg"), ("state2", "exp_avg_sq")):
        assert torch.equal(exported[f"2.weight.{moment}"].flatten(), stock["2.weight"][key]), moment
        assert not torch.equal(exported[f"0.weight.{moment}"].flatten(), stock["0.weight"][key]), moment
        for name in ("0.weight", "4.weight"):  # requantized once, as bitsandbytes quantizes them on the weight's grid
            assert torch.equal(exported[f"{name}.{moment}"].flatten(),
                               quantized_values(stock[name][key], ADAM_MAPS[key])), (name, moment)


def test_a_stock_stage3_checkpoint_trained_with_optimizer_offload_is_rescued(work):
    """Stock ZeRO-3 with ``offload_optimizer: cpu`` (ZeRO-Offload) and Adam8bit writes the same files: the rescue
    gives the stock run's masters exactly and its moments requantized once."""
    workdir, runs, sources, _ = work
    report = _report(_ok(runs, "rescue3_offload"))
    assert report["zero_stage"] == 3 and report["requantized_elements"] == 2 * (9600 + 15360 + 8640)
    _ok(runs, "export3_offload")
    exported = load_file(workdir / "offload3.safetensors")
    stock = _stock3_moments(workdir / "stock3_offload" / "s3")
    worst_rms = 0.0
    for name, weight in sources["stock3_offload_weights"].items():
        assert torch.equal(exported[name], weight), name
        for key, moment in (("state1", "exp_avg"), ("state2", "exp_avg_sq")):
            difference = exported[f"{name}.{moment}"].flatten() - stock[name][key]
            if name.endswith("bias"):  # fp32 state: exact
                assert not difference.any(), (name, moment)
            else:  # requantized once, exactly as bitsandbytes quantizes them on the weight's grid
                expected = quantized_values(stock[name][key], ADAM_MAPS[key])
                assert torch.equal(exported[f"{name}.{moment}"].flatten(), expected), (name, moment)
                rms = relative_rms(expected, stock[name][key])
                assert rms > 0, (name, moment)
                worst_rms = max(worst_rms, rms)
    figure("rescued stock ZeRO-3 offload: moments vs the stock run's (relative RMS)", worst_rms)


@pytest.mark.parametrize("dp", [1, 3])
def test_stock_deepspeed_stage3_loads_the_universal_output_of_a_stage3_checkpoint(work, dp):
    """zero_bnb ZeRO-3 checkpoint (DP=2) -> universal -> stock DeepSpeed ZeRO-3 + torch AdamW at DP=1 and DP=3."""
    _, runs, sources, resumed = work
    report = _report(_ok(runs, "to_universal3"))
    assert report["zero_stage"] == 3 and report["parameters"] == 6
    loaded = resumed[dp]
    for name, saved in sources["zero_bnb3_saved"]["params"].items():
        assert torch.equal(loaded["universal3"][name]["fp32"], saved["fp32"]), name
        assert torch.equal(loaded["universal3"][name]["exp_avg"], saved["state1"]), name  # dequantized 8-bit
        assert torch.equal(loaded["universal3"][name]["exp_avg_sq"], saved["state2"]), name
    assert loaded["universal3_steps"] == [float(STEPS)]
    # Stock DeepSpeed 0.19.8's ZeRO-3 universal loader gives every param group the first one's hyper-parameters and
    # every sub-group one step tensor (stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3); the converter
    # says so, and the phase applies what it says before training on.
    assert loaded["universal3_weight_decay"] == [0.1, 0.1, 0.1] and loaded["universal3_step_tensors"] == 1
    assert "one shared step tensor" in report["stock_zero3_note"]
    assert "first one's hyper-parameters ({'lr': 0.01" in report["stock_zero3_note"]
    assert loaded["universal3_steps_after"] == [float(STEPS + MORE)]  # each state its own step again
    within(f"universal (from stage 3) into stock stage-3 fp32 AdamW at DP={dp} vs zero_bnb (rel.)",
           worst_relative(sources["zero_bnb3_after"], loaded["universal3_after"]), UNIVERSAL_LOSS_BOUND)


def test_damaged_or_mixed_stock_stage3_checkpoints_are_refused_in_one_line(work, tmp_path):
    """A missing or truncated rank file, files of two saves, stage-1 and stage-3 files mixed, a rank file or model
    file that would run code: exit 1, one line naming the file or the difference, nothing written, nothing run."""
    from hostile_scenarios import Payload

    workdir, _, _, _ = work
    sentinel = tmp_path / "pwned"
    source = workdir / "stock3" / "s3"

    def copy(name):
        folder = tmp_path / name / "s3"
        shutil.copytree(source, folder)
        return folder

    missing = copy("missing")
    (missing / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    truncated = copy("truncated")
    rank1 = truncated / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1.write_bytes(rank1.read_bytes()[: rank1.stat().st_size // 2])
    other_save = copy("other_save")  # optimizer files of a run with other sub-groups
    for rank in (0, 1):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        shutil.copyfile(workdir / "stock3_aligned" / "s3" / name, other_save / name)
    mixed = copy("mixed")  # a stage-1 model file beside stage-3 optimizer files
    for path in mixed.glob("*model_states.pt"):
        path.unlink()
    shutil.copyfile(workdir / "stock" / "s3" / "mp_rank_00_model_states.pt", mixed / "mp_rank_00_model_states.pt")
    code_in_rank = copy("code_in_rank")
    torch.save({"optimizer_state_dict": Payload(f"touch {sentinel}")},
               code_in_rank / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    code_in_model = copy("code_in_model")
    torch.save({"param_shapes": Payload(f"touch {sentinel}")}, code_in_model / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    cases = {
        code_in_rank: "posix.system",
        code_in_model: "posix.system",
        missing: "holds 2 stage-3 model-states files but optimizer files of ranks 0..0 only",
        truncated: "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        other_save: "the stock stage-3 rank files hold [4] sub-groups, DeepSpeed's model file 3",
        mixed: "files come from different saves",
    }
    for folder, message in cases.items():
        out = tmp_path / f"{folder.parent.name}_out"
        code, stdout, err = cli("convert", folder, "--to", "zero_bnb", out)
        assert code == 1 and message in err and err.count("\n") == 1, (folder, stdout, err)
        assert not out.exists(), folder
    assert not sentinel.exists()


# -- what the tools say when something goes wrong (issue 42): on the fixture's stock DP=2 checkpoint (stock/s3), its
# migration (rescued) and zero_bnb's own (zero_bnb) --------------------------------------------------------------

PREVIOUS = b"the previous export"


class _Hook:
    """An I/O hook that raises ``error`` at the first ``event`` on ``path`` (see ``zero_bnb.format.durable``)."""

    def __init__(self, event: str, path: str, error: BaseException) -> None:
        self.event, self.path, self.error, self.fired = event, path, error, False

    def __call__(self, event: str, path: str) -> None:
        if not self.fired and event == self.event and os.path.abspath(path) == self.path:
            self.fired = True
            raise self.error


def _export_with(hook: _Hook, workdir, out) -> tuple[int, str, str]:
    previous = set_io_hook(hook)
    try:
        return cli("export", workdir / "rescued", "--to", "fp32", out, "--force")
    finally:
        set_io_hook(previous)


def _messages(err: str) -> list[str]:
    """The lines of stderr a command printed itself (not its progress bars)."""
    return [line for line in err.splitlines() if line.startswith(("zero-bnb ", "zero_to_fp32: "))]


def _leftovers(folder) -> list[str]:
    return [name for name in os.listdir(folder) if name.endswith(".zero_bnb-tmp")]


@pytest.mark.parametrize("moment", ["before the rename", "after the rename"])
def test_an_interrupted_export_says_whether_the_new_file_is_in_place(work, tmp_path, moment):
    # Issue 42: `export --force` interrupted at its last folder fsync said "nothing was published and temporary
    # files were removed", while the file had been replaced.
    workdir = work[0]
    out = tmp_path / "weights.safetensors"
    out.write_bytes(PREVIOUS)
    event, target = ("replace", out) if moment == "before the rename" else ("fsync_dir", tmp_path)
    hook = _Hook(event, str(target), KeyboardInterrupt())
    code, _, err = _export_with(hook, workdir, out)
    assert hook.fired and code == 130, (code, err)
    assert len(_messages(err)) == 1 and "Traceback" not in err, err
    assert not _leftovers(tmp_path)
    if moment == "before the rename":
        assert out.read_bytes() == PREVIOUS
        assert "interrupted; nothing was published and temporary files were removed" in err, err
    else:
        assert "0.weight" in load_file(out)  # the new file, complete
        assert "nothing was published" not in err, err
        for part in (f"interrupted after {out} was renamed into place", "the new output is there and complete",
                     "before the folder naming it was synced to disk", "Run `sync`"):
            assert part in err, (part, err)


def test_an_export_whose_folder_sync_fails_after_the_rename_says_the_new_file_is_in_place(work, tmp_path):
    workdir = work[0]
    out = tmp_path / "weights.safetensors"
    out.write_bytes(PREVIOUS)
    hook = _Hook("fsync_dir", str(tmp_path), OSError(errno.EIO, os.strerror(errno.EIO)))
    code, _, err = _export_with(hook, workdir, out)
    assert hook.fired and code == 1, (code, err)
    assert "0.weight" in load_file(out) and not _leftovers(tmp_path)
    assert "nothing was written" not in err and "unchanged" not in err, err
    for part in (f"wrote {out}: the new file is in place and complete", "syncing the folder that names it failed",
                 "Input/output error", "Run `sync`"):
        assert part in err, (part, err)


def _zero_to_fp32(checkpoint, out) -> tuple[int, str, str]:
    """``python zero_to_fp32.py CHECKPOINT OUT`` (the script in the save folder runs this ``main``), in process."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = zero_to_fp32.main([str(checkpoint), str(out)])
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.mark.parametrize("command", ["zero_to_fp32", "export", "convert to zero_bnb", "convert to universal"])
def test_an_output_path_through_an_existing_file_is_named_with_the_fix(work, tmp_path, command):
    # Issue 42: `zero_to_fp32.py CKPT afile/sub` printed a NotADirectoryError traceback; export and convert into
    # afile/x said "FileExistsError: ... File exists: 'afile'" (export after reading the whole checkpoint).
    workdir = work[0]
    blocking = tmp_path / "afile"
    blocking.write_bytes(b"a user's file")
    if command == "zero_to_fp32":
        code, _, err = _zero_to_fp32(workdir / "rescued", blocking / "sub")
    elif command == "export":
        code, _, err = cli("export", workdir / "rescued", "--to", "fp32", blocking / "x.safetensors")
    elif command == "convert to zero_bnb":
        code, _, err = cli("convert", workdir / "stock" / "s3", "--to", "zero_bnb", blocking / "x")
    else:
        code, _, err = cli("convert", workdir / "rescued", "--to", "universal", blocking / "x" / "s3_universal")
    assert code != 0 and len(_messages(err)) == 1 and "Traceback" not in err, (code, err)
    for part in ("CheckpointUsageError", f"{blocking} is a file", "Choose another output path", "nothing was written"):
        assert part in err, (part, err)
    assert blocking.read_bytes() == b"a user's file" and os.listdir(tmp_path) == ["afile"]


def test_a_command_piped_into_a_reader_that_stops_ends_quietly(work):
    # Issue 42: `zero-bnb inspect CKPT | head` ended with a BrokenPipeError. The reader here is gone before the
    # command prints anything (it closes the pipe at once), so every write meets the broken pipe.
    workdir = work[0]
    root = os.path.dirname(os.path.dirname(zero_bnb.__file__))  # the zero_bnb this test imports
    process = subprocess.Popen([sys.executable, "-m", "zero_bnb", "inspect", str(workdir / "rescued")], cwd=root,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(60) == 128 + signal.SIGPIPE, err
    for noise in ("Traceback", "BrokenPipeError", "Exception ignored"):
        assert noise not in err, err


def test_a_migrated_stock_checkpoint_reports_the_dp_size_it_was_saved_at(work):
    # Issue 42: `zero-bnb verify` said "saved at DP=1" for a stock checkpoint saved at DP=2 and migrated (the DP=1
    # layout convert writes), while convert's own report said saved_dp_size: 2; so did the load's log line.
    workdir, runs, _, resumed = work
    [logged] = resumed[3]["rescued_log"]
    assert " saved at DP=2 by stock DeepSpeed (migrated offline, stored as DP=1) into DP=3 at ZeRO stage " in logged, \
        logged
    assert "saved_dp_size: 2" in _ok(runs, "rescue").splitlines()
    code, out, err = cli("verify", workdir / "rescued")
    assert code == 0, err
    assert out.strip().endswith("saved at DP=2 by stock DeepSpeed (migrated offline into zero_bnb's format, stored as "
                                "DP=1; it loads at any DP size)"), out
    code, out, err = cli("inspect", workdir / "rescued")
    assert code == 0 and "  saved at DP=2 by stock DeepSpeed (migrated offline" in out, (out, err)
    code, out, err = cli("inspect", workdir / "rescued", "--json")
    summary = json.loads(out)
    assert (summary["saved_dp_size"], summary["stored_dp_size"]) == (2, 1), summary
    assert summary["migrated_from"] == {"format": "stock DeepSpeed", "dp_world_size": 2}


def test_migrated_from_is_recorded_only_where_it_applies_and_checked(work):
    workdir = work[0]
    manifest = read_manifest(str(workdir / "rescued" / "s3" / SUBDIR))
    assert (manifest.dp_world_size, manifest.saved_dp_size) == (1, 2)
    assert "migrated_from" in manifest.to_json() and "migrated_from" not in read_manifest(
        str(workdir / "zero_bnb" / "s3" / SUBDIR)).to_json()  # a training run's manifest: as before the field
    trained = Manifest.from_json(dataclasses.replace(manifest, migrated_from={}).to_json())
    assert trained.saved_dp_size == 1 and "migrated_from" not in trained.to_json()
    for bad in ({"format": "stock DeepSpeed", "dp_world_size": 0}, {"format": "", "dp_world_size": 2},
                {"format": "stock DeepSpeed", "dp_world_size": 2, "extra": 1}, {"dp_world_size": True, "format": "x"},
                ["stock DeepSpeed", 2]):
        with pytest.raises(CheckpointFormatError, match="migrated_from"):
            Manifest.from_json(dataclasses.replace(manifest, migrated_from=bad).to_json())
