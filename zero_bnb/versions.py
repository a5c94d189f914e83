"""Installed versions of zero_bnb and the libraries whose formats it depends on."""

from __future__ import annotations

from importlib import metadata

__all__ = ["installed"]

_PACKAGES = ("zero_bnb", "torch", "bitsandbytes", "deepspeed")


def installed() -> dict[str, str]:
    """``{package: version}`` for zero_bnb, torch, bitsandbytes and deepspeed ("missing" if absent)."""
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    return found
