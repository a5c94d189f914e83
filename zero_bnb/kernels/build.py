"""Compiles the fused CPU update (``csrc/blockwise_update.cpp``) on first use and caches the library.

Like DeepSpeed's CPU Adam op builder (``op_builder/cpu/builder.py``: ``-O3 -march=native -fopenmp``,
compiled once per machine and cached), but the source includes no torch header and is loaded with
``ctypes``: it compiles in about a second instead of the ~1.5 minutes a ``torch.utils.cpp_extension``
module (pybind11 and the torch headers) takes on a 2-core machine, and needs no ninja. The cache key holds
the source, the flags, the compiler's version and the CPU's instruction-set flags, so a shared home
directory never hands one machine a binary built for another. Pre-build with
``python -m zero_bnb.kernels.build`` (or ``zero-bnb build-kernels``).

Each process that uses the kernel calls :func:`load_library`, which builds (or fails) once per process.
Concurrent builders of one key wait on a ``flock`` in the cache folder so one compiles and the others load
its result; where the folder cannot be locked each builds privately, still safely (a private file renamed
into place). A cached build that does not load is rebuilt; one that another user could have written is
refused (:func:`_check_trusted`). Local: no collectives.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shlex
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["KernelBuildError", "KernelCacheError", "MARCH_ENV", "QUANTIZER_PATHS", "bind", "build_library", "cache_dir", "flags", "forget",
           "load_library", "main", "prebuild"]

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "blockwise_update.cpp")
#: Every file the source includes (part of the cache key).
HEADERS = tuple(os.path.join(os.path.dirname(SOURCE), name) for name in ("quantize_tables.h", "codec.h"))
#: -ffp-contract=off: no fused multiply-add, so the kernel rounds as the plain-torch reference does.
#: -fno-trapping-math: the kernel never reads floating-point exception flags, so the compiler may compute both sides
#: of a select; without it gcc leaves the update loops of builds without AVX-512 scalar (the same values either way).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fPIC",
         "-shared", "-std=c++17")
#: Where the compiled library is cached (default ``~/.cache/zero_bnb/kernels``).
CACHE_ENV = "ZERO_BNB_KERNEL_DIR"
#: The instruction set to build for, as gcc's ``-march`` (default ``native``): ``x86-64-v2`` (the scalar path),
#: ``x86-64-v3`` (AVX2), ``x86-64-v4`` (AVX-512), ... to test or use another path on one machine. Part of the key.
MARCH_ENV = "ZERO_BNB_KERNEL_MARCH"


def flags() -> tuple[str, ...]:
    """The compiler flags: :data:`FLAGS` with ``-march`` from ``$ZERO_BNB_KERNEL_MARCH`` when it is set.

    Raises:
        KernelBuildError: the variable holds something other than one ``-march`` value.
    """
    march = os.environ.get(MARCH_ENV, "").strip()
    if not march:
        return FLAGS
    if not all(c.isalnum() or c in "-_." for c in march):
        raise KernelBuildError(
            f"{MARCH_ENV}={march!r} is not a -march value; use e.g. x86-64-v3, x86-64-v4 or native, or unset it"
        )
    return tuple(f"-march={march}" if flag.startswith("-march=") else flag for flag in FLAGS)
#: How the kernel finds codes, by what ``zero_bnb_quantizer_path`` and ``zero_bnb_widest_path`` return.
QUANTIZER_PATHS = ("scalar", "gather", "permute", "avx2")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class KernelBuildError(RuntimeError):
    """The fused CPU update could not be compiled or loaded."""


class KernelCacheError(KernelBuildError):
    """The kernel cache folder cannot be used: it is not writable, or another user could have written its library.
    The message names the fix (a compiler is not the problem)."""


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
    for part in (sources, " ".join(flags()).encode(), "\0".join(compiler).encode(), version.encode(),
                 _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _refuse(path: str, why: str) -> KernelCacheError:
    return KernelCacheError(
        f"refusing to load the cached kernel {path}: {why}, so another user could have replaced it; remove it and "
        f"set {CACHE_ENV} to a folder only you can write, then run `zero-bnb build-kernels`"
    )


def _check_trusted(path: str) -> None:
    """Refuse a library (or its folder) that a user other than this one (or root) could have written.

    The cached library is trusted by its name, as DeepSpeed's JIT-built ops are; this keeps that name from
    being someone else's file: the file and its folder must belong to this user or root, the file must not be
    group/world-writable, nor the folder unless it has the sticky bit (``/tmp``).

    Raises:
        KernelBuildError: the check failed (the message names the path and the fix).
    """
    trusted = {os.getuid(), 0}
    folder = os.path.dirname(path) or "."
    try:
        folder_stat = os.stat(folder)
        file_stat = os.stat(path) if os.path.exists(path) else None
    except OSError as error:
        raise KernelCacheError(f"cannot inspect the kernel cache {path}: {error}; set {CACHE_ENV} to a writable "
                               f"folder") from error
    if folder_stat.st_uid not in trusted:
        raise _refuse(path, f"its folder belongs to uid {folder_stat.st_uid}, not to you (uid {os.getuid()})")
    if folder_stat.st_mode & 0o022 and not folder_stat.st_mode & stat.S_ISVTX:
        raise _refuse(path, f"its folder is writable by others (mode {oct(folder_stat.st_mode & 0o7777)}) "
                            f"without the sticky bit")
    if file_stat is not None and file_stat.st_uid not in trusted:
        raise _refuse(path, f"it belongs to uid {file_stat.st_uid}, not to you (uid {os.getuid()})")
    if file_stat is not None and file_stat.st_mode & 0o022:
        raise _refuse(path, f"it is writable by others (mode {oct(file_stat.st_mode & 0o7777)})")


def _loads(path: str) -> bool:
    """Whether the cached library at ``path`` exists, passes :func:`_check_trusted` and loads."""
    if not os.path.exists(path):
        return False
    _check_trusted(path)
    try:
        ctypes.CDLL(path)
    except OSError as error:
        logger.warning("zero_bnb: the cached fused CPU kernel %s does not load (%s); rebuilding it", path, error)
        return False
    return True


def _make_folder(folder: str) -> None:
    """Create the cache folder (``0o755`` when this call creates it).

    Raises:
        KernelBuildError: it cannot be created (names the folder, the error and the fix).
    """
    try:
        if not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            os.chmod(folder, 0o755)  # not group-writable under umask 002: _check_trusted would refuse it
    except OSError as error:
        raise KernelCacheError(
            f"cannot create the kernel cache folder {folder}: {error}; set {CACHE_ENV} to a writable folder"
        ) from error


@contextlib.contextmanager
def _build_lock(lock_path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (concurrent builders of one key wait for the first).

    Where the file cannot be created or locked (read-only folder, NFS without a lock daemon), nothing is
    held and each process builds privately (the rename keeps that safe).
    """
    try:
        descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    except OSError as error:
        logger.info("zero_bnb: cannot create %s (%s); building without the lock", lock_path, error)
        yield
        return
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except OSError as error:
            logger.info("zero_bnb: cannot lock %s (%s); building without the lock", lock_path, error)
        yield
    finally:
        os.close(descriptor)  # releases the flock


def _compile(compiler: list[str], folder: str, path: str) -> None:
    """Compile into a private file in ``folder`` and rename it to ``path``."""
    try:
        handle, scratch = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    except OSError as error:
        raise KernelCacheError(
            f"cannot write into the kernel cache folder {folder}: {error}; set {CACHE_ENV} to a writable folder"
        ) from error
    os.close(handle)
    command = [*compiler, *flags(), SOURCE, "-o", scratch]
    logger.info("building the fused CPU 8-bit optimizer update: %s", " ".join(command))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise KernelBuildError(
                f"compiling {SOURCE} failed (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}"
            )
        os.chmod(scratch, 0o755)
        os.replace(scratch, path)
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"compiling {SOURCE} with {compiler[0]!r} failed: {error}") from error
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def build_library(force: bool = False) -> str:
    """Compile the kernel unless a cached build for this source, compiler and CPU exists and loads; its path.

    A cached build that does not load (truncated, empty) is rebuilt. Concurrent builders of one key wait on
    ``{path}.lock`` in the cache folder, so one compiles and the others take its result.

    Raises:
        KernelBuildError: no compiler, an unusable cache folder, a cached build someone else could have
            written, or the compilation failed (its output is in the message).
    """
    compiler = _compiler()
    folder = cache_dir()
    path = os.path.join(folder, f"zero_bnb_blockwise_update_{_key(compiler)}.so")
    if not force and _loads(path):
        return path
    _make_folder(folder)
    _check_trusted(path)
    with _build_lock(path[: -len(".so")] + ".lock"):
        if force or not _loads(path):  # another process may have built it while this one waited
            _compile(compiler, folder, path)
    return path


@functools.lru_cache(maxsize=None)
def _attempt(compiler: str, folder: str, march: str) -> ctypes.CDLL | KernelBuildError:
    """One build-and-load per process for each ``CXX``, cache folder and ``-march``: the library, or why it failed."""
    try:
        return bind(build_library())
    except KernelBuildError as error:
        return error


def load_library() -> ctypes.CDLL:
    """The compiled kernel, built on first use and cached for this process.

    A failure is remembered too (per ``CXX`` and cache folder): the build is tried once per process, never at
    every update. :func:`forget` clears both.

    Raises:
        KernelBuildError: it could not be built or loaded.
    """
    import torch  # noqa: F401  (torch's OpenMP runtime is loaded first and shared with the kernel)

    result = _attempt(os.environ.get("CXX", ""), cache_dir(), os.environ.get(MARCH_ENV, ""))
    if isinstance(result, KernelBuildError):
        raise type(result)(str(result)) from result.__cause__
    return result


def forget() -> None:
    """Forget this process's loaded library and remembered build failures (the next use builds again)."""
    _attempt.cache_clear()


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
    library.zero_bnb_widest_path.restype = ctypes.c_int
    library.zero_bnb_widest_path.argtypes = []
    return library


def prebuild(force: bool = False) -> int:
    """Compile (or find, or rebuild a damaged one) the kernel, check that it loads and print its path, then on a
    second line the quantizer path the build takes (``quantizer: permute``, ...: :data:`QUANTIZER_PATHS`, for
    bitsandbytes' maps); the exit code (1 when it cannot be built or loaded).

    ``zero-bnb build-kernels`` and ``python -m zero_bnb.kernels.build``. Local: run it once per machine
    (or per shared cache folder) before training.
    """
    try:
        path = build_library(force=force)
        widest = bind(path).zero_bnb_widest_path()  # the printed library loads
    except KernelBuildError as error:
        sys.stderr.write(f"zero_bnb: {error}\n")
        return 1
    sys.stdout.write(f"{path}\nquantizer: {QUANTIZER_PATHS[widest]}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m zero_bnb.kernels.build [--force]``: :func:`prebuild`."""
    args = sys.argv[1:] if argv is None else argv
    return prebuild(force="--force" in args)


if __name__ == "__main__":
    sys.exit(main())
