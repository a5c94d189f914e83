"""The Triton 8-bit update (issue 45): the same bits as the specification, bitsandbytes' state format, and the wiring.

Where CUDA is present the kernel is compiled and runs on the GPU; elsewhere Triton's interpreter runs the same kernel
on CPU tensors (``TRITON_INTERPRET=1`` while the kernel's module is first imported, after Triton). Either way:

- property test: for every family, sizes that are not multiples of 256, zero blocks, magnitudes from 1e-30 to 1e30,
  NaN/Inf gradients and every hyper-parameter, the kernel gives the reference's parameters, codes and absmax bit for
  bit (the reference is bitsandbytes' CUDA arithmetic with IEEE division and square root: ``div_rn``, ``sqrt_rn`` and
  no contracted multiply-adds in the kernel), whatever the number of blocks one program updates;
- golden vectors: against bitsandbytes' CUDA kernel's own outputs (``tests/golden/``, written on an H200), the kernel
  meets the fused CPU kernel's bounds and gives exactly the reference's report;
- a CPU parameter never reaches the Triton kernel, whatever ``zero_gpu_update`` says; bad tensors and settings are
  refused naming them.

On a GPU (``gpu`` marker, skipped with the reason elsewhere): real bitsandbytes optimizers of every family step
through the Triton kernel with ``zero_gpu_update: "fused"`` and give the reference's bits at every step, ``"auto"``
keeps bitsandbytes' kernel (no family measured faster yet), paged state keeps bitsandbytes' kernel, and a state
written by one kernel is continued by the other.
"""

from __future__ import annotations

import os

import bitsandbytes as bnb
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_golden import ABSMAX_ULPS, CODES_OUTSIDE_TIES, FIXTURES, NAMES, NO_FIXTURES, P_ULPS
from test_cpu_update import EIGHT_BIT, NUMEL, OPTIMIZERS
from test_kernels import assert_same_bits, cases, make_inputs, run
from zero_bnb.core.config import ZeroBnbConfigError, split_config
from zero_bnb.kernels.hyper import Family, UpdateHyper, step_scalars
from zero_bnb.kernels.reference import reference_update
from zero_bnb.kernels.triton_update import triton_missing, triton_update
from zero_bnb.kernels.update import GPU_FUSED_FASTER, FusedUpdate, hyper_for, install_fused_update
from zero_bnb.testing.golden import agreement

pytestmark = pytest.mark.skipif(bool(triton_missing()), reason=f"{triton_missing()}; the test extras install it")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: the Triton kernel takes only GPU parameters")


@pytest.fixture(scope="module", autouse=True)
def kernel_mode():
    """Compile the kernel where CUDA is present, else build it under Triton's interpreter."""
    from zero_bnb.kernels.triton_update import interpreting

    if not CUDA:
        import triton  # noqa: F401 (Triton's own library compiled as usual; only the kernel is interpreted)

        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            import zero_bnb.kernels.triton_kernel  # noqa: F401 (decorated now, under the interpreter)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    assert interpreting() == (not CUDA)


def on_device(hyper, scalars, *, blocks_per_program=None, **tensors):
    """:func:`triton_update` on copies of ``tensors`` on :data:`DEVICE`, written back (the reference's interface)."""
    moved = {name: value.to(DEVICE) for name, value in tensors.items() if value is not None}
    triton_update(hyper, scalars, **moved, blocks_per_program=blocks_per_program)
    for name, value in moved.items():
        tensors[name].copy_(value.cpu())


@settings(max_examples=100, deadline=None)
@given(cases())
def test_the_triton_kernel_gives_the_reference_bits(case):
    assert_same_bits(run(on_device, case), run(reference_update, case))


@settings(max_examples=20, deadline=None)
@given(cases(), st.sampled_from([1, 8]))
def test_the_result_does_not_depend_on_how_many_blocks_one_program_updates(case, per_program):
    assert_same_bits(run(on_device, case, blocks_per_program=per_program), run(on_device, case))


@pytest.mark.parametrize("name", NAMES)
def test_the_triton_kernel_agrees_with_bitsandbytes_cuda_kernel(name):
    if not FIXTURES:
        pytest.skip(NO_FIXTURES)
    case, outputs, metadata = FIXTURES[name]
    report = agreement(case, outputs, on_device)
    print(f"[golden] {case.name} triton ({DEVICE}) against {metadata['device']}: {report}")
    assert report["code_distance"] <= 1 and report["codes_outside_ties"] <= CODES_OUTSIDE_TIES, (name, report)
    assert report["absmax_ulps"] <= ABSMAX_ULPS and report["p_ulps"] <= P_ULPS, (name, report)
    assert report["nan_mismatches"] == 0, (name, report)
    assert report == agreement(case, outputs, reference_update), name  # the same bits as the specification


def test_an_empty_partition_is_a_no_op_and_wrong_tensors_are_refused_naming_them():
    case = {"hyper": UpdateHyper(name="adam", lr=1e-3), "n": 300, "step": 3, "scale": 1.0, "zero_blocks": False,
            "nonfinite": "none", "zeros": False, "seed": 1}
    scalars = step_scalars(case["hyper"], 3)
    empty = {key: value[:0].to(DEVICE) if key.startswith(("p", "g", "state")) else value.to(DEVICE)
             for key, value in make_inputs(case).items()}
    empty["absmax1"], empty["absmax2"] = empty["absmax1"][:0], empty["absmax2"][:0]
    triton_update(case["hyper"], scalars, **empty)
    inputs = {key: value.to(DEVICE) for key, value in make_inputs(case).items()}
    inputs["absmax2"] = inputs["absmax2"][:-1]
    with pytest.raises(ValueError, match=r"absmax2 must be a contiguous torch.float32 tensor of 2 elements on "
                                         rf"{DEVICE}\S*, got {DEVICE}\S* torch.float32 shape \(1,\)"):
        triton_update(case["hyper"], scalars, **inputs)
    inputs = {key: value.to(DEVICE) for key, value in make_inputs(case).items()}
    inputs["state1"] = inputs["state1"].to(torch.int8)
    with pytest.raises(ValueError, match=r"state1 must be a contiguous torch.uint8 tensor of 300 elements"):
        triton_update(case["hyper"], scalars, **inputs)
    with pytest.raises(ValueError, match="blocks_per_program must be a power of two, got 3"):
        triton_update(case["hyper"], scalars, **{k: v.to(DEVICE) for k, v in make_inputs(case).items()},
                      blocks_per_program=3)


@pytest.mark.parametrize("value", ["fast", "Fused", None, 1])
def test_an_unknown_zero_gpu_update_is_refused_naming_the_choices(value):
    if value is None:  # the default
        assert split_config({"zero_gpu_update": None})[0].gpu_update == "auto"
        return
    with pytest.raises(ZeroBnbConfigError, match=rf"zero_gpu_update must be one of \['auto', 'fused', "
                                                 rf"'bitsandbytes'\], got {value!r}"):
        split_config({"zero_gpu_update": value})
    with pytest.raises(ValueError, match="zero_gpu_update must be one of"):
        FusedUpdate(bnb.optim.Adam8bit([torch.nn.Parameter(torch.zeros(1))]), "auto", value)


def _optimizer(name: str, device: str, numel: int = NUMEL):
    param = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device))
    return param, OPTIMIZERS[name]([param], lr=1e-2)


def _gradients(steps: int, numel: int = NUMEL) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(numel, generator=gen) for _ in range(steps)]


def test_a_cpu_parameter_never_takes_the_triton_kernel_whatever_zero_gpu_update_says():
    plain, plain_optimizer = _optimizer("AdamW8bit", "cpu")
    wired, wired_optimizer = _optimizer("AdamW8bit", "cpu")
    install_fused_update(wired_optimizer, "bitsandbytes", "fused")
    for grad in _gradients(3):
        plain.grad, wired.grad = grad.clone(), grad.clone()
        plain_optimizer.step()
        wired_optimizer.step()
    assert torch.equal(plain.detach(), wired.detach())
    update = wired_optimizer.update_step
    assert (update.fused_steps, update.triton_steps, update.kernel_for(wired)) == (0, 0, "bitsandbytes")


def test_before_the_first_step_a_paged_optimizers_cpu_parameter_is_named_for_the_kernel_that_will_step_it():
    """bitsandbytes pages only CUDA parameters of at least 1e5 elements: PagedAdamW8bit under offload has plain CPU
    state, which the fused CPU kernel steps; describe() says so before the first step as after it."""
    param, _ = _optimizer("AdamW8bit", "cpu")
    optimizer = bnb.optim.PagedAdamW8bit([param], lr=1e-3)
    install_fused_update(optimizer, "auto", "auto")
    update = optimizer.update_step
    before = update.kernel_for(param, eight_bit=True)
    param.grad = _gradients(1)[0]
    optimizer.step()
    assert before == update.kernel_for(param) == "zero_bnb fused CPU kernel" and update.fused_steps == 1


def test_installing_again_applies_the_new_settings_to_the_one_installed():
    from zero_bnb.bnb.chunked import ChunkedUpdate
    from zero_bnb.core.state_spec import spec_for

    param, optimizer = _optimizer("AdamW8bit", "cpu")
    install_fused_update(optimizer, "auto", "auto")
    first = optimizer.update_step
    optimizer.update_step = ChunkedUpdate(optimizer, spec_for(optimizer))
    install_fused_update(optimizer, "bitsandbytes", "fused")
    assert optimizer.update_step.original is first and (first.mode, first.gpu_mode) == ("bitsandbytes", "fused")
    with pytest.raises(ValueError, match="zero_gpu_update must be one of"):
        install_fused_update(optimizer, "auto", "fast")
    assert (first.mode, first.gpu_mode) == ("bitsandbytes", "fused")


def _steps_and_check(name: str, gpu_mode: str, steps: int = 4) -> FusedUpdate:
    """Step a real ``name`` on the GPU with ``zero_gpu_update = gpu_mode``; from step 2 on, every step must give the
    reference's bits from the state before it (the first step allocates the state)."""
    param, optimizer = _optimizer(name, "cuda")
    install_fused_update(optimizer, "auto", gpu_mode)
    for step, grad in enumerate(_gradients(steps), start=1):
        state = {key: value.cpu().clone() if isinstance(value, torch.Tensor) else value
                 for key, value in optimizer.state[param].items()}
        expected = param.detach().cpu().clone()
        param.grad = grad.to("cuda")
        optimizer.step()
        if step == 1 or gpu_mode != "fused":
            continue
        config = optimizer.get_config(0, 0, optimizer.param_groups[0])
        hyper = hyper_for(optimizer.optimizer_name, config, step)
        reference_update(hyper, step_scalars(hyper, step), expected, grad, state["state1"], state["absmax1"],
                         state["qmap1"], state.get("state2"), state.get("absmax2"), state.get("qmap2"))
        assert torch.equal(param.detach().cpu(), expected), (name, step)
        for key in ("state1", "absmax1", "state2", "absmax2"):
            if key in state:
                assert torch.equal(optimizer.state[param][key].cpu(), state[key]), (name, step, key)
    return optimizer.update_step


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", EIGHT_BIT)
def test_every_gpu_8bit_step_with_fused_gives_the_reference_bits(name):
    update = _steps_and_check(name, "fused")
    assert update.triton_steps == 4 and update.fused_steps == 0


@pytest.mark.gpu
@needs_gpu
def test_auto_keeps_bitsandbytes_kernel_until_a_gpu_measurement_shows_the_triton_one_faster():
    assert not GPU_FUSED_FASTER
    assert _steps_and_check("AdamW8bit", "auto").triton_steps == 0


@pytest.mark.gpu
@needs_gpu
def test_paged_state_keeps_bitsandbytes_kernel():
    param = torch.nn.Parameter(torch.randn(200_000, device="cuda"))
    optimizer = bnb.optim.PagedAdamW8bit([param], lr=1e-3)
    install_fused_update(optimizer, "auto", "fused")
    for _ in range(2):
        param.grad = torch.randn_like(param)
        optimizer.step()
    assert optimizer.update_step.triton_steps == 0
    assert optimizer.update_step.kernel_for(param) == "bitsandbytes"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("first", ["fused", "bitsandbytes"])
def test_a_state_written_by_one_kernel_is_continued_by_the_other(first):
    """The state format is bitsandbytes' own: 3 steps with one kernel then 3 with the other end no further from 6
    steps of bitsandbytes' kernel than 6 steps of the Triton kernel do (a control in the same run: the kernels differ
    by bitsandbytes' fast-math ulps); a misread state (absmax rows, map, codes) would end far from both."""
    second = "bitsandbytes" if first == "fused" else "fused"
    runs = {mode: _optimizer("AdamW8bit", "cuda") for mode in ("mixed", "fused", "bitsandbytes")}
    for mode, (_, optimizer) in runs.items():
        install_fused_update(optimizer, "auto", first if mode == "mixed" else mode)
    for index, grad in enumerate(_gradients(6)):
        if index == 3:
            runs["mixed"][1].update_step.gpu_mode = second
        for param, optimizer in runs.values():
            param.grad = grad.to("cuda")
            optimizer.step()
    assert runs["mixed"][1].update_step.triton_steps == 3 and runs["fused"][1].update_step.triton_steps == 6
    reference = runs["bitsandbytes"][0].detach()
    control = float((runs["fused"][0].detach() - reference).abs().max())
    mixed = float((runs["mixed"][0].detach() - reference).abs().max())
    assert mixed <= 5 * control, (mixed, control)


@pytest.mark.launch
@pytest.mark.skipif(CUDA, reason="with a GPU the kernel itself runs (the gpu tests above check its bits)")
def test_the_kernel_compiles_for_hopper_gpus_with_ieee_division_and_square_root_and_no_fused_multiply_add():
    """Without a GPU: Triton compiles the kernel for sm_90 (H100, H200) to a cubin, and its PTX divides and takes
    square roots rounded to nearest (``div.rn``, ``sqrt.rn``) with no ``fma``, which is what makes its bits the
    reference's on a GPU; the control compiled with multiply-adds allowed has them, so the count can see them."""
    import json
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "triton_compile_scenarios.py"),
                             "90"], capture_output=True, text=True, env=env, timeout=600)
    if result.returncode and "Cannot find ptxas" in result.stderr:
        pytest.skip("this Triton has no ptxas to compile with")
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    control = found.pop("sm_90 adam control: multiply-adds allowed")
    assert sorted(found) == sorted(f"sm_90 {family.value}" for family in Family)
    for variant, counts in found.items():
        assert counts["cubin"] and counts["fma"] == 0, (variant, counts)
        assert counts["div.approx"] == counts["sqrt.approx"] == 0 and counts["div.rn.f32"] > 0, (variant, counts)
    assert control["fma"] > 0, control


@pytest.mark.launch
@pytest.mark.parametrize(("package", "said"), [
    ("raise RuntimeError('libcuda.so not found')", "Triton cannot be imported (RuntimeError: libcuda.so not found)"),
    ("__version__ = '2.1.0'\n", "Triton 2.1.0 lacks what the kernel needs"),
])
def test_a_triton_that_cannot_serve_is_named_not_raised(tmp_path, package, said):
    """An installed Triton that fails to import, or one too old, makes the GPU update fall back (``auto``) or fail
    naming why (``fused``), never an exception from inside an optimizer step."""
    import subprocess
    import sys

    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text(package)
    (tmp_path / "triton" / "language.py").write_text("class math: pass\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", "from zero_bnb.kernels.triton_update import triton_missing; "
                                                 "print(triton_missing())"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}"})
    assert done.returncode == 0 and done.stdout.startswith(said), (done.stdout, done.stderr[-2000:])


def test_describe_names_bitsandbytes_only_for_its_optimizers():
    """An engine of torch's AdamW steps with the optimizer's own step, not 'bitsandbytes' (describe(), the logs)."""
    from zero_bnb.kernels.update import update_kernel

    param = torch.nn.Parameter(torch.zeros(4))
    assert update_kernel(torch.optim.AdamW([param]), param) == "the optimizer's own step"
    assert update_kernel(bnb.optim.AdamW8bit([param]), param) == "bitsandbytes"  # no FusedUpdate installed
