"""``zero_bnb.enable()`` / ``disable()`` / ``enabled()`` as a careless user would call them (one process).

Routing is observed through a user's own ``deepspeed.initialize`` wrapper that raises a sentinel
instead of building an engine, and through zero_bnb's early refusal of ZeRO stage 0.
"""

from __future__ import annotations

import functools
import threading

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

import zero_bnb
from zero_bnb.core.config import ZeroBnbConfigError
from zero_bnb.ds import dispatch

pytestmark = pytest.mark.launch

STAGE_1 = {"train_batch_size": 2, "zero_optimization": {"stage": 1}}
STAGE_0 = {"train_batch_size": 2, "zero_optimization": {"stage": 0}}


class Reached(Exception):
    """Raised by the user's wrapper: the call got to 'DeepSpeed' (with what zero_bnb passed on)."""


class UserWrapper:
    """A user's (or MS-AMP's) own deepspeed.initialize, installed by plain assignment."""

    def __init__(self):
        self.configs = []
        self.engine_class_seen = None

    def __call__(self, *args, **kwargs):
        self.configs.append(kwargs.get("config"))
        self.engine_class_seen = deepspeed.DeepSpeedEngine
        raise Reached()


@pytest.fixture(autouse=True)
def clean_deepspeed():
    """Every test starts and ends with DeepSpeed's own initialize and nothing enabled."""
    original = deepspeed.initialize
    yield
    while zero_bnb.is_enabled():
        zero_bnb.disable()
    deepspeed.initialize = original
    dispatch._State.installed = dispatch._State.original = None
    dispatch._State.global_on, dispatch._State.scopes = False, 0


@pytest.fixture
def user_wrapper():
    wrapper = UserWrapper()
    deepspeed.initialize = wrapper
    return wrapper


def _call(config):
    model = torch.nn.Linear(4, 4)
    return deepspeed.initialize(model=model, optimizer=bnb.optim.Adam8bit(model.parameters()), config=config)


def test_enable_twice_and_disable_twice(user_wrapper):
    zero_bnb.enable()
    dispatcher = deepspeed.initialize
    zero_bnb.enable()
    assert deepspeed.initialize is dispatcher and zero_bnb.is_enabled()
    with pytest.raises(Reached):
        _call(STAGE_1)
    # zero_bnb called the wrapper that was there before, with its engine swapped in and its config changes.
    assert isinstance(user_wrapper.engine_class_seen, functools.partial)
    assert user_wrapper.configs[-1]["zero_allow_untested_optimizer"] is True
    zero_bnb.disable()
    assert deepspeed.initialize is user_wrapper and not zero_bnb.is_enabled()
    zero_bnb.disable()  # nothing enabled: a no-op
    assert deepspeed.initialize is user_wrapper


def test_disable_without_enable_is_a_no_op(user_wrapper):
    zero_bnb.disable()
    assert deepspeed.initialize is user_wrapper
    with pytest.raises(Reached):
        _call(STAGE_1)
    assert user_wrapper.engine_class_seen is deepspeed.runtime.engine.DeepSpeedEngine  # stock, untouched


def test_exception_inside_enabled_block_restores_everything(user_wrapper):
    with pytest.raises(ZeroBnbConfigError, match=r"stages 1, 2 and 3, but the config has zero_optimization.stage=0"):
        with zero_bnb.enabled():
            assert zero_bnb.is_enabled()
            _call(STAGE_0)  # zero_bnb refuses stage 0: proof the call was routed to it
    assert deepspeed.initialize is user_wrapper and not zero_bnb.is_enabled()
    with pytest.raises(Reached):
        _call(STAGE_0)  # back to the user's wrapper


def test_enabled_blocks_nest():
    with zero_bnb.enabled():
        with zero_bnb.enabled():
            assert zero_bnb.is_enabled()
        assert zero_bnb.is_enabled()
    assert not zero_bnb.is_enabled()


def test_enable_from_many_threads_installs_one_dispatcher(user_wrapper):
    barrier = threading.Barrier(8)
    seen = []

    def worker():
        barrier.wait()
        zero_bnb.enable()
        seen.append(deepspeed.initialize)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(fn) for fn in seen}) == 1 and getattr(seen[0], "_zero_bnb_dispatcher", False)
    zero_bnb.disable()
    assert deepspeed.initialize is user_wrapper


def test_enabled_block_routes_only_its_own_thread(user_wrapper):
    inside, done = threading.Event(), threading.Event()
    results = {}

    def scoped():
        with zero_bnb.enabled():
            inside.set()
            try:
                _call(STAGE_0)
            except Exception as error:  # noqa: BLE001 - recorded for the assertion
                results["scoped"] = type(error).__name__
            done.wait(timeout=30)

    thread = threading.Thread(target=scoped)
    thread.start()
    inside.wait(timeout=30)
    results["other_enabled"] = zero_bnb.is_enabled()
    try:
        _call(STAGE_0)
    except Exception as error:  # noqa: BLE001
        results["other"] = type(error).__name__
    done.set()
    thread.join()
    assert results == {"scoped": "ZeroBnbConfigError", "other_enabled": False, "other": "Reached"}
    assert deepspeed.initialize is user_wrapper


def test_wrapper_installed_after_enable_is_left_in_place(user_wrapper, caplog):
    zero_bnb.enable()
    dispatcher = deepspeed.initialize
    later = lambda *args, **kwargs: dispatcher(*args, **kwargs)  # noqa: E731 - e.g. MS-AMP's patch
    deepspeed.initialize = later
    with pytest.raises(ZeroBnbConfigError):
        _call(STAGE_0)  # through the later wrapper into zero_bnb
    zero_bnb.disable()
    assert deepspeed.initialize is later
    assert "replaced after zero_bnb.enable()" in caplog.text
    with pytest.raises(Reached):
        _call(STAGE_0)  # the dispatcher inside it now passes calls to what was there before enable()
    zero_bnb.enable()  # and enabling again routes through it once more
    with pytest.raises(ZeroBnbConfigError):
        _call(STAGE_0)


def test_zero_bnb_never_calls_itself():
    deepspeed.initialize = zero_bnb.initialize  # the obvious assignment, which recursed forever before
    assert dispatch.underlying_initialize() is dispatch._GENUINE
    zero_bnb.enable()
    with dispatch.calling_deepspeed():  # a dispatcher re-entered during zero_bnb.initialize goes to DeepSpeed
        assert dispatch.underlying_initialize() is dispatch._GENUINE
    assert dispatch._GENUINE.__module__ == "deepspeed"


def test_import_zero_bnb_stays_light():
    """transformers, accelerate and lightning are imported only by their integration modules, and enable() does not
    import Accelerate: Accelerate imported after it gets the offload patch, which disable() and enable() take
    off and put back."""
    import os
    import subprocess
    import sys

    code = """if True:
        import sys, zero_bnb
        heavy = lambda: sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules)
        print('result', heavy())
        zero_bnb.enable()
        print('result', heavy())
        import accelerate.accelerator as accelerator
        patched = lambda: getattr(accelerator.map_pytorch_optim_to_deepspeed, '_zero_bnb_patch', False)
        first = patched()
        zero_bnb.disable()
        off = patched()
        zero_bnb.enable()
        print('result', [first, off, patched()])
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    results = [line for line in done.stdout.splitlines() if line.startswith("result ")]  # DeepSpeed prints too
    assert results == ["result []", "result []", "result [True, False, True]"], done.stdout


STUB_ACCELERATOR = '''import os, time
while not os.path.exists(os.environ["RELEASE"]):  # the import waits here until the test releases it
    if not os.path.exists(os.environ["STARTED"]):
        open(os.environ["STARTED"], "w").close()
    time.sleep(0.005)


def map_pytorch_optim_to_deepspeed(optimizer):
    return "DeepSpeedCPUAdam"
'''


@pytest.mark.parametrize("watched", [True, False])
def test_enable_and_disable_while_another_thread_imports_accelerate_leave_it_patched(tmp_path, watched):
    """D5: disable() and enable() while another thread imports accelerate.accelerator left the process enabled with
    Accelerate unpatched and no watcher. A stub accelerate package holds its import open until released; the import
    starts with zero_bnb's watcher in place (enabled before) or without it (enabled only during the import)."""
    import os
    import subprocess
    import sys

    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "__init__.py").write_text("")
    (tmp_path / "accelerate" / "accelerator.py").write_text(STUB_ACCELERATOR)
    code = f"""if True:
        import os, sys, threading, time, zero_bnb
        if {watched}:
            zero_bnb.enable()
        importer = threading.Thread(target=lambda: __import__("accelerate.accelerator"))
        importer.start()
        while not os.path.exists(os.environ["STARTED"]):
            time.sleep(0.005)
        zero_bnb.disable()
        zero_bnb.enable()
        open(os.environ["RELEASE"], "w").close()
        importer.join()
        for _ in range(200):  # the waiter thread patches within milliseconds of the import's end
            if getattr(sys.modules["accelerate.accelerator"].map_pytorch_optim_to_deepspeed, "_zero_bnb_patch", False):
                break
            time.sleep(0.01)
        import accelerate.accelerator as accelerator
        print("result", accelerator.map_pytorch_optim_to_deepspeed("mine"))
        zero_bnb.disable()
        print("result", accelerator.map_pytorch_optim_to_deepspeed("mine"))
    """
    env = {**os.environ, "STARTED": str(tmp_path / "started"), "RELEASE": str(tmp_path / "release"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    results = [line for line in done.stdout.splitlines() if line.startswith("result ")]
    assert results == ["result mine", "result DeepSpeedCPUAdam"], done.stdout + done.stderr
