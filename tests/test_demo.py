"""The README's main job: the elastic-resume demo, shortened."""

import contextlib
import io

import pytest
import torch

from zero_bnb.cli import main
from scenarios import within

from zero_bnb.cli.demo import LOSS_BOUND, relative_differences, report

pytestmark = pytest.mark.launch

#: The first resumed step runs on bit-identical weights and state: the uninterrupted loss up to the order in which 3
#: ranks instead of 2 sum the same per-sample losses. 0 here and in the full demo under every variant of
#: docs/bounds.md; bound: the first-step bound of the other resumes (their worst 9.8e-8).
FIRST_STEP_BOUND = 5e-7


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["demo", "--out", str(out), "--steps-before", "2", "--steps-after", "3"])
    return out, code, printed.getvalue()


def test_demo_resumes_bit_identically_within_the_readme_bound_and_writes_table_and_plot(demo):
    out, code, printed = demo
    assert code == 0, printed
    assert "bit-identical" in printed and "resumed at global step 2 (saved at 2)" in printed
    reference = torch.load(out / "uninterrupted.pt", weights_only=False)["losses"]
    resumed = torch.load(out / "resumed.pt", weights_only=False)["losses"]
    assert len(reference) == 5 and len(resumed) == 3
    relative = relative_differences(reference, resumed)
    # Shortened (2 + 3 steps): every step worst 2.0e-5, well inside the full demo's LOSS_BOUND (docs/bounds.md).
    within("demo (2 + 3 steps) first resumed loss (rel.)", relative[0], FIRST_STEP_BOUND)
    within("demo (2 + 3 steps) resumed losses (rel.)", max(relative), LOSS_BOUND)
    for step, (ref, res, rel) in enumerate(zip(reference[2:], resumed, relative), start=2):  # the printed table
        assert f"{step:>4}  {ref:>20.6f}  {res:>16.6f}  {rel:>9.2e}" in printed
    assert f"of the uninterrupted run: yes (largest difference {max(relative):.2e})" in printed
    assert (out / "elastic_resume.png").stat().st_size > 10_000
    assert (out / "checkpoints" / "latest").read_text() == "step2"


def test_demo_exits_1_when_the_resumed_losses_leave_the_bound(demo, capsys):
    out, _, _ = demo
    assert report(str(out), 2, 2, 3, loss_bound=-1.0) == 1  # every difference, even 0, exceeds a negative bound
    assert "of the uninterrupted run: NO (largest difference" in capsys.readouterr().out
