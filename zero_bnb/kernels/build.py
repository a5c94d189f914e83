"""Compiles the fused CPU update (``csrc/blockwise_update.cpp``) on first use and caches the library.

Like DeepSpeed's CPU Adam op builder (``op_builder/cpu/builder.py``: ``-O3 -march=native -fopenmp``,
compiled once per machine and cached), but the source includes no torch header and is loaded with
``ctypes``: it compiles in about a second instead of the ~1.5 minutes a ``torch.utils.cpp_extension``
module (pybind11 and the torch headers) takes on a 2-core machine, and needs no ninja. The cache key holds
the source, the flags, the compiler's version and the CPU's instruction-set flags, so a shared home
directory never hands one machine a binary built for another. Pre-build with
``python -m zero_bnb.kernels.build`` (or ``zero-bnb build-kernels``).

Each process that uses the kernel calls :func:`load_library`, which builds (or fails) once per process; asked to
(``announce``: zero_bnb's engines ask on global rank 0), it logs at INFO, once per process and library, which
library file it loaded, whether it was cached or built now, and its quantizer path (what ``zero-bnb build-kernels``
prints), as DeepSpeed logs its op loads.
Concurrent builders of one key wait on a ``flock`` in the cache folder, for at most
``$ZERO_BNB_KERNEL_LOCK_TIMEOUT`` seconds, so one compiles and the others load its result; where the folder
cannot be locked each builds privately, still safely (compiled in a private folder, renamed into place). What
may be loaded from the cache and replaced in it, and the lock, are :mod:`zero_bnb.kernels.cache`'s: a cached
build that does not load, or lacks the kernel's functions, is rebuilt when it is this user's file; a link at the
kernel's name, or a file another user could have written, is refused. Local: no collectives.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from zero_bnb.kernels.cache import (
    CACHE_ENV,
    LOCK_TIMEOUT_ENV,
    KernelBuildError,
    KernelCacheError,
    KernelLockTimeout,
    build_lock,
    cache_dir,
    check_folder,
    check_replaceable,
    load_cached,
    lock_timeout,
    make_folder,
)

__all__ = ["CACHE_ENV", "KernelBuildError", "KernelCacheError", "KernelLockTimeout", "LOCK_TIMEOUT_ENV", "MARCH_ENV",
           "QUANTIZER_PATHS", "SYMBOLS", "bind", "build_library", "cache_dir", "flags", "forget", "load_library", "main",
           "prebuild"]

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "blockwise_update.cpp")
#: Every file the source includes (part of the cache key).
HEADERS = tuple(os.path.join(os.path.dirname(SOURCE), name) for name in ("quantize_tables.h", "codec.h", "bf16_split.h"))
#: -ffp-contract=off: no fused multiply-add, so the kernel rounds as the plain-torch reference does.
#: -fno-trapping-math: the kernel never reads floating-point exception flags, so the compiler may compute both sides
#: of a select; without it gcc leaves the update loops of builds without AVX-512 scalar (the same values either way).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fPIC",
         "-shared", "-std=c++17")
#: The instruction set to build for, as gcc's ``-march`` (default ``native``): ``x86-64-v2`` (the scalar path),
#: ``x86-64-v3`` (AVX2), ``x86-64-v4`` (AVX-512), ... to test or use another path on one machine; on aarch64
#: e.g. ``armv8-a`` (NEON, which every aarch64 CPU has) or ``armv9-a``. Part of the key. No other flag depends on
#: the architecture: the same :data:`FLAGS` build on x86-64 and aarch64.
MARCH_ENV = "ZERO_BNB_KERNEL_MARCH"
#: The functions :func:`bind` declares: a library at the kernel's name without all of them is not the kernel.
SYMBOLS = ("zero_bnb_blockwise_update", "zero_bnb_quantize", "zero_bnb_quantizer_path", "zero_bnb_widest_path",
           "zero_bnb_split_rounded_bf16")


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
#: How the kernel finds codes, by what ``zero_bnb_quantizer_path`` and ``zero_bnb_widest_path`` return: ``permute``
#: (AVX512-VBMI byte permutes), ``gather`` (AVX-512 gathers), ``avx2`` (AVX2 gathers), ``neon`` (aarch64: NEON table
#: lookups, ``vqtbl4q_u8``), ``scalar`` (one lookup at a time).
QUANTIZER_PATHS = ("scalar", "gather", "permute", "avx2", "neon")


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


def _missing(library: ctypes.CDLL) -> list[str]:
    """The :data:`SYMBOLS` ``library`` lacks."""
    return [name for name in SYMBOLS if not hasattr(library, name)]


def _cached(path: str) -> tuple[ctypes.CDLL | None, str]:
    """The cached library at ``path`` when it is usable (loaded as the checked file, with every :data:`SYMBOLS`);
    else ``None`` and why it must be built: ``""`` when there is none, else what is wrong with it.

    Raises:
        KernelCacheError: a link, not a regular file, or a file another user could have written is at ``path``.
    """
    try:
        library = load_cached(path)
    except OSError as error:
        return None, f"it does not load ({error})"
    if library is None:
        return None, ""
    missing = _missing(library)
    if missing:
        return None, f"it lacks the kernel's functions {', '.join(missing)}"
    return library, ""


def _compile(compiler: list[str], folder: str, path: str) -> None:
    """Compile into a new private folder in ``folder`` and rename the library to ``path``.

    Private: a linker removes and recreates its output, so in a folder others can write (sticky ``/tmp``) a link
    planted at that name in between would make it write through the link.
    """
    try:
        private = tempfile.mkdtemp(dir=folder, prefix=".zero_bnb_build-")  # 0o700, this user's
    except OSError as error:
        raise KernelCacheError(
            f"cannot write into the kernel cache folder {folder}: {error}; set {CACHE_ENV} to a writable folder"
        ) from error
    scratch = os.path.join(private, os.path.basename(path))
    command = [*compiler, *flags(), SOURCE, "-o", scratch]
    logger.info("zero_bnb: building the fused CPU kernels (8-bit optimizer update, bf16 residual split): %s", " ".join(command))
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
        shutil.rmtree(private, ignore_errors=True)  # the folder this call made, holding only the compiler's output


def _build(force: bool) -> tuple[str, ctypes.CDLL | None]:
    """:func:`build_library`, and the cached library when it was loaded to be checked (``None`` after a compile)."""
    compiler = _compiler()
    timeout = lock_timeout()
    folder = cache_dir()
    path = os.path.join(folder, f"zero_bnb_blockwise_update_{_key(compiler)}.so")
    if not force:
        library, _ = _cached(path)
        if library is not None:
            return path, library
    make_folder(folder)
    check_folder(path)
    with build_lock(path[: -len(".so")] + ".lock", timeout):
        problem = "a rebuild was asked for (--force)"
        if not force:
            library, problem = _cached(path)  # another process may have built it while this one waited
            if library is not None:
                return path, library
        if problem:
            check_replaceable(path, problem)
            if not force:
                logger.warning("zero_bnb: the cached fused CPU kernel %s: %s; rebuilding it", path, problem)
        _compile(compiler, folder, path)
    return path, None


def build_library(force: bool = False) -> str:
    """Compile the kernel unless a cached build for this source, compiler and CPU exists and loads; its path.

    A cached build that does not load (truncated, empty) or lacks the kernel's functions is rebuilt when it is
    this user's file. Concurrent builders of one key wait on ``{path}.lock`` in the cache folder (at most
    ``$ZERO_BNB_KERNEL_LOCK_TIMEOUT`` seconds), so one compiles and the others take its result.

    Raises:
        KernelBuildError: no compiler, or the compilation failed (its output is in the message).
        KernelCacheError: an unusable cache folder, a link or another user's file at the kernel's name, an invalid
            ``$ZERO_BNB_KERNEL_LOCK_TIMEOUT``; :class:`KernelLockTimeout`: the build lock was not granted in time.
    """
    return _build(force)[0]


@functools.lru_cache(maxsize=None)
def _attempt(compiler: str, folder: str, march: str) -> tuple[str, ctypes.CDLL, bool] | KernelBuildError:
    """One build-and-load per process for each ``CXX``, cache folder and ``-march``: the library's path, the library
    and whether this process compiled it, or why it failed."""
    try:
        path, library = _build(force=False)
        return path, (bind(path) if library is None else _declare(path, library)), library is None
    except KernelBuildError as error:
        return error


#: The library paths :func:`load_library` has announced in this process.
_ANNOUNCED: set[str] = set()


def load_library(*, announce: bool = False) -> ctypes.CDLL:
    """The compiled kernel, built on first use and cached for this process.

    A failure is remembered too (per ``CXX`` and cache folder): the build is tried once per process, never at
    every update. :func:`forget` clears both. With ``announce``, the first call that gets a library logs at INFO
    which file it is, whether it came from the cache or was built now, and its quantizer path (once per process and
    library; callers pass it on one rank).

    Raises:
        KernelBuildError: it could not be built or loaded.
    """
    import torch  # noqa: F401  (torch's OpenMP runtime is loaded first and shared with the kernel)

    result = _attempt(os.environ.get("CXX", ""), cache_dir(), os.environ.get(MARCH_ENV, ""))
    if isinstance(result, KernelBuildError):
        raise type(result)(str(result)) from result.__cause__
    path, library, built = result
    if announce and path not in _ANNOUNCED:
        _ANNOUNCED.add(path)
        logger.info("zero_bnb: fused CPU 8-bit optimizer update: %s %s (quantizer: %s)",
                    "built" if built else "loaded the cached build", path,
                    QUANTIZER_PATHS[library.zero_bnb_widest_path()])
    return library


def forget() -> None:
    """Forget this process's loaded library, remembered build failures and announcements (the next use builds
    again)."""
    _attempt.cache_clear()
    _ANNOUNCED.clear()


def bind(path: str) -> ctypes.CDLL:
    """Load the compiled kernel at ``path`` (as the file checked, never following a link: :mod:`~.cache`) and
    declare its functions' signatures.

    Raises:
        KernelBuildError: it is missing, could not be loaded or lacks the kernel's functions; ``KernelCacheError``:
            it is a link or a file another user could have written.
    """
    try:
        library = load_cached(path)
    except OSError as error:
        raise KernelBuildError(f"loading the compiled kernel {path} failed: {error}") from error
    if library is None:
        raise KernelBuildError(f"the compiled kernel {path} does not exist; run `zero-bnb build-kernels`")
    return _declare(path, library)


def _declare(path: str, library: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the signatures of :data:`SYMBOLS` on ``library`` (loaded from ``path``).

    Raises:
        KernelBuildError: it lacks one of them.
    """
    missing = _missing(library)
    if missing:
        raise KernelBuildError(f"{path} is not the fused CPU kernel: it lacks {', '.join(missing)}; rebuild it with "
                               f"`zero-bnb build-kernels --force`")
    function = library.zero_bnb_blockwise_update
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 8, ctypes.c_int]
    quantize = library.zero_bnb_quantize
    quantize.restype = None
    quantize.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    quantizer = library.zero_bnb_quantizer_path
    quantizer.restype = ctypes.c_int
    quantizer.argtypes = [ctypes.c_void_p, ctypes.c_int]
    library.zero_bnb_widest_path.restype = ctypes.c_int
    library.zero_bnb_widest_path.argtypes = []
    split = library.zero_bnb_split_rounded_bf16
    split.restype = ctypes.c_int64
    split.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return library


def prebuild(force: bool = False) -> int:
    """Compile (or find, or rebuild a damaged one) the kernel, check that it loads and print its path, then on a
    second line the quantizer path the build takes (``quantizer: permute``, ...: :data:`QUANTIZER_PATHS`, for
    bitsandbytes' maps); the exit code (1 when it cannot be built or loaded).

    ``zero-bnb build-kernels`` and ``python -m zero_bnb.kernels.build``. Local: run it once per machine
    (or per shared cache folder) before training.
    """
    try:
        path, library = _build(force)
        widest = (library or bind(path)).zero_bnb_widest_path()  # the printed library loads and is the kernel
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
