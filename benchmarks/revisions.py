"""The ``zero_bnb`` package of another git revision, for benchmarks that compare it with this tree."""

from __future__ import annotations

import os
import subprocess

__all__ = ["ROOT", "alternating", "extract_package"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extract_package(ref: str, into: str) -> str:
    """Write ``zero_bnb`` as of git revision ``ref`` below ``into`` (``git archive``); returns the folder to
    put on ``PYTHONPATH``."""
    os.makedirs(into, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref, "zero_bnb"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def alternating(names: list[str], round_index: int) -> list[str]:
    """``names`` in one order on even rounds and reversed on odd ones, so drift hits every variant alike."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))
