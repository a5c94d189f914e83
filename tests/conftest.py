"""Suite-wide pytest hooks."""

from __future__ import annotations

import gc
import multiprocessing
import os
import resource
import shutil
import subprocess
import tempfile
import time

import pytest
from hypothesis import settings

from zero_bnb.testing import launch, warm

# Property tests are judged by their examples, not by hypothesis' 200 ms per example: the suite runs on parallel
# workers (scripts/test.sh), so a test shares the cores with another module's launches.
settings.register_profile("zero_bnb", deadline=None)
settings.load_profile("zero_bnb")

#: Spelled as in tests/scenarios.py (run_phases appends each phase that raised there, on every rank).
FAILED_PHASES_ENV = "ZERO_BNB_FAILED_PHASES"


def pytest_configure(config) -> None:
    """One record of failed launch phases for the run, inherited by every launched rank through the environment."""
    folder = tempfile.mkdtemp(prefix="zero_bnb-phases-")
    os.environ[FAILED_PHASES_ENV] = os.path.join(folder, "failed.tsv")
    open(os.environ[FAILED_PHASES_ENV], "w").close()
    # CPU launches fork from one server that imported torch, DeepSpeed and bitsandbytes once (zero_bnb.testing.warm);
    # ZERO_BNB_WARM_LAUNCH=0 spawns every rank as the demo and benchmarks do
    if os.environ.get(warm.WARM_ENV) != "0":
        warm.enable_here()


def pytest_unconfigure(config) -> None:
    shutil.rmtree(os.path.dirname(os.environ.get(FAILED_PHASES_ENV, "")) or "/nonexistent", ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def no_failed_phase_unnoticed(request):
    """A launch phase (tests/scenarios.run_phases) that raised is recorded and the next phase runs, so its error
    fails only the tests that read its results; a phase no test reads used to fail unnoticed. After each module,
    every phase its launches saw raise must be one the module declares in ``EXPECTED_PHASE_FAILURES`` (issue 44)."""
    path = os.environ[FAILED_PHASES_ENV]
    start = os.path.getsize(path)
    yield
    with open(path) as log:
        log.seek(start)
        failed = [line.split("\t") for line in log.read().splitlines() if line]
    expected = set(getattr(request.module, "EXPECTED_PHASE_FAILURES", ()))
    unexpected = sorted({(name, error) for name, _, error in failed if name not in expected})
    if unexpected:
        pytest.fail(f"launch phases of {request.module.__name__} raised and no test expected it (declare expected ones "
                    f"in EXPECTED_PHASE_FAILURES): {unexpected[:10]}", pytrace=False)


def pytest_collection_finish(session) -> None:
    """Freeze what collection imported (torch, DeepSpeed, bitsandbytes, transformers, Lightning: about half a million
    objects that live as long as the run) out of the cyclic collector: each collection then costs what the tests
    allocate. DeepSpeed's zero_to_fp32 collects once per file it writes, 1.3 to 1.9 s each on this suite's heap
    (tests/test_stage3.py calls it in process). Spawned workers do the same (zero_bnb.testing.launch)."""
    gc.freeze()


def _module_seconds(item) -> float:
    """What the ``slow(seconds=N)`` marks of ``item`` say its module takes (0 when none does)."""
    return max((float(mark.kwargs.get("seconds", 0)) for mark in item.iter_markers("slow")), default=0.0)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Whole modules in the order of their ``slow(seconds=N)`` marks, the longest first (the others after, as
    collected): scripts/test.sh runs the suite on parallel workers (pytest-xdist, ``--dist loadfile
    --no-loadscope-reorder``) that each take the next whole module, so the long ones start first and short ones fill
    the end. Every worker sorts the same collection the same way."""
    weight: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::")[0]  # the file: the unit a loadfile worker takes
        weight[module] = max(weight.get(module, 0.0), _module_seconds(item))
    items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])  # stable: each module's own order is kept


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime + warm.children_cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    subprocess._cleanup()  # children an earlier test left unwaited are reaped now, not in this test
    multiprocessing.active_children()
    item.stash[_CHILDREN_AT_START] = _children_cpu_seconds()
    item.stash[_LAUNCHES_AT_START] = launch.launches()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """``-m "not launch"`` must select only in-process tests: a test without the ``launch`` marker whose setup or call
    ran a ``run_distributed`` launch (counted exactly: a warm launch's ranks spend little CPU) or waited for child
    processes that spent over a second of CPU (``RUSAGE_CHILDREN``, counted once they are reaped:
    one rank importing torch alone spends more; a compiler's version probe spends a few milliseconds) fails. Teardown
    is not counted: a shared server started by a marked module may be reaped at any later test's teardown."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.passed and item.get_closest_marker("launch") is None:
        spent = _children_cpu_seconds() - item.stash.get(_CHILDREN_AT_START, float("inf"))
        launched = launch.launches() - item.stash.get(_LAUNCHES_AT_START, 0)
        if spent > LAUNCH_CPU_SECONDS or launched:
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} ran {launched} run_distributed launch(es) and waited for child "
                               f"processes ({spent:.2f} s of their CPU) but is not marked 'launch': add pytestmark = "
                               f"pytest.mark.launch to its module")


_CHILDREN_AT_START = pytest.StashKey[float]()
_LAUNCHES_AT_START = pytest.StashKey[int]()
#: Child CPU seconds above which a test counts as launching processes.
LAUNCH_CPU_SECONDS = 1.0


#: The full suite's time budget in seconds (scripts/test.sh sets it when it runs the whole suite): a run past it fails,
#: so the suite cannot quietly grow back past CI's patience (issue 44: 12 minutes on 2 cores).
SUITE_BUDGET_ENV = "ZERO_BNB_SUITE_BUDGET_S"
_SESSION_START = pytest.StashKey[float]()


def pytest_sessionstart(session) -> None:
    session.stash[_SESSION_START] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    budget = os.environ.get(SUITE_BUDGET_ENV)
    if not budget or _SESSION_START not in session.stash or exitstatus != 0:  # a failed run keeps its own status
        return
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the run's own process judges the whole run
        return
    spent = time.monotonic() - session.stash[_SESSION_START]
    if spent > float(budget):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write("\n")
            reporter.write_line(f"zero_bnb: the suite took {spent:.0f} s, over its budget of {float(budget):.0f} s "
                                f"({SUITE_BUDGET_ENV}, set by scripts/test.sh): make the suite faster before adding "
                                f"to it (pytest --durations=30 names the slowest)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
