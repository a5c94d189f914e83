"""The README's main job: the elastic-resume demo, shortened."""

from zero_bnb.cli import main


def test_demo_resumes_bit_identically_and_writes_table_and_plot(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--steps-before", "2", "--steps-after", "2"]) == 0
    printed = capsys.readouterr().out
    assert "bit-identical" in printed and "resumed at global step 2 (saved at 2)" in printed
    assert "   2  " in printed and "   3  " in printed  # resumed rows of the loss table
    assert (tmp_path / "elastic_resume.png").stat().st_size > 10_000
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step2"
