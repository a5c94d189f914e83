"""The content digests a checkpoint records: BLAKE3 where the ``blake3`` package is installed, else SHA-256.

Every file a save writes is hashed while it is written (:mod:`zero_bnb.format.durable`), and a shard group whose
master weights derive from the module weights records a digest of each weight piece (:mod:`zero_bnb.format.masters`).
Format version 4 names each digest's algorithm beside it (a file record's key, the masters' entry), so a checkpoint
holds what its writer had: BLAKE3 (about twice SHA-256's speed on one core, with SHA-NI, and parallel where cores are
idle) or SHA-256 (the ``blake3`` package missing; every earlier format). Both are verified on every machine that
has the algorithm; one without ``blake3`` names the package to install.

Pure functions and hash objects; no collectives, any thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from typing import Any, Protocol

from zero_bnb.errors import CheckpointFormatError

try:
    import blake3 as _blake3
except ImportError:  # zero_bnb depends on it; an install without dependencies falls back to SHA-256
    _blake3 = None

__all__ = ["ALGORITHMS", "BLAKE3", "SHA256", "Hasher", "hexdigest", "is_hex", "new", "of_chunks", "spare_threads",
           "update_large", "writing_algorithm"]

logger = logging.getLogger(__name__)

SHA256 = "sha256"
BLAKE3 = "blake3"
#: Every algorithm a checkpoint may record (both give 64 lowercase hex digits).
ALGORITHMS = (SHA256, BLAKE3)
#: The piece length each algorithm hashes a long buffer in: SHA-256's pieces stay in the L2 cache (about 15% less CPU
#: than 1 MiB pieces on the 2-core Xeon of benchmarks/results/save_profile.md); BLAKE3 runs 2.1 GB/s in 32 KiB
#: pieces and 2.9 GB/s in 1 MiB ones on the 2-core EPYC of docs/design.md (3.4 GB/s in one call).
_PIECES = {SHA256: 1 << 15, BLAKE3: 1 << 20}
#: BLAKE3 threads at most per hash (each file and each weight piece has one).
_MAX_THREADS = 8


class Hasher(Protocol):
    """What :func:`new` returns (``hashlib``'s and ``blake3``'s hash objects)."""

    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


_warned = False


def writing_algorithm() -> str:
    """The algorithm this process records for what it writes: :data:`BLAKE3`, or :data:`SHA256` where the ``blake3``
    package cannot be imported (said once, as a WARNING: saves then hash at about half the speed)."""
    global _warned
    if _blake3 is not None:
        return BLAKE3
    if not _warned:
        _warned = True
        logger.warning("zero_bnb: the 'blake3' package is not installed, so checkpoints record SHA-256 digests, which "
                       "makes a save slower; pip install 'blake3>=1.0,<2' (a dependency of zero_bnb)")
    return SHA256


#: Where launchers put the number of ranks on this host: torchrun, DeepSpeed's launcher, Open MPI.
_LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def spare_threads() -> int:
    """How many threads one BLAKE3 hash may use: 1, unless this process's share of the cores it may run on (those
    cores divided among the ranks of this host, as the launcher says: :data:`_LOCAL_SIZE_VARIABLES`, the first one
    set) leaves at least two idle beside the thread that serialises and the one that hashes; then the idle ones (at
    most 8). A count that is not a positive integer gives 1. The digest is the same for every count."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    given = next((os.environ[name] for name in _LOCAL_SIZE_VARIABLES if os.environ.get(name)), "1")
    try:
        ranks = int(given)
    except ValueError:
        return 1
    if ranks < 1:
        return 1
    idle = cores // ranks - 2
    return min(_MAX_THREADS, idle + 1) if idle >= 2 else 1


def new(algorithm: str, *, threads: int = 1, what: str = "this checkpoint") -> Hasher:
    """A new hash object of ``algorithm`` (BLAKE3 with up to ``threads`` threads).

    Raises:
        CheckpointFormatError: an unknown algorithm, or BLAKE3 without the ``blake3`` package (naming ``what`` records
            it and the command that installs it).
    """
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm != BLAKE3:
        raise CheckpointFormatError(f"{what} records digests of the algorithm {algorithm!r:.40}, but zero_bnb knows "
                                    f"{list(ALGORITHMS)}; it was not written by zero_bnb or was edited")
    if _blake3 is None:
        raise CheckpointFormatError(
            f"{what} records BLAKE3 digests, but the 'blake3' package (a dependency of zero_bnb) is not installed in "
            f"this Python environment, so they cannot be checked: pip install 'blake3>=1.0,<2'")
    return _blake3.blake3(max_threads=threads if threads > 1 else 1)


def update_large(hasher: Hasher, algorithm: str, view: memoryview, *, threads: int = 1) -> None:
    """Feed the bytes of ``view`` to ``hasher`` (of ``algorithm``) in the pieces that algorithm hashes fastest (a
    threaded BLAKE3 hash in one call, which its threads split)."""
    piece = max(1, view.nbytes) if algorithm == BLAKE3 and threads > 1 else _PIECES[algorithm]
    for start in range(0, view.nbytes, piece):
        hasher.update(view[start : start + piece])


def hexdigest(algorithm: str, data: Any, *, threads: int = 1, what: str = "this checkpoint") -> str:
    """The ``algorithm`` digest (hex) of the bytes of ``data`` (any buffer); a BLAKE3 one with up to ``threads``
    threads."""
    view = memoryview(data).cast("B")
    hasher = new(algorithm, threads=threads, what=what)
    update_large(hasher, algorithm, view, threads=threads)
    return hasher.hexdigest()


def of_chunks(algorithm: str, chunks: Iterable[bytes], *, threads: int = 1,
              what: str = "this checkpoint") -> tuple[int, str]:
    """Size in bytes and ``algorithm`` digest (hex) of the concatenated ``chunks`` (a file read piece by piece); a
    BLAKE3 one with up to ``threads`` threads."""
    hasher = new(algorithm, threads=threads, what=what)
    size = 0
    for chunk in chunks:
        hasher.update(chunk)
        size += len(chunk)
    return size, hasher.hexdigest()


def is_hex(text: Any) -> bool:
    """Whether ``text`` is a digest as a checkpoint records it: 64 lowercase hex digits."""
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)
