"""The versions of zero_bnb's dependencies: what is installed, what is supported, and the check at initialize.

:data:`SUPPORTED` is the one table of ranges: ``pyproject.toml`` declares the same floors and upper
bounds (``tests/test_versions.py`` compares them), and ``scripts/compat.sh`` runs the matrix whose
results are in ``docs/support.md``. :func:`check_supported` is called by ``zero_bnb.initialize``
(every front door goes through it): a release below a floor for a known reason is refused, one newer
than the newest tested (or older than the oldest tested) is run with one warning per process.
What differs between supported releases is asked in :mod:`zero_bnb.ds.versions` (DeepSpeed); the
supported bitsandbytes releases do not differ in anything zero_bnb touches.

Local: no collectives. Pure: reads package metadata only, imports none of the packages.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata

__all__ = ["SUPPORTED", "Supported", "UnsupportedVersionError", "check_supported", "installed", "release"]

logger = logging.getLogger(__name__)

_PACKAGES = ("zero_bnb", "torch", "bitsandbytes", "deepspeed")


def installed(names: tuple[str, ...] = _PACKAGES) -> dict[str, str]:
    """``{package: version}`` for ``names`` (default zero_bnb, torch, bitsandbytes and deepspeed; "missing" if
    absent)."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


class UnsupportedVersionError(RuntimeError):
    """An installed dependency is a release zero_bnb is known not to work with."""


@dataclass(frozen=True, slots=True)
class Supported:
    """The supported releases of one dependency.

    ``pyproject.toml`` declares ``>=oldest,<before``; ``oldest`` and ``newest`` are the releases
    the compatibility matrix (``scripts/compat.sh``) ran.
    """

    #: Distribution name, as pip knows it.
    package: str
    #: The oldest release tested (the declared floor).
    oldest: str
    #: The newest release tested.
    newest: str
    #: The declared upper bound (exclusive).
    before: str
    #: ``""`` for a core dependency, else the extra that brings it (``zero_bnb[hf]``).
    extra: str = ""
    #: Releases below this one are refused (``""``: none known to fail).
    broken_below: str = ""
    #: What fails below ``broken_below``.
    broken_because: str = ""

    @property
    def requirement(self) -> str:
        """The pip requirement, as ``pyproject.toml`` declares it."""
        return f"{self.package}>={self.oldest},<{self.before}"


SUPPORTED: dict[str, Supported] = {entry.package: entry for entry in (
    Supported("torch", "2.6", "2.13.0", "3", broken_below="2.5",
              broken_because="checkpoints are read with torch.serialization.safe_globals, which torch 2.5 added"),
    Supported("deepspeed", "0.17.0", "0.19.8", "0.20"),
    Supported("bitsandbytes", "0.50.0", "0.50.2", "0.51", broken_below="0.50.0",
              broken_because="before 0.50.0 its 8-bit optimizers have no CPU update (offloaded and CPU runs fail), "
                             "and a per-parameter override (GlobalOptimManager.override_config) registered after "
                             "the first step is ignored, so overrides would silently be lost under ZeRO"),
    Supported("transformers", "4.50.0", "5.23.0", "6", extra="hf"),
    Supported("accelerate", "1.2.0", "1.15.0", "2", extra="hf", broken_below="1.2.0",
              broken_because="before 1.2.0 Accelerate replaces an offloaded client optimizer by DeepSpeedCPUAdam "
                             "inside Accelerator.prepare, where zero_bnb cannot keep the 8-bit optimizer"),
    Supported("lightning", "2.4.0", "2.6.6", "3", extra="lightning"),
)}

_warned: set[tuple[str, str]] = set()


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``, ``"0.20.0rc1"`` -> ``(0, 20, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"cannot read a release number from version {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def _fix(entry: Supported) -> str:
    target = f"zero_bnb[{entry.extra}]" if entry.extra else "zero_bnb"
    return f"pip install '{entry.requirement}' (the range {target} declares)"


def check_supported(found: dict[str, str] | None = None, *, optional: tuple[str, ...] = ()) -> list[str]:
    """Refuse known-broken releases of zero_bnb's dependencies; warn once for untested ones (rank 0 logs it).

    Args:
        found: ``{package: version}`` to check; default: the installed torch, deepspeed and
            bitsandbytes, plus each package of ``optional`` that is installed.
        optional: extras' packages to check when installed (the front doors pass the ones they use).

    Returns:
        The warnings (each also logged once per process, on the job's rank 0 only).

    Raises:
        UnsupportedVersionError: a release below a known-broken floor, naming the installed version,
            the supported range, what fails and the pip command that fixes it.
    """
    if found is None:
        found = {name: version for name, version in installed(("torch", "deepspeed", "bitsandbytes", *optional)).items()
                 if version != "missing"}
    warnings = []
    for name, version in found.items():
        entry = SUPPORTED[name]
        have = release(version)
        tested = f"tested {entry.oldest} to {entry.newest}; supported {entry.requirement}"
        if entry.broken_below and have < release(entry.broken_below):
            raise UnsupportedVersionError(
                f"{name} {version} is installed, but zero_bnb needs {name}>={entry.broken_below} ({tested}): "
                f"{entry.broken_because}. Fix: {_fix(entry)}"
            )
        if have > release(entry.newest):
            message = (f"{name} {version} is newer than the newest release zero_bnb was tested with ({tested}); "
                       f"if something fails, {_fix(entry)} and see docs/support.md")
        elif have < release(entry.oldest):
            message = (f"{name} {version} is older than the oldest release zero_bnb was tested with ({tested}); "
                       f"if something fails, {_fix(entry)}")
        else:
            continue
        warnings.append(message)
        if (name, version) not in _warned:
            _warned.add((name, version))
            if _is_rank_zero():  # one line per job, not one per rank
                logger.warning("zero_bnb: %s", message)
    return warnings


def _is_rank_zero() -> bool:
    """Whether this process is the job's rank 0: the initialized process group's rank, else the launcher's ``RANK``
    (torchrun, deepspeed and accelerate set it before the script runs)."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")
