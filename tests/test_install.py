"""Installs that work (issue 34, point 4): ``python -m build`` makes an sdist and a wheel of this tree; the sdist,
unpacked, installs into a fresh virtual environment by exactly the shell lines of README.md's install block
(between ``<!-- install:begin -->`` and ``<!-- install:end -->``), and the wheel built from it installs into another.
Each environment imports zero_bnb from its own site-packages (not this tree), runs ``zero-bnb --help``; the first
also compiles the fused kernel from the C++ sources it installed and runs the demo, shortened.

The environments see this machine's packages (``--system-site-packages``: torch, DeepSpeed, bitsandbytes,
transformers, Accelerate, Lightning), and pip is kept off the network (``PIP_NO_INDEX``) and builds with the
installed setuptools (``PIP_NO_BUILD_ISOLATION``): the test runs offline. A user's pip, online, fetches
setuptools into an isolated build environment instead; the lines are the same.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

pytest.importorskip("build", reason="building the sdist needs the `build` package (the test extra installs it)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- install:begin -->", "<!-- install:end -->"
#: What both distributions must carry: the fused kernel's C++ sources (compiled on first use).
CSRC = ("zero_bnb/kernels/csrc/blockwise_update.cpp", "zero_bnb/kernels/csrc/codec.h",
        "zero_bnb/kernels/csrc/quantize_tables.h")
#: Left out when this tree is copied (build outputs, caches, virtual environments).
NOT_COPIED = (".git", "*.egg-info", "__pycache__", "build", "dist", ".hypothesis", ".pytest_cache", ".venv", "venv",
              "demo_output", "checkpoints", "bench_output", ".gpu")


def install_lines(readme: str) -> list[str]:
    """The shell lines between README.md's install markers (each on a line of its own), without the code fence,
    comment lines and blank lines.

    Raises:
        AssertionError: the markers are missing, repeated or out of order, or the block holds no command.
    """
    lines = readme.splitlines()
    assert lines.count(BEGIN) == 1 and lines.count(END) == 1, f"README.md needs one {BEGIN} and one {END} line"
    begin, end = lines.index(BEGIN), lines.index(END)
    assert begin < end, f"{BEGIN} must come before {END} in README.md"
    commands = [line for line in lines[begin + 1 : end]
                if line.strip() and not line.lstrip().startswith(("#", "```"))]
    assert commands, f"README.md's install block ({BEGIN} ... {END}) holds no command"
    return commands


def _environment(venv: str) -> dict[str, str]:
    """The environment of a user who activated ``venv``: no PYTHONPATH (this tree stays out), pip offline."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("PIP_") and key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(VIRTUAL_ENV=venv, PATH=os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""),
               PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1")
    return env


def _run(command: list[str], *, cwd: str, env: dict[str, str] | None = None, timeout: int = 600) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _copy_of_this_tree(destination: str) -> str:
    shutil.copytree(ROOT, destination, ignore=shutil.ignore_patterns(*NOT_COPIED))
    return destination


def _site_packages(venv: str) -> str:
    return sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})


def _where_zero_bnb_is(venv: str, cwd: str) -> str:
    code = "import zero_bnb, os; print(os.path.realpath(zero_bnb.__file__))"
    return _run([os.path.join(venv, "bin", "python"), "-c", code], cwd=cwd, env=_environment(venv)).strip()


@pytest.fixture(scope="module")
def distributions(tmp_path_factory):
    """The sdist of a copy of this tree (so the build writes nothing here), unpacked, and the wheel built from it
    (``python -m build`` builds its wheel from the sdist too)."""
    work = tmp_path_factory.mktemp("install")
    source = _copy_of_this_tree(str(work / "tree"))
    out = str(work / "dist")
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", out, source], cwd=str(work))
    [sdist] = [os.path.join(out, name) for name in os.listdir(out) if name.endswith(".tar.gz")]
    with tarfile.open(sdist) as archive:
        archive.extractall(work / "unpacked", filter="data")
    [unpacked] = [str(path) for path in (work / "unpacked").iterdir()]
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, unpacked], cwd=str(work))
    [wheel] = [os.path.join(out, name) for name in os.listdir(out) if name.endswith(".whl")]
    return {"work": work, "sdist": sdist, "unpacked": unpacked, "wheel": wheel}


def test_the_sdist_and_the_wheel_carry_the_kernel_sources_and_the_constraints(distributions):
    with tarfile.open(distributions["sdist"]) as archive:
        top = os.path.basename(distributions["unpacked"])
        names = {name.removeprefix(top + "/") for name in archive.getnames()}
    assert {*CSRC, "scripts/defaults.txt", "pyproject.toml", "README.md"} <= names, sorted(names)[:40]
    with zipfile.ZipFile(distributions["wheel"]) as archive:
        wheel = set(archive.namelist())
        [metadata] = [name for name in wheel if name.endswith(".dist-info/METADATA")]
        summary = re.search(r"^Summary: (.*)$", archive.read(metadata).decode(), re.M).group(1)
    assert set(CSRC) <= wheel, sorted(wheel)[:40]
    assert "stages 1, 2 and 3" in summary, summary


def test_the_readmes_install_lines_install_the_sdist_into_a_fresh_venv_that_runs_the_cli_kernel_and_demo(
        distributions, tmp_path):
    unpacked = distributions["unpacked"]
    venv = str(tmp_path / "venv")
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=str(tmp_path))
    if any(name.startswith("setuptools") for name in os.listdir(_site_packages(venv))):
        # Python 3.11's venv brings setuptools 65, older than pyproject's build requirement; offline, without build
        # isolation, the build must use this machine's (online, pip fetches one into an isolated build instead)
        _run([os.path.join(venv, "bin", "python"), "-m", "pip", "uninstall", "-y", "setuptools"], cwd=str(tmp_path),
             env=_environment(venv))
    lines = install_lines(open(os.path.join(unpacked, "README.md"), encoding="utf-8").read())
    # exactly the README's lines, from the unpacked sdist, in the venv as a user who activated it
    printed = _run(["bash", "-euo", "pipefail", "-c", "\n".join(lines)], cwd=unpacked, env=_environment(venv))
    assert "usage: zero-bnb" in printed, printed[-3000:]
    installed = _where_zero_bnb_is(venv, cwd=str(tmp_path))
    assert installed.startswith(os.path.realpath(_site_packages(venv)) + os.sep), installed
    env = {**_environment(venv), "ZERO_BNB_KERNEL_DIR": str(tmp_path / "kernels")}  # compiled from installed csrc
    built = _run([os.path.join(venv, "bin", "zero-bnb"), "build-kernels"], cwd=str(tmp_path), env=env).splitlines()
    assert built[0].startswith(str(tmp_path / "kernels") + os.sep) and built[1].startswith("quantizer: "), built
    demo = _run([os.path.join(venv, "bin", "zero-bnb"), "demo", "--steps-before", "1", "--steps-after", "1",
                 "--save-dp", "1", "--resume-dp", "2", "--out", str(tmp_path / "demo")], cwd=str(tmp_path), env=env)
    assert "bit-identical" in demo and "resumed at global step 1 (saved at 1)" in demo, demo[-3000:]


def test_the_wheel_installs_into_a_fresh_venv_that_runs_the_cli(distributions, tmp_path):
    venv = str(tmp_path / "venv")
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], cwd=str(tmp_path))
    python = os.path.join(venv, "bin", "python")  # this machine's pip (seen through the system site-packages)
    _run([python, "-m", "pip", "install", "-c", os.path.join(distributions["unpacked"], "scripts", "defaults.txt"),
          f"{distributions['wheel']}[hf,lightning]"], cwd=str(tmp_path), env=_environment(venv))
    installed = _where_zero_bnb_is(venv, cwd=str(tmp_path))
    assert installed.startswith(os.path.realpath(_site_packages(venv)) + os.sep), installed
    assert all(os.path.isfile(os.path.join(os.path.dirname(installed), *path.split("/")[1:])) for path in CSRC)
    printed = _run([os.path.join(venv, "bin", "zero-bnb"), "--help"], cwd=str(tmp_path), env=_environment(venv))
    assert "usage: zero-bnb" in printed, printed


@pytest.mark.parametrize(("readme", "wrong"), [
    ("no markers\n", "needs one"),
    (f"{END}\n```bash\npip install .\n```\n{BEGIN}\n", "must come before"),
    (f"{BEGIN}\n```bash\n# only a comment\n```\n{END}\n", "holds no command"),
    (f"{BEGIN}\n{BEGIN}\n{END}\n", "needs one"),
])
def test_a_readme_without_a_usable_install_block_is_named(readme, wrong):
    with pytest.raises(AssertionError, match=wrong):
        install_lines(readme)


def test_the_install_lines_are_the_commands_between_the_markers():
    readme = f"text\n{BEGIN}\n```bash\n# a comment\nA=1 pip install .   # trailing words\n\nzero-bnb --help\n```\n{END}\n"
    assert install_lines(readme) == ["A=1 pip install .   # trailing words", "zero-bnb --help"]
