"""The import contract: the layers each package's ``__init__`` docstring declares, checked on the source.

Every ``import`` statement of every module (function-level ones included, ``TYPE_CHECKING`` blocks
excluded) is read with ``ast``. That the checkpoint commands start without DeepSpeed or bitsandbytes is run on a
real checkpoint in tests/test_hostile.py (test_inspect_and_verify_start_without_deepspeed_or_bitsandbytes), whose
launch already wrote one.
"""

from __future__ import annotations

import ast
import os

import pytest

import zero_bnb

ROOT = os.path.dirname(zero_bnb.__file__)

#: package -> the zero_bnb packages (and top-level modules) its modules may import.
ALLOWED = {
    "core": {"core", "errors"},
    "format": {"core", "format", "errors", "versions"},
    "checkpoint": {"core", "format", "checkpoint", "kernels", "errors", "versions"},
    "bnb": {"core", "bnb", "errors"},
    "kernels": {"core", "kernels", "errors"},
    "ds": {"core", "format", "checkpoint", "bnb", "kernels", "ds", "errors", "versions"},
    "tools": {"core", "format", "checkpoint", "tools", "errors", "versions", "ds.loss_scaler"},
    "integrations": {"core", "format", "checkpoint", "bnb", "kernels", "ds", "tools", "integrations", "errors", "versions",
                     "zero_bnb"},
}
#: Declared exceptions (each named in its package's docstring).
EXCEPTIONS: set[tuple[str, str]] = set()
#: external modules a package must not import directly.
FORBIDDEN = {
    "core": ("deepspeed", "torch.distributed"),
    "format": ("deepspeed", "torch.distributed", "bitsandbytes"),
    "checkpoint": ("deepspeed",),
    "bnb": ("deepspeed", "torch.distributed"),
    "kernels": ("deepspeed", "torch.distributed"),
    "tools": ("deepspeed", "torch.distributed"),
}
ENGINE_MODULES = ("ds.engine", "ds.initialize", "ds.zero_optimizer", "ds.aligned", "ds.stage3")


def _imports(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    skipped = {id(node) for top in ast.walk(tree) if isinstance(top, ast.If)
               and getattr(top.test, "id", getattr(top.test, "attr", None)) == "TYPE_CHECKING"
               for node in ast.walk(top)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "zero_bnb":
            names += [f"zero_bnb.{alias.name}" for alias in node.names]  # x may be a module
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _modules() -> list[tuple[str, str]]:
    found = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found.append((os.path.relpath(path, ROOT).removesuffix(".py").replace(os.sep, "."), path))
    return sorted(found)


def _internal(target: str) -> str | None:
    """``zero_bnb.format.manifest`` -> ``format.manifest``; ``None`` for other packages."""
    if target == "zero_bnb":
        return "zero_bnb"
    return target.removeprefix("zero_bnb.") if target.startswith("zero_bnb.") else None


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_each_module_imports_only_what_its_layer_may(module, path):
    package = module.split(".")[0]
    problems = []
    for target in _imports(path):
        internal = _internal(target)
        if internal is not None and package in ALLOWED and (module, internal) not in EXCEPTIONS:
            allowed = ALLOWED[package]
            if not (internal.split(".")[0] in allowed or internal in allowed
                    or any(internal.startswith(a + ".") for a in allowed if "." in a)):
                problems.append(f"{target} ({package} may import {sorted(allowed)})")
            if package == "tools" and internal in ENGINE_MODULES:
                problems.append(f"{target} (tools import no engine)")
        for forbidden in FORBIDDEN.get(package, ()):
            if target == forbidden or target.startswith(forbidden + "."):
                problems.append(f"{target} (forbidden in {package})")
    assert not problems, f"zero_bnb.{module} imports: {problems}"


def test_every_package_says_what_it_owns_and_may_import():
    for package in ALLOWED:
        doc = (zero_bnb.__dict__.get(package) or __import__(f"zero_bnb.{package}", fromlist=["_"])).__doc__
        assert doc and "May import" in doc, package


#: Log calls whose logger is a library module's: ``logger.<level>(...)``.
_LEVELS = ("debug", "info", "warning", "error", "exception", "critical")


def _log_calls(path: str) -> list[tuple[int, str | None]]:
    """(line, the message's literal start or ``None`` when it is not a literal) of each log call in ``path``."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    calls = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LEVELS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "logger" and node.args):
            first = node.args[0]
            if isinstance(first, ast.JoinedStr) and first.values:
                first = first.values[0]
            calls.append((node.lineno, first.value if isinstance(first, ast.Constant) and isinstance(first.value, str)
                          else None))
    return calls


def test_every_library_log_line_names_zero_bnb():
    # Issue 42: a line without the prefix ("building ...", "Deleting 2 checkpoints ...") reads as another library's.
    # zero_bnb.testing (test helpers) is not the library.
    unnamed = [f"{os.path.relpath(os.path.join(root, name), ROOT)}:{line}: {text!r}"
               for root, _, names in os.walk(ROOT) if os.sep + "testing" not in root + os.sep
               for name in names if name.endswith(".py")
               for line, text in _log_calls(os.path.join(root, name))
               if text is None or not text.startswith(("zero_bnb: ", "zero_bnb."))]
    assert not unnamed, unnamed


@pytest.mark.launch
def test_the_offline_tools_import_no_deepspeed():
    """Issue 43: importing any offline tool (``zero_bnb.tools.*``) pulls in no DeepSpeed (the universal conversion of
    an fp16 checkpoint imports it inside, for stock DeepSpeed's loss-scaler object)."""
    import subprocess
    import sys

    tools = sorted(f"zero_bnb.tools.{name.removesuffix('.py')}" for name in os.listdir(os.path.join(ROOT, "tools"))
                   if name.endswith(".py") and name != "__init__.py")
    code = (f"import sys\nfor name in {tools!r}:\n    __import__(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout[:300]
    assert len(tools) >= 7, tools
