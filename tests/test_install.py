"""Installs that work (issue 34, point 4): ``python -m build`` makes an sdist and a wheel of this tree; the sdist,
unpacked, installs into a fresh virtual environment by exactly the shell lines of README.md's install block
(between ``<!-- install:begin -->`` and ``<!-- install:end -->``), and the wheel built from it installs into another.
Each environment imports zero_bnb from its own site-packages (not this tree), runs ``zero-bnb --help``; the first
also compiles the fused kernel from the C++ sources it installed and runs the demo, shortened.

The environments see the packages of the environment the tests run in (torch, DeepSpeed, bitsandbytes,
transformers, Accelerate, Lightning), a virtual environment included (issue 42, point 8: a venv made from inside
one is based on the base interpreter and saw only its packages, see ``_fresh_venv``), and pip is kept off the
network (``PIP_NO_INDEX``) and builds with that environment's setuptools (``PIP_NO_BUILD_ISOLATION``): the test runs
offline. A user's pip, online, fetches setuptools into an isolated build environment instead; the lines are the same.

The two commands on a system Python that its distribution manages (PEP 668: pip refuses to install into it):
``scripts/setup.sh`` makes the virtual environment ``.venv`` and installs into it, ``scripts/test.sh`` and
``scripts/demo.sh`` run with it, and a second run reuses it (issue 42, point 8).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=55)]

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
    """Where ``import zero_bnb`` in ``venv`` loads it from (the import system's answer, without running it)."""
    code = "import importlib.util, os; print(os.path.realpath(importlib.util.find_spec('zero_bnb').origin))"
    return _run([os.path.join(venv, "bin", "python"), "-c", code], cwd=cwd, env=_environment(venv)).strip()


def _in_a_venv() -> bool:
    return sys.prefix != sys.base_prefix


def _fresh_venv(venv: str) -> str:
    """A fresh virtual environment that sees the packages of the environment this test runs in, as a user's venv on
    this machine would.

    Outside a virtual environment, ``--system-site-packages`` is that. Inside one, ``python -m venv`` makes a venv
    of the base interpreter, and ``--system-site-packages`` shows it the base's packages only, not the running
    venv's (issue 42, point 8: the base's older setuptools refused pyproject's SPDX license, offline pip found no
    DeepSpeed): a ``.pth`` file chains the running venv's site-packages in after the new venv's own and before the
    base's (``site.addsitedir``, so the running venv's own ``.pth`` files apply too, an editable install's or a
    venv chained the same way), and the base's are seen only when the running venv sees them. Made without a pip of
    its own (0.1 s instead of 5 s, and no bundled setuptools older than pyproject's build requirement): ``bin/pip``
    runs the running environment's pip under the venv's interpreter, which installs into the venv.
    """
    system = True
    if _in_a_venv():
        with open(os.path.join(sys.prefix, "pyvenv.cfg"), encoding="utf-8") as cfg:
            settings = {key.strip(): value.strip() for key, _, value in (line.partition("=") for line in cfg)}
        system = settings.get("include-system-site-packages") == "true"
    _run([sys.executable, "-m", "venv", "--without-pip", *(["--system-site-packages"] if system else []), venv],
         cwd=os.path.dirname(venv))
    if _in_a_venv():
        paths = sysconfig.get_paths()
        chained = "; ".join(f"site.addsitedir({path!r})" for path in dict.fromkeys((paths["purelib"],
                                                                                       paths["platlib"])))
        with open(os.path.join(_site_packages(venv), "_running_environment.pth"), "w", encoding="utf-8") as pth:
            pth.write(f"import site; {chained}\n")
    pip = os.path.join(venv, "bin", "pip")
    with open(pip, "w", encoding="utf-8") as script:
        script.write('#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n')
    os.chmod(pip, 0o755)
    return venv


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
    venv = _fresh_venv(str(tmp_path / "venv"))
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
    venv = _fresh_venv(str(tmp_path / "venv"))
    python = os.path.join(venv, "bin", "python")
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


def test_a_venv_made_from_inside_an_active_venv_sees_that_venvs_packages(tmp_path):
    """Issue 42, point 8: the tests above, run from inside a user's virtual environment, made venvs that saw the base
    interpreter's packages, not that venv's. Here the user's venv (which sees this environment's packages) has a
    distribution that neither this environment nor the base has (as it had DeepSpeed and a newer setuptools);
    ``_fresh_venv``, run by that venv's Python, makes a venv that imports it, finds its metadata and, offline, has
    pip find it installed; its own site-packages come first, then the user venv's, then the rest."""
    outer, nested = _fresh_venv(str(tmp_path / "user-venv")), str(tmp_path / "nested")
    with open(os.path.join(_site_packages(outer), "only_in_the_user_venv.py"), "w", encoding="utf-8") as module:
        module.write("WHERE = 'user venv'\n")
    info = os.path.join(_site_packages(outer), "only_in_the_user_venv-1.0.dist-info")
    os.mkdir(info)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as metadata:
        metadata.write("Metadata-Version: 2.1\nName: only-in-the-user-venv\nVersion: 1.0\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    make = f"import sys; sys.path.insert(0, {tests!r}); import test_install; test_install._fresh_venv({nested!r})"
    _run([os.path.join(outer, "bin", "python"), "-c", make], cwd=str(tmp_path), env=_environment(outer))
    python = os.path.join(nested, "bin", "python")
    code = ("import importlib.metadata as m, sys, only_in_the_user_venv as o; print(o.WHERE, m.version(o.__name__)); "
            "print('\\n'.join(p for p in sys.path if p.endswith('-packages')))")
    where, *sites = _run([python, "-c", code], cwd=str(tmp_path), env=_environment(nested)).splitlines()
    assert where == "user venv 1.0", where
    assert [os.path.realpath(path) for path in sites[:2]] == [
        os.path.realpath(_site_packages(nested)), os.path.realpath(_site_packages(outer))] and len(sites) > 2, sites
    found = _run([python, "-m", "pip", "install", "only-in-the-user-venv"], cwd=str(tmp_path), env=_environment(nested))
    assert "Requirement already satisfied: only-in-the-user-venv" in found, found


def _externally_managed_python(prefix: str) -> str:
    """A system Python that its distribution manages (PEP 668), made at ``prefix`` from the interpreter these tests
    run on: its binary (copied: a Python finds its prefix from where its binary really is), its standard library
    (linked) with an ``EXTERNALLY-MANAGED`` file beside it, and a site-packages directory with the packages of the
    environment these tests run in (linked: torch, DeepSpeed, ...) but zero_bnb, which setup.sh is to install. pip
    refuses to install into it as it refuses on Debian 12; like Debian's python3 without python3-venv, it has no
    ``ensurepip``. Returns its ``bin`` directory, with ``python3`` in it. Skips where the interpreter's layout is not
    the POSIX one."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    stdlib = sysconfig.get_path("stdlib")
    if os.name != "posix" or os.path.realpath(stdlib) != os.path.realpath(
            os.path.join(sys.base_prefix, "lib", version)):
        pytest.skip(f"made for a POSIX layout of the standard library ({stdlib})")
    binary = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    bin_dir, lib = os.path.join(prefix, "bin"), os.path.join(prefix, "lib", version)
    os.makedirs(bin_dir)
    os.makedirs(lib)
    shutil.copy2(binary, os.path.join(bin_dir, version))
    os.symlink(version, os.path.join(bin_dir, "python3"))
    for shared in glob.glob(os.path.join(sysconfig.get_config_var("LIBDIR") or "/nonexistent", "libpython*")):
        os.symlink(shared, os.path.join(prefix, "lib", os.path.basename(shared)))  # for an $ORIGIN/../lib rpath
    for name in os.listdir(stdlib):
        if name not in ("site-packages", "dist-packages", "ensurepip", "EXTERNALLY-MANAGED"):
            os.symlink(os.path.join(stdlib, name), os.path.join(lib, name))
    with open(os.path.join(lib, "EXTERNALLY-MANAGED"), "w", encoding="utf-8") as marker:
        marker.write("[externally-managed]\nError=A test's stand-in for a distribution's Python (PEP 668)\n")
    python = os.path.join(bin_dir, "python3")
    site_packages = _run([python, "-c", "import site; print(site.getsitepackages()[0])"], cwd=prefix).strip()
    assert os.path.realpath(site_packages).startswith(os.path.realpath(prefix) + os.sep), site_packages
    os.makedirs(site_packages)
    # the site directories of this environment, those that .pth files chain in included (their packages are linked
    # here directly, so the .pth files that chain them are left out), the first of a name wins as on sys.path
    directories = [*site.getsitepackages(), *(path for path in sys.path if path.endswith("-packages"))]
    for directory in dict.fromkeys(os.path.realpath(path) for path in directories if os.path.isdir(path)):
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if re.match(r"(__editable___)?zero_bnb(_|$)", name.lower().replace("-", "_").replace(".", "_")) or (
                    name.endswith(".pth") and "addsitedir" in open(path, encoding="utf-8", errors="replace").read()):
                continue
            if not os.path.lexists(os.path.join(site_packages, name)):
                os.symlink(path, os.path.join(site_packages, name))
    return bin_dir


def test_on_an_externally_managed_python_the_two_commands_install_into_and_run_with_a_dot_venv(tmp_path):
    """Issue 42, point 8: on a system Python that refuses ``pip install`` (PEP 668), ``bash scripts/demo.sh`` and
    ``bash scripts/test.sh``, as the README writes them, make (then reuse) the virtual environment ``.venv``,
    install into it, not the system, and run with it. The scripts and pyproject.toml are this tree's; the package
    is a stand-in whose ``python -m zero_bnb`` and test say which Python runs them (the real demo and suite take
    minutes)."""
    bin_dir = _externally_managed_python(str(tmp_path / "system"))
    system_python = os.path.join(bin_dir, "python3")
    site_packages = _run([system_python, "-c", "import site; print(site.getsitepackages()[0])"],
                         cwd=str(tmp_path)).strip()
    before = sorted(os.listdir(site_packages))
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("PIP_") and key not in ("PYTHON", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0",
               PYTHONNOUSERSITE="1")

    tree = tmp_path / "clone"
    shutil.copytree(os.path.join(ROOT, "scripts"), tree / "scripts")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), tree / name)
    (tree / "zero_bnb").mkdir()
    (tree / "zero_bnb" / "__init__.py").write_text("")
    (tree / "zero_bnb" / "__main__.py").write_text(
        "import sys\nprint('zero_bnb', *sys.argv[1:], 'run by', sys.prefix)\n")
    (tree / "tests").mkdir()
    (tree / "tests" / "test_which.py").write_text(
        "import sys\n\ndef test_which():\n    print('pytest run by', sys.prefix)\n")
    venv = str(tree / ".venv")

    first = _run(["bash", "scripts/demo.sh", "--steps", "1"], cwd=str(tree), env=env)
    assert (f"setup: {system_python} is externally managed (PEP 668: pip installs nothing into it): making the "
            "virtual environment .venv (--system-site-packages)") in first, first
    assert f"setup: Python environment {venv}\n" in first and "setup: installing zero_bnb[test,demo]" in first, first
    assert first.endswith(f"zero_bnb demo --steps 1 run by {venv}\n"), first
    code = "import importlib.metadata as m; print(m.distribution('zero_bnb').locate_file(''))"
    installed = _run([os.path.join(venv, "bin", "python"), "-c", code], cwd=str(tmp_path), env=env).strip()
    assert os.path.realpath(installed) == os.path.realpath(_site_packages(venv)), installed  # in .venv, editable
    assert sorted(os.listdir(site_packages)) == before  # nothing installed into the system

    second = _run(["bash", "scripts/test.sh", "-q", "-s", "-p", "no:cacheprovider", "tests/test_which.py"],
                  cwd=str(tree), env=env)
    assert f"setup: {system_python} is externally managed (PEP 668: pip installs nothing into it): using the " \
           "virtual environment .venv" in second, second
    assert "installing" not in second and "making" not in second, second  # a second run only re-checks
    assert f"pytest run by {venv}\n" in second and "1 passed" in second, second


def test_the_scripts_venv_is_git_ignored():
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git clone")
    ignored = subprocess.run(["git", "check-ignore", "-q", ".venv/"], cwd=ROOT, capture_output=True, timeout=60)
    assert ignored.returncode == 0, "scripts/setup.sh's .venv must be in .gitignore"


def _installed_module():
    spec = importlib.util.spec_from_file_location("_setup_installed", os.path.join(ROOT, "scripts", "installed.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setups_recheck_reads_the_installed_metadata_and_names_what_is_missing(tmp_path, monkeypatch):
    """scripts/setup.sh installs nothing when scripts/installed.py finds the project at pyproject's version and every
    requirement of its dependencies and extras, recursively (extras and markers followed), inside its range."""
    site_dir = tmp_path / "site"
    for name, version, requires in (("fake-a", "1.0", ["fake-b>=1", 'fake-c; extra == "more"']),
                                    ("fake-b", "1.0", []), ("fake-d", "1.0", ["fake-b>=2"]),
                                    ("fake-project", "0.5", [])):
        info = site_dir / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                       + "".join(f"Requires-Dist: {line}\n" for line in requires))
    monkeypatch.syspath_prepend(str(site_dir))
    missing = _installed_module().missing

    def check(dependencies, extras=(), version="0.5", optional='x = ["fake-b"]'):
        pyproject = tmp_path / "pyproject.toml"
        pyproject.write_text(f'[project]\nname = "fake-project"\nversion = "{version}"\n'
                             f"dependencies = {dependencies!r}\n[project.optional-dependencies]\n{optional}\n")
        return missing(list(extras), str(pyproject))

    assert check(["fake-a", "fake-b>=1", "not-installed-anywhere; python_version < '3'"], ["x"]) is None
    assert check([], version="0.6") == "fake-project 0.5 is installed, this tree is 0.6"
    assert check([], ["y"]) == "pyproject.toml has no extra y"
    assert check(["not-installed-anywhere>=1"]) == "not-installed-anywhere>=1 is not installed"
    assert check([], ["x"], optional='x = ["fake-b>=1.1"]') == "fake-b 1.0 is installed, fake-b>=1.1 is needed"
    assert check(["fake-d"]) == "fake-b 1.0 is installed, fake-b>=2 is needed"  # a requirement of a requirement
    assert check(["fake-a[more]"]) == "fake-c is not installed"  # a requirement of a requirement's extra
