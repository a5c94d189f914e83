"""The README's front-door examples, extracted from README.md so that the tests run what users read.

A fenced block is found by the heading above it. Comment-only lines at the start of a line
(``# later, ...``) split it into segments; the part before the first one is the set-up. A test
runs set-up + the segments a phase needs, after :func:`adapt` replaced the few things a CPU test
must change (each replacement must match exactly once, so a README edit that drops it fails the
test instead of silently running something else).
"""

from __future__ import annotations

import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def block(heading: str, language: str = "python") -> str:
    """The first fenced ``language`` block after the Markdown heading ``heading`` (before the next heading)."""
    text = open(README, encoding="utf-8").read()
    match = re.search(rf"^#+ {re.escape(heading)}\n", text, re.M)
    assert match, f"README.md has no heading {heading!r}"
    fenced = re.compile(rf"^```{language}\n(.*?)^```", re.M | re.S).search(text, match.end())
    between = re.sub(r"^```.*?^```", "", text[match.end():fenced.start()] if fenced else "", flags=re.M | re.S)
    assert fenced and not re.search(r"^#+ ", between, re.M), f"README.md has no {language} block under {heading!r}"
    return fenced.group(1)


def segments(code: str) -> dict[str, str]:
    """``{"setup": ..., "<comment line>": ...}``: the block split at comment-only lines in column 0."""
    parts, name = {"setup": []}, "setup"
    for line in code.splitlines():
        if line.startswith("# "):
            name = line
            parts[name] = []
        else:
            parts[name].append(line)
    return {key: "\n".join(lines) + "\n" for key, lines in parts.items()}


def segment(parts: dict[str, str], prefix: str) -> str:
    """The one segment whose comment line starts with ``prefix``."""
    [found] = [code for key, code in parts.items() if key.startswith(prefix)] or [None]
    assert found is not None, f"no segment starting with {prefix!r} in {list(parts)}"
    return found


def adapt(code: str, replacements: dict[str, str]) -> str:
    """``code`` with each key replaced by its value; each key must occur exactly once."""
    for old, new in replacements.items():
        assert code.count(old) == 1, f"README example no longer contains {old!r} exactly once:\n{code}"
        code = code.replace(old, new)
    return code


def run(code: str, namespace: dict, folder: str) -> dict:
    """Execute ``code`` in ``namespace`` with ``folder`` as the working directory (relative paths land there)."""
    os.makedirs(folder, exist_ok=True)
    previous = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(code, README, "exec"), namespace)  # noqa: S102 - the README's own example
    finally:
        os.chdir(previous)
    return namespace
