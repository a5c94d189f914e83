"""Patches that vanish: ``importlib.reload`` of a patched module, and an import hook ahead of zero_bnb's import watcher.

Each scenario runs in a fresh interpreter (the patches are process-wide). The user's import hook is a finder put first
on ``sys.meta_path`` after ``zero_bnb.enable()`` that serves the front doors' packages itself (through
``PathFinder``, with a loader of its own), so zero_bnb's watcher never sees their import. What must hold: the patch
is active where zero_bnb relies on it (at the next import, at a second ``zero_bnb.enable()``, or when an engine is
built, with a WARNING naming what was missing), no watcher is left waiting, and nothing is wrapped twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.launch

#: The user's import hook and the probes, shared by both scenarios.
PRELUDE = '''if True:
    import importlib, importlib.abc, importlib.machinery, json, logging, sys
    import deepspeed, torch, zero_bnb
    import zero_bnb.ds.initialize  # imported by the first routed call; imported here so it passes no watcher later
    from zero_bnb.core.config import ZeroBnbConfigError

    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("zero_bnb").addHandler(Keep())

    class Loader(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            self.inner.exec_module(module)

    class Hook(importlib.abc.MetaPathFinder):
        """A user's import hook: serves PACKAGES itself, with a loader of its own."""

        def find_spec(self, name, path, target=None):
            if name.split(".")[0] not in PACKAGES:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = Loader(spec.loader)
            return spec

    def watching(name):  # a zero_bnb import watcher for module `name` still waits on sys.meta_path
        return any(type(finder).__name__ == "_PatchOnImport"
                   and getattr(finder, "name", "accelerate.accelerator") == name for finder in sys.meta_path)

    def patched(function):
        return bool(getattr(function, "_zero_bnb_patch", False))

    def once(function):  # patched, and what it wraps is not a zero_bnb patch
        return patched(function) and not patched(getattr(function, "__wrapped__", None))

    def build():  # an engine built through deepspeed.initialize: zero_bnb refuses stage 0, which proves it routed
        model = torch.nn.Linear(4, 4)
        try:
            deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 config={"train_batch_size": 2, "zero_optimization": {"stage": 0}})
        except ZeroBnbConfigError:
            return "zero_bnb"
        return "deepspeed"

    def taken():
        seen = list(warnings)
        warnings.clear()
        return seen

    results = {}
'''

STUB_ACCELERATOR = '''def map_pytorch_optim_to_deepspeed(optimizer):
    return "DeepSpeedCPUAdam"


class Accelerator:
    def save_state(self, output_dir=None, **kwargs):
        return "saved"

    def load_state(self, input_dir=None, **kwargs):
        return "loaded"
'''

STUB_TRANSFORMERS = '''def __getattr__(name):  # ``from transformers import Trainer``
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(name)
'''

STUB_TRAINER_UTILS = '''PREFIX_CHECKPOINT_DIR = "checkpoint"


def get_last_checkpoint(folder):
    return None
'''

STUB_TRAINER = '''from .trainer_utils import get_last_checkpoint


def rotate_checkpoints(*args, **kwargs):
    return None


class Trainer:
    def train(self, resume_from_checkpoint=None, **kwargs):
        return "trained"

    def _save_checkpoint(self, model, trial):
        return None

    def _load_optimizer_and_scheduler(self, checkpoint):
        return None
'''


def _run(code: str, extra_path: str | None = None) -> dict:
    path = [extra_path, os.getcwd(), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    done = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("results ")]  # DeepSpeed prints too
    assert lines, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(lines[-1][len("results "):])


def test_patches_survive_an_import_hook_and_reloads(tmp_path):
    """Stub ``accelerate`` and ``transformers`` packages (they import nothing: every step is deterministic).

    Before: a hook ahead of the watcher left Accelerate and Trainer unpatched with the watchers waiting forever, an
    engine was built unpatched, and after ``importlib.reload`` neither a second ``enable()`` nor anything else put
    the patches back."""
    stubs = {"accelerate": {"__init__.py": "", "accelerator.py": STUB_ACCELERATOR},
             "transformers": {"__init__.py": STUB_TRANSFORMERS, "trainer.py": STUB_TRAINER,
                              "trainer_utils.py": STUB_TRAINER_UTILS}}
    for package, files in stubs.items():
        (tmp_path / package).mkdir()
        for name, text in files.items():
            (tmp_path / package / name).write_text(text)
    code = '''
    PACKAGES = ("accelerate", "transformers")
    zero_bnb.enable()
    results["warm"] = [build(), taken()]
    sys.meta_path.insert(0, Hook())
    import accelerate.accelerator as accelerator
    results["hidden"] = [patched(accelerator.map_pytorch_optim_to_deepspeed), watching("accelerate.accelerator")]
    importlib.util.find_spec("zero_bnb_no_such_module")  # the next import passed on to the watcher patches it
    results["next import"] = [once(accelerator.map_pytorch_optim_to_deepspeed),
                              once(accelerator.Accelerator.save_state), once(accelerator.Accelerator.load_state),
                              watching("accelerate.accelerator"), taken()]
    import transformers.trainer as trainer
    results["hidden trainer"] = [patched(trainer.Trainer.train), watching("transformers.trainer")]
    results["built"] = build()  # no import in between: the engine's construction finds the Trainer patch missing
    warned = taken() or [""]
    results["built warnings"] = [len(warned), "transformers.trainer.Trainer.train" in warned[0],
                                 "without zero_bnb's import watcher seeing it" in warned[0],
                                 "zero_bnb.enable() again" in warned[0], "accelerate.accelerator" in warned[0]]
    results["trainer"] = [once(trainer.Trainer.train), once(trainer.Trainer._save_checkpoint),
                          once(trainer.get_last_checkpoint), once(trainer.rotate_checkpoints),
                          once(sys.modules["transformers.trainer_utils"].get_last_checkpoint),
                          watching("transformers.trainer")]
    old_accelerator, old_trainer = accelerator.Accelerator, trainer.Trainer
    importlib.reload(accelerator)
    importlib.reload(trainer)
    results["reloaded"] = [patched(accelerator.map_pytorch_optim_to_deepspeed),
                           patched(accelerator.Accelerator.save_state), patched(trainer.Trainer.train)]
    zero_bnb.enable()  # the fix a user is told: enable() again re-installs, wrapping nothing twice
    results["enable again"] = [once(accelerator.map_pytorch_optim_to_deepspeed),
                               once(accelerator.Accelerator.save_state), once(accelerator.Accelerator.load_state),
                               once(trainer.Trainer.train), once(trainer.Trainer._load_optimizer_and_scheduler),
                               once(trainer.get_last_checkpoint), taken()]
    with zero_bnb.enabled():
        results["keeps"] = accelerator.map_pytorch_optim_to_deepspeed("mine")
    importlib.reload(accelerator)
    importlib.reload(trainer)
    results["built after reload"] = build()
    warned = taken() or [""]
    results["reload warnings"] = [len(warned), "accelerate.accelerator.map_pytorch_optim_to_deepspeed" in warned[0],
                                  "importlib.reload(accelerate.accelerator)" in warned[0],
                                  "transformers.trainer.Trainer.train" in warned[0]]
    results["after build"] = [once(accelerator.map_pytorch_optim_to_deepspeed), once(trainer.Trainer.train)]
    zero_bnb.disable()
    results["disabled"] = [accelerator.map_pytorch_optim_to_deepspeed("mine"),
                           patched(trainer.Trainer.train), patched(old_trainer.train),
                           patched(trainer.get_last_checkpoint), patched(old_accelerator.save_state)]
    print("results", json.dumps(results))
'''
    results = _run(code, str(tmp_path))
    assert results == {
        "warm": ["zero_bnb", []],
        "hidden": [False, True],  # the hook hid the import (the watcher is still waiting)
        "next import": [True, True, True, False, []],
        "hidden trainer": [False, True],
        "built": "zero_bnb",
        "built warnings": [1, True, True, True, False],
        "trainer": [True, True, True, True, True, False],
        "reloaded": [False, False, False],
        "enable again": [True, True, True, True, True, True, []],
        "keeps": "mine",
        "built after reload": "zero_bnb",
        "reload warnings": [1, True, True, True],
        "after build": [True, True],
        # Accelerator's checkpoint calls stay wrapped (they change nothing without zero_bnb's records)
        "disabled": ["DeepSpeedCPUAdam", False, False, False, True],
    }


def test_real_accelerate_behind_an_import_hook_and_reloaded():
    """The installed Accelerate: imported by a hook ahead of the watcher, the patch is active once an engine is built
    (at the latest) and the watcher gone; ``importlib.reload(accelerate.accelerator)`` then a second ``enable()``
    patches the new functions and ``Accelerator`` class once."""
    code = '''
    PACKAGES = ("accelerate",)
    zero_bnb.enable()
    sys.meta_path.insert(0, Hook())
    import accelerate
    import accelerate.accelerator as accelerator
    results["built"] = build()
    results["patched"] = [once(accelerator.map_pytorch_optim_to_deepspeed), once(accelerator.Accelerator.save_state),
                          once(accelerator.Accelerator.load_state), watching("accelerate.accelerator"),
                          type(accelerator.__loader__).__name__]
    importlib.reload(accelerator)
    results["reloaded"] = [patched(accelerator.map_pytorch_optim_to_deepspeed),
                           patched(accelerator.Accelerator.save_state)]
    zero_bnb.enable()
    results["enable again"] = [once(accelerator.map_pytorch_optim_to_deepspeed),
                               once(accelerator.Accelerator.save_state), once(accelerator.Accelerator.load_state),
                               once(accelerate.Accelerator.save_state),
                               accelerate.Accelerator is accelerator.Accelerator]
    sentinel = object()
    keep = accelerator.map_pytorch_optim_to_deepspeed
    results["keeps"] = patched(keep) and keep(sentinel) is sentinel
    results["warnings"] = taken()
    print("results", json.dumps(results))
'''
    results = _run(code)
    assert results == {
        "built": "zero_bnb",
        "patched": [True, True, True, False, "Loader"],  # loaded by the hook's loader: the watcher never saw it
        "reloaded": [False, False],
        # the package's Accelerator is the class from before the reload, still wrapped once
        "enable again": [True, True, True, True, False],
        "keeps": True,
        "warnings": results["warnings"],  # at most the WARNING of the engine's construction, checked below
    }
    assert all("accelerate.accelerator" in warning and "zero_bnb.enable() again" in warning
               for warning in results["warnings"]), results["warnings"]
