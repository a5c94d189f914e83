"""Wiring of the fused CPU 8-bit update into bitsandbytes optimizers (``zero_cpu_update``).

Real bitsandbytes optimizers step on CPU tensors: with the update installed every 8-bit step gives the
reference's bits (bitsandbytes' CUDA arithmetic), ``"bitsandbytes"`` and fp32 state keep bitsandbytes' own
path, and a machine without a compiler falls back once, with one warning (``"auto"``), or fails naming
the fix (``"fused"``).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os

import bitsandbytes as bnb
import pytest
import torch

from zero_bnb import cli
from zero_bnb.core.config import ZeroBnbConfigError, split_config
from zero_bnb.kernels import build, update as cpu_update
from zero_bnb.kernels.build import QUANTIZER_PATHS, KernelBuildError
from zero_bnb.kernels.update import FusedUpdate, hyper_for, install_fused_update
from zero_bnb.kernels.hyper import step_scalars
from zero_bnb.kernels.reference import reference_update

NUMEL = 5000  # above bitsandbytes' min_8bit_size (4096): 8-bit state, two blocks with a partial one
OPTIMIZERS = {
    "AdamW8bit": functools.partial(bnb.optim.AdamW8bit, weight_decay=0.1),
    "Adam8bit": bnb.optim.Adam8bit,
    "Lion8bit": functools.partial(bnb.optim.Lion8bit, weight_decay=0.1),
    "SGD8bit": functools.partial(bnb.optim.SGD8bit, momentum=0.9, weight_decay=0.01),
    "RMSprop8bit": bnb.optim.RMSprop8bit,
    "Adagrad8bit": bnb.optim.Adagrad8bit,
    "AdEMAMix8bit": functools.partial(bnb.optim.AdEMAMix8bit, t_alpha=4, t_beta3=4),
}
EIGHT_BIT = sorted(OPTIMIZERS)
OPTIMIZERS["AdamW32bit"] = bnb.optim.AdamW32bit


def make(name: str, seed: int = 0, **kwargs):
    param = torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)))
    return param, OPTIMIZERS[name]([param], lr=1e-2, **kwargs)


def gradients(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(NUMEL, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_every_cpu_8bit_step_gives_the_reference_bits(name):
    param, optimizer = make(name)
    install_fused_update(optimizer, "auto")
    for step, grad in enumerate(gradients(4), start=1):
        if step > 1:
            state = {key: value.clone() if isinstance(value, torch.Tensor) else value
                     for key, value in optimizer.state[param].items()}
            expected = param.detach().clone()
            config = optimizer.get_config(0, 0, optimizer.param_groups[0])
            hyper = hyper_for(optimizer.optimizer_name, config, step)
            reference_update(hyper, step_scalars(hyper, step), expected, grad, state["state1"], state["absmax1"],
                             state["qmap1"], state.get("state2"), state.get("absmax2"), state.get("qmap2"))
        param.grad = grad.clone()
        optimizer.step()
        assert optimizer.state[param]["state1"].dtype == torch.uint8
        if step > 1:
            assert torch.equal(param.detach(), expected), name
            for key in ("state1", "absmax1", "state2", "absmax2"):
                if key in state:
                    assert torch.equal(optimizer.state[param][key], state[key]), (name, key)
    assert optimizer.update_step.fused_steps == 4


@pytest.mark.parametrize(("name", "mode"), [("AdamW8bit", "bitsandbytes"), ("Lion8bit", "bitsandbytes"),
                                            ("AdamW32bit", "auto")])
def test_bitsandbytes_mode_and_fp32_state_keep_bitsandbytes_path(name, mode):
    plain, plain_optimizer = make(name)
    wired, wired_optimizer = make(name)
    install_fused_update(wired_optimizer, mode)
    for grad in gradients(3):
        plain.grad, wired.grad = grad.clone(), grad.clone()
        plain_optimizer.step()
        wired_optimizer.step()
    assert torch.equal(plain.detach(), wired.detach())
    assert wired_optimizer.update_step.fused_steps == 0


def _paged_like(device: str, paged: bool):
    """An Adam8bit parameter on ``device`` whose state is what bitsandbytes makes for a paged optimizer on a GPU:
    uint8 codes and float32 absmax in CPU tensors (over CUDA managed memory there) tagged ``is_paged``; the
    optimizer's own path is replaced by a recorder."""
    param = torch.nn.Parameter(torch.zeros(NUMEL, device=device))
    param.grad = torch.zeros(NUMEL, device=device)
    optimizer = bnb.optim.Adam8bit([param], lr=1e-2)
    blocks = -(-NUMEL // 256)
    state = {"step": 0, "state1": torch.zeros(NUMEL, dtype=torch.uint8), "state2": torch.zeros(NUMEL, dtype=torch.uint8),
             "absmax1": torch.zeros(blocks), "absmax2": torch.zeros(blocks),
             "qmap1": bnb.functional.create_dynamic_map(signed=True).to(device),
             "qmap2": bnb.functional.create_dynamic_map(signed=False).to(device)}
    for key in ("state1", "state2", "absmax1", "absmax2"):
        state[key].is_paged = paged
    optimizer.state[param] = state
    install_fused_update(optimizer, "auto")
    calls = []
    optimizer.update_step.original = lambda group, p, gindex, pindex: calls.append(p)
    return param, optimizer, calls


@pytest.mark.parametrize(("device", "paged"), [("meta", True), ("meta", False), ("cpu", True)])
def test_a_parameter_off_the_cpu_or_paged_state_takes_bitsandbytes_path_and_counts_nothing(device, paged):
    # On a GPU, PagedAdamW8bit's state is a CPU tensor over CUDA managed memory: deciding by the state's device sent
    # a CUDA parameter to the CPU kernel, which raised after the step was counted. The meta device stands in for CUDA.
    param, optimizer, calls = _paged_like(device, paged)
    optimizer.update_step(optimizer.param_groups[0], param, 0, 0)
    assert calls == [param]
    assert optimizer.update_step.fused_steps == 0
    assert optimizer.state[param]["step"] == 0


def test_a_step_the_kernel_refuses_is_not_counted():
    param, optimizer = make("Adam8bit")
    install_fused_update(optimizer, "auto")
    param.grad = gradients(1)[0]
    optimizer.step()
    state = optimizer.state[param]
    assert state["step"] == 1
    state["absmax2"] = state["absmax2"][:-1].clone()  # the wrong size: the kernel refuses before touching anything
    before = param.detach().clone()
    with pytest.raises(ValueError, match="absmax2 must be a contiguous CPU torch.float32 tensor of 20 elements"):
        optimizer.step()
    assert state["step"] == 1 and optimizer.update_step.fused_steps == 1
    assert torch.equal(param.detach(), before)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A machine without a C++ compiler (and an empty kernel cache)."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_update, "_warned", False)
    build.forget()
    yield
    build.forget()


def test_auto_mode_without_a_compiler_takes_bitsandbytes_path_with_one_warning(no_compiler, caplog):
    plain, plain_optimizer = make("AdamW8bit")
    wired, wired_optimizer = make("AdamW8bit")
    install_fused_update(wired_optimizer, "auto")
    with caplog.at_level(logging.WARNING, logger="zero_bnb.kernels.update"):
        for grad in gradients(3):
            plain.grad, wired.grad = grad.clone(), grad.clone()
            plain_optimizer.step()
            wired_optimizer.step()
    assert torch.equal(plain.detach(), wired.detach())
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings
    assert "zero-bnb build-kernels" in warnings[0] and "no-such-compiler" in warnings[0]


def test_fused_mode_without_a_compiler_fails_naming_the_setting_and_the_fix(no_compiler):
    _, optimizer = make("AdamW8bit")
    with pytest.raises(KernelBuildError, match=r"zero_cpu_update is \"fused\".*g\+\+.*\"bitsandbytes\""):
        install_fused_update(optimizer, "fused")
    assert not isinstance(optimizer.__dict__.get("update_step"), FusedUpdate)


def test_zero_cpu_update_is_validated_and_stripped_from_the_deepspeed_config():
    parsed, cleaned = split_config({"zero_optimization": {"stage": 1, "zero_cpu_update": "bitsandbytes"}})
    assert parsed.cpu_update == "bitsandbytes" and "zero_cpu_update" not in cleaned["zero_optimization"]
    assert split_config({})[0].cpu_update == "auto"
    with pytest.raises(ZeroBnbConfigError, match=r"zero_cpu_update must be one of \['auto', 'fused', "
                                                 r"'bitsandbytes'\], got 'fast'"):
        split_config({"zero_cpu_update": "fast"})


@pytest.mark.launch  # runs the compiler
def test_build_kernels_compiles_into_the_cache_and_reuses_it(tmp_path, monkeypatch, capsys):
    """``zero-bnb build-kernels`` (and ``python -m zero_bnb.kernels.build``): a real compile into an empty cache."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert cli.main(["build-kernels"]) == 0
    path, quantizer = capsys.readouterr().out.strip().splitlines()
    assert os.path.dirname(path) == str(tmp_path) and os.path.isfile(path)
    assert quantizer == f"quantizer: {QUANTIZER_PATHS[build.bind(path).zero_bnb_widest_path()]}"
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(path), os.path.basename(path)[:-3] + ".lock"])
    # no scratch file left behind; the lock file serialises concurrent builds
    assert build.bind(path).zero_bnb_blockwise_update.restype is ctypes.c_int
    built = os.stat(path).st_mtime_ns
    assert build.main([]) == 0 and capsys.readouterr().out.splitlines()[0] == path
    assert os.stat(path).st_mtime_ns == built, "a cached build was compiled again"
    assert cli.main(["build-kernels", "--force"]) == 0 and capsys.readouterr().out.splitlines()[0] == path
    assert os.stat(path).st_mtime_ns != built
    monkeypatch.setenv("CXX", "c++ -O2")  # flags in CXX make another build, never the cached one
    assert cli.main(["build-kernels"]) == 0
    assert capsys.readouterr().out.splitlines()[0] != path and len(glob.glob(os.path.join(tmp_path, "*.so"))) == 2


@pytest.mark.launch  # runs the compiler
@pytest.mark.parametrize("cxx", ["/nonexistent", "c++ 'unclosed"])
def test_build_kernels_with_a_bad_compiler_names_it_and_the_fix(tmp_path, monkeypatch, capsys, cxx):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", cxx)
    assert cli.main(["build-kernels"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and cxx.split()[-1] in lines[0], lines
    assert ("(from CXX)" in lines[0] and "apt-get install g++" in lines[0] and "set CXX" in lines[0]) or \
        "set CXX to a C++ compiler" in lines[0]
    assert not os.path.exists(tmp_path / "cache") or os.listdir(tmp_path / "cache") == []


@pytest.mark.launch  # runs the compiler
def test_build_kernels_reports_a_failed_compilation_with_the_compiler_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "c++ -fno-such-option-zero-bnb")
    assert cli.main(["build-kernels"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zero_bnb: compiling ") and "-fno-such-option-zero-bnb" in err.splitlines()[-1] + err
    assert [name for name in os.listdir(tmp_path) if not name.endswith(".lock")] == []  # the scratch file is removed
