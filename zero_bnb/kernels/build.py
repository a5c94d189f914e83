"""Compiles the fused CPU update (``csrc/blockwise_update.cpp``) on first use and caches the library.

Like DeepSpeed's CPU Adam op builder (``op_builder/cpu/builder.py``: ``-O3 -march=native -fopenmp``,
compiled once per machine and cached), but the source includes no torch header and is loaded with
``ctypes``: it compiles in about a second instead of the ~1.5 minutes a ``torch.utils.cpp_extension``
module (pybind11 and the torch headers) takes on a 2-core machine, and needs no ninja. The cache key holds
the source, the flags, the compiler's version and the CPU's instruction-set flags, so a shared home
directory never hands one machine a binary built for another. Pre-build with
``python -m zero_bnb.kernels.build`` (or ``zero-bnb build-kernels``).

Each process that uses the kernel calls :func:`load_library`; concurrent builds are safe (each writes a
private file and renames it into place). Local: no collectives.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import tempfile

__all__ = ["KernelBuildError", "bind", "build_library", "cache_dir", "load_library", "main", "prebuild"]

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "blockwise_update.cpp")
#: Every file the source includes (part of the cache key).
HEADERS = tuple(os.path.join(os.path.dirname(SOURCE), name) for name in ("quantize_tables.h", "codec.h"))
#: -ffp-contract=off: no fused multiply-add, so the kernel rounds as the plain-torch reference does.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-std=c++17")
#: Where the compiled library is cached (default ``~/.cache/zero_bnb/kernels``).
CACHE_ENV = "ZERO_BNB_KERNEL_DIR"


class KernelBuildError(RuntimeError):
    """The fused CPU update could not be compiled or loaded."""


def cache_dir() -> str:
    """The folder holding compiled kernels (``$ZERO_BNB_KERNEL_DIR`` or ``~/.cache/zero_bnb/kernels``)."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zero_bnb", "kernels")
    return os.environ.get(CACHE_ENV) or default


def _compiler() -> list[str]:
    """The compiler command: ``$CXX`` (which may carry flags) or ``c++``."""
    try:
        return shlex.split(os.environ.get("CXX", "")) or ["c++"]
    except ValueError as error:
        raise KernelBuildError(
            f"CXX={os.environ['CXX']!r} is not a valid command ({error}); set CXX to a C++ compiler, e.g. CXX=g++"
        ) from error


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return next((line for line in handle if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _key(compiler: list[str]) -> str:
    """The cache key: source and headers, flags, the compiler command (``CXX`` may carry flags) and its version,
    CPU flags."""
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(
            f"no C++ compiler: running {compiler[0]!r}{' (from CXX)' if os.environ.get('CXX', '').strip() else ''} "
            f"failed ({error}); install a C++ compiler with OpenMP (e.g. apt-get install g++) or set CXX to one"
        ) from error
    digest = hashlib.sha256()
    sources = b"".join(open(path, "rb").read() for path in (SOURCE, *HEADERS))
    for part in (sources, " ".join(FLAGS).encode(), "\0".join(compiler).encode(), version.encode(),
                 _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build_library(force: bool = False) -> str:
    """Compile the kernel unless a cached build for this source, compiler and CPU exists; its path.

    Raises:
        KernelBuildError: no compiler, or the compilation failed (its output is in the message).
    """
    compiler = _compiler()
    folder = cache_dir()
    path = os.path.join(folder, f"zero_bnb_blockwise_update_{_key(compiler)}.so")
    if os.path.exists(path) and not force:
        return path
    os.makedirs(folder, exist_ok=True)
    handle, scratch = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(handle)
    command = [*compiler, *FLAGS, SOURCE, "-o", scratch]
    logger.info("building the fused CPU 8-bit optimizer update: %s", " ".join(command))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise KernelBuildError(
                f"compiling {SOURCE} failed (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}"
            )
        os.replace(scratch, path)
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"compiling {SOURCE} with {compiler[0]!r} failed: {error}") from error
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return path


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL:
    """The compiled kernel, built on first use and cached for this process.

    Raises:
        KernelBuildError: it could not be built or loaded.
    """
    import torch  # noqa: F401  (torch's OpenMP runtime is loaded first and shared with the kernel)

    return bind(build_library())


def bind(path: str) -> ctypes.CDLL:
    """Load the compiled kernel at ``path`` and declare its functions' signatures.

    Raises:
        KernelBuildError: it could not be loaded.
    """
    try:
        library = ctypes.CDLL(path)
    except OSError as error:
        raise KernelBuildError(f"loading the compiled kernel {path} failed: {error}") from error
    function = library.zero_bnb_blockwise_update
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 8, ctypes.c_int]
    quantize = library.zero_bnb_quantize
    quantize.restype = None
    quantize.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    path = library.zero_bnb_quantizer_path
    path.restype = ctypes.c_int
    path.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return library


def prebuild(force: bool = False) -> int:
    """Compile (or find) the kernel and print its path; the exit code (1 when it cannot be built).

    ``zero-bnb build-kernels`` and ``python -m zero_bnb.kernels.build``. Local: run it once per machine
    (or per shared cache folder) before training.
    """
    try:
        path = build_library(force=force)
    except KernelBuildError as error:
        sys.stderr.write(f"zero_bnb: {error}\n")
        return 1
    sys.stdout.write(f"{path}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m zero_bnb.kernels.build [--force]``: :func:`prebuild`."""
    args = sys.argv[1:] if argv is None else argv
    return prebuild(force="--force" in args)


if __name__ == "__main__":
    sys.exit(main())
