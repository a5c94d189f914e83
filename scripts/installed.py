"""Whether scripts/setup.sh has anything to install: exit 0 when this tree's zero_bnb and everything it and the
given extras need are installed, else exit 1 naming the first thing missing.

Usage: python scripts/installed.py test,demo

Read from the installed distributions' metadata, without importing them (importing DeepSpeed, transformers and
Lightning takes about 10 s, this well under one): zero_bnb at the version of pyproject.toml, and every requirement
of pyproject.toml's dependencies and of the extras, then theirs in turn, installed at a version inside its range
(markers evaluated for this interpreter), as pip would find them already satisfied.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ModuleNotFoundError:  # pip carries its own
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def missing(extras: list[str], pyproject: str = os.path.join(ROOT, "pyproject.toml")) -> str | None:
    """What is not installed (a sentence), or None when nothing is."""
    with open(pyproject, "rb") as file:
        project = tomllib.load(file)["project"]
    name, optional = project["name"], project.get("optional-dependencies", {})
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return f"{name} is not installed"
    if installed != project["version"]:
        return f"{name} {installed} is installed, this tree is {project['version']}"
    if unknown := [extra for extra in extras if extra not in optional]:
        return f"pyproject.toml has no extra {', '.join(unknown)}"
    pending = [(Requirement(line), "") for line in project.get("dependencies", [])]
    pending += [(Requirement(line), extra) for extra in extras for line in optional[extra]]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        needed = f"{requirement.name}{requirement.specifier}"  # without its marker
        try:
            distribution = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            return f"{needed} is not installed"
        try:
            inside = requirement.specifier.contains(distribution.version, prereleases=True)
        except ValueError:  # a version that is no PEP 440 version: left to pip
            inside = True
        if not inside:
            return f"{requirement.name} {distribution.version} is installed, {needed} is needed"
        for line in distribution.requires or []:
            # a requirement of the distribution itself (extra ""), or of one of the extras asked of it
            pending += [(Requirement(line), wanted) for wanted in ("", *sorted(requirement.extras))]
    return None


if __name__ == "__main__":
    reason = missing([extra for extra in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if extra])
    print(reason or "installed")
    sys.exit(1 if reason else 0)
