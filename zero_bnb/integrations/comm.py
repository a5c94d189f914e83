"""DeepSpeed's communication layer (``deepspeed.comm``) joined early, by :func:`zero_bnb.enable`.

Why: at ZeRO stage 3 transformers builds the model under ``deepspeed.zero.Init`` (``from_pretrained`` /
``from_config`` while a ``TrainingArguments`` with a DeepSpeed config is alive). ``zero.Init`` reads the world size
from ``deepspeed.comm`` *before* it initialises that layer itself, and DeepSpeed's config falls back to a world size
of 1 when it is not initialised: under ``torchrun --nproc_per_node 2`` with ``use_cpu=True`` (Accelerate then joins a
plain torch.distributed gloo group, never ``deepspeed.comm``) the model build fails with ``AssertionError: Check
batch related parameters ... 12 != 2 * 3 * 1``. Stock DeepSpeed fails the same way; ``deepspeed.init_distributed``
before the model is built fixes it, which is what :func:`join_deepspeed_comm` does.

What it does, in order (the first that applies):

1. ``deepspeed.comm`` already initialised (the ``deepspeed`` launcher's scripts, Accelerate on GPUs, a user's own
   ``deepspeed.init_distributed``): nothing.
2. A torch.distributed group exists (Accelerate's, a user's ``init_process_group``): ``deepspeed.comm`` wraps it
   (its backend kept; no new group).
3. DeepSpeed's accelerator is the CPU and a launcher's environment is complete (``RANK``, ``WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT``: ``torchrun``, ``deepspeed``, ``accelerate launch``):
   torch's ``env://`` rendezvous, bounded in time (below), then a torch.distributed group with the accelerator's
   backend (gloo, or ccl with oneCCL's bindings) that ``deepspeed.init_distributed`` wraps. Accelerate and Trainer
   then find the group and use it.

The rendezvous of step 3 gives up after ``$ZERO_BNB_RENDEZVOUS_TIMEOUT`` seconds (default
:data:`DEFAULT_RENDEZVOUS_TIMEOUT`, 60; only rank 0's connection to its own store, torch's, may overrun it by torch's
retry back-off), not after DeepSpeed's collective timeout (``DEEPSPEED_TIMEOUT``, 10 minutes) as before:
``MASTER_ADDR`` must resolve (checked first: a name that does not fails at once, where torch retried it for the whole
collective timeout, printing only ``gai error: -2``), the TCP store at ``MASTER_ADDR:MASTER_PORT`` must answer (rank
0's, or under ``torchrun`` the launcher agent's, which is already up), and without ``torchrun`` rank 0 waits that
long for the other ranks to connect. Whatever fails raises :class:`RendezvousError` naming the variables, their
values, what was tried and the fix. Once joined, the store and the process group take DeepSpeed's collective timeout
(``deepspeed.constants.default_pg_timeout``), as ``deepspeed.init_distributed`` gives them: a training collective is
not cut short.

When it does nothing, and why:

* On a GPU (any accelerator but the CPU) with no group yet: the framework initialises ``deepspeed.comm`` itself
  once it has chosen the device (Accelerate's ``PartialState`` under a DeepSpeed config calls
  ``deepspeed.init_distributed``), with its own backend and timeout; joining an nccl group before that could take
  settings from the user and is not needed.
* No launcher environment, or an incomplete one (a single process; an MPI launch, whose ranks DeepSpeed discovers
  only through ``mpi4py``): there is no rendezvous to join. The names of the missing variables are logged.

Each call logs at DEBUG what it did. Settings of your own (a timeout, another backend): call
``deepspeed.init_distributed`` or ``torch.distributed.init_process_group`` before :func:`zero_bnb.enable`; step 2
then keeps them.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from datetime import timedelta

__all__ = ["DEFAULT_RENDEZVOUS_TIMEOUT", "LAUNCHER_VARIABLES", "RENDEZVOUS_TIMEOUT_ENV", "RendezvousError",
           "join_deepspeed_comm", "rendezvous_timeout"]

logger = logging.getLogger(__name__)

#: The variables of the ``env://`` rendezvous, set by ``torchrun``, the ``deepspeed`` launcher and ``accelerate launch``.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Seconds :func:`join_deepspeed_comm` waits for the launcher's rendezvous (name lookup, connection, the other ranks).
RENDEZVOUS_TIMEOUT_ENV = "ZERO_BNB_RENDEZVOUS_TIMEOUT"
#: The rendezvous timeout when ``$ZERO_BNB_RENDEZVOUS_TIMEOUT`` is unset (seconds).
DEFAULT_RENDEZVOUS_TIMEOUT = 60.0

_FIX_ADDRESS = ("set MASTER_ADDR to rank 0's host as every rank's host can reach it (its name or IP address; "
                "127.0.0.1 when all ranks run on one machine) and MASTER_PORT to a free TCP port open between the "
                "hosts, the same on every rank; launchers set both (torchrun --master_addr/--master_port or "
                "--rdzv-endpoint, deepspeed --master_addr/--master_port, accelerate launch --main_process_ip/"
                "--main_process_port)")


class RendezvousError(RuntimeError):
    """:func:`join_deepspeed_comm` could not join the launcher's ``env://`` rendezvous in
    ``$ZERO_BNB_RENDEZVOUS_TIMEOUT`` seconds: ``MASTER_ADDR`` does not resolve, the store at
    ``MASTER_ADDR:MASTER_PORT`` does not answer, or the other ranks did not connect. The message names the values,
    what was tried and the fix."""


def _is_ascii_number(value: str) -> bool:
    """Whether ``value`` is a non-negative integer in ASCII digits (``str.isdigit`` alone accepts ``'²'``, which
    ``int()`` refuses, and ``'٠'``, which it reads as 0)."""
    return value.isascii() and value.isdigit()


def _check_launcher_environment() -> None:
    """Refuse launcher variables that no rendezvous can use, naming them (torch would fail on them later, with
    ``invalid literal for int()``). Local: any rank may call it.

    Raises:
        ValueError: ``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` or (when set) ``LOCAL_RANK`` is not a number in ASCII
            digits, ``RANK`` is not below ``WORLD_SIZE``, or ``MASTER_PORT`` is not a TCP port.
    """
    names = ["RANK", "WORLD_SIZE", "MASTER_PORT"] + (["LOCAL_RANK"] if os.environ.get("LOCAL_RANK") else [])
    values = {name: os.environ[name].strip() for name in names}
    wrong = [f"{name}={value!r}" for name, value in values.items() if not _is_ascii_number(value)]
    if not wrong and not int(values["RANK"]) < int(values["WORLD_SIZE"]) > 0:
        wrong = [f"RANK={values['RANK']!r} with WORLD_SIZE={values['WORLD_SIZE']!r}"]
    if not wrong and not 0 < int(values["MASTER_PORT"]) < 65536:
        wrong = [f"MASTER_PORT={values['MASTER_PORT']!r}"]
    if wrong:
        raise ValueError(
            f"zero_bnb.enable(): the launcher's environment cannot start DeepSpeed's communication: "
            f"{', '.join(wrong)} (RANK, WORLD_SIZE and LOCAL_RANK are integers in ASCII digits 0-9 with 0 <= RANK < "
            f"WORLD_SIZE, MASTER_PORT a TCP port). Launch with torchrun, deepspeed or accelerate launch, which set "
            f"them, or unset {', '.join(LAUNCHER_VARIABLES)} to run one process"
        )


def rendezvous_timeout() -> float:
    """Seconds the launcher's rendezvous may take: ``$ZERO_BNB_RENDEZVOUS_TIMEOUT`` or
    :data:`DEFAULT_RENDEZVOUS_TIMEOUT`. Local: any rank may call it.

    Raises:
        ValueError: the variable is not a finite number of seconds > 0.
    """
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_RENDEZVOUS_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"zero_bnb.enable(): {RENDEZVOUS_TIMEOUT_ENV}={raw!r} is not a number of seconds > 0; set it to how long "
            f"the ranks may take to meet at MASTER_ADDR:MASTER_PORT (e.g. {RENDEZVOUS_TIMEOUT_ENV}=300 when some "
            f"ranks reach zero_bnb.enable() minutes after the others), or unset it (default "
            f"{DEFAULT_RENDEZVOUS_TIMEOUT:g})"
        )
    return value


_AddrInfo = tuple[int, int, int, str, tuple]


def _resolve(host: str, port: int, seconds: float) -> tuple[list[_AddrInfo], str | None]:
    """Look ``host`` up as torch's TCP store will (``getaddrinfo``), within ``seconds``: ``(getaddrinfo's entries,
    None)``, or ``([], why not)``. A temporary failure of the name service (``EAI_AGAIN``) is retried until then; the lookup
    runs in a daemon thread, as ``getaddrinfo`` takes no timeout. Local."""
    deadline = time.monotonic() + seconds
    while True:
        outcome: dict[str, object] = {}

        def lookup(outcome: dict[str, object] = outcome) -> None:
            try:
                outcome["found"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError) as error:  # socket.gaierror; a name the IDNA codec refuses
                outcome["error"] = error

        thread = threading.Thread(target=lookup, name="zero_bnb-resolve-MASTER_ADDR", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return [], f"the name service gave no answer within {seconds:g} s"
        if "found" in outcome:
            found = outcome["found"]
            assert isinstance(found, list)
            return found, None
        error = outcome["error"]
        if (isinstance(error, socket.gaierror) and error.errno == socket.EAI_AGAIN
                and time.monotonic() + 0.5 < deadline):
            time.sleep(0.5)
            continue
        return [], f"getaddrinfo failed: {error}"


def _wait_for_listener(entries: list[_AddrInfo], deadline: float) -> str | None:
    """Connect to the rendezvous store (``entries``: its resolved addresses) every 0.25 s until one connection is
    accepted (``None``: torch's client then connects at once) or ``deadline`` (``time.monotonic()``) passes: the last
    error, in words. Bounded to the second, where torch's client sleeps a random back-off (up to several seconds) past
    its timeout. The probe connections close without a word, which the store drops. Local."""
    last = "no attempt"
    while True:
        for family, kind, proto, _, sockaddr in entries:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return last
            try:
                with socket.socket(family, kind, proto) as probe:
                    probe.settimeout(min(remaining, 5.0))
                    probe.connect(sockaddr)
                return None
            except OSError as error:
                last = f"{type(error).__name__}: {error} (at {sockaddr[0]})"
        time.sleep(max(0.0, min(0.25, deadline - time.monotonic())))


def _join_launcher_rendezvous(backend: str) -> None:
    """Create the default torch.distributed group from the launcher's ``env://`` variables (already checked by
    :func:`_check_launcher_environment`), the rendezvous bounded by :func:`rendezvous_timeout`, the group and its
    store then on DeepSpeed's collective timeout; ``deepspeed.init_distributed`` then wraps the group.

    Collective: every rank of the launch must call it (they meet at ``MASTER_ADDR:MASTER_PORT``).

    Raises:
        RendezvousError: ``MASTER_ADDR`` does not resolve, or the rendezvous did not complete in time.
        ValueError: ``$ZERO_BNB_RENDEZVOUS_TIMEOUT`` is not a number of seconds > 0.
    """
    import deepspeed
    import torch.distributed
    from deepspeed.constants import default_pg_timeout
    from torch.distributed.rendezvous import rendezvous

    seconds = rendezvous_timeout()
    started = time.monotonic()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])  # as torch reads them
    where = f"MASTER_ADDR={os.environ['MASTER_ADDR']!r}, MASTER_PORT={os.environ['MASTER_PORT']!r}"
    who = f"rank {rank} of {world_size} (RANK={os.environ['RANK']!r}, WORLD_SIZE={os.environ['WORLD_SIZE']!r})"
    entries, unresolved = _resolve(addr, port, seconds)
    if unresolved is not None:
        raise RendezvousError(
            f"zero_bnb.enable(): {who} cannot reach the launcher's rendezvous: {where}, and {addr!r} does not "
            f"resolve to an address ({unresolved}). Fix: {_FIX_ADDRESS}"
        )
    addresses = ", ".join(dict.fromkeys(str(entry[4][0]) for entry in entries))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if agent_store:
        tried = f"connecting to torchrun's agent store at {addr}:{port} ({addresses})"
    elif rank == 0:
        tried = f"hosting the rendezvous store on port {port} and connecting to it at {addr}:{port} ({addresses})"
        if world_size > 1:
            tried += f", then waiting for the other {world_size - 1} rank(s) to connect"
    else:
        tried = f"connecting to rank 0's rendezvous store at {addr}:{port} ({addresses})"

    def failed(said: str) -> RendezvousError:
        return RendezvousError(
            f"zero_bnb.enable(): {who} could not join the launcher's rendezvous (gave up after "
            f"{time.monotonic() - started:.1f} s; limit {seconds:g} s, {RENDEZVOUS_TIMEOUT_ENV}): {where}; tried "
            f"{tried}; {said}. Fix: {_FIX_ADDRESS}; start rank 0 and every other rank so that all reach "
            f"zero_bnb.enable() within {seconds:g} s of each other, or raise {RENDEZVOUS_TIMEOUT_ENV} (seconds)"
        )

    if agent_store or rank != 0:  # the store is another process's: wait until it listens, to the second
        refused = _wait_for_listener(entries, started + seconds)
        if refused is not None:
            raise failed(f"the last attempt failed with {refused}")
    try:
        store, rank, world_size = next(rendezvous(
            "env://", timeout=timedelta(seconds=max(1.0, seconds - (time.monotonic() - started)))))
    except (RuntimeError, OSError) as error:  # torch.distributed.DistError (a RuntimeError) and socket errors
        said = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
        raise failed(f"torch said: {said}") from error
    # Joined: from here on the store serves the process group, whose waits are collectives' (DeepSpeed's timeout,
    # as deepspeed.init_distributed's own env:// initialisation would give them), not the rendezvous'.
    store.set_timeout(default_pg_timeout)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                         timeout=default_pg_timeout)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               timeout=default_pg_timeout)


def join_deepspeed_comm() -> str:
    """Initialise ``deepspeed.comm`` when it can (see the module docstring); return what it did, in words.

    Collective only in case 3 (a CPU launch with no group yet): that joins the launcher's rendezvous, so every rank
    must call it (as every rank calls :func:`zero_bnb.enable`); otherwise local.

    Raises:
        ValueError: in case 3, launcher variables that cannot be used (:func:`_check_launcher_environment`), or an
            invalid ``$ZERO_BNB_RENDEZVOUS_TIMEOUT``.
        RendezvousError: in case 3, the rendezvous did not complete within ``$ZERO_BNB_RENDEZVOUS_TIMEOUT`` seconds.
    """
    import torch.distributed
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    if comm.is_initialized():
        what = (f"deepspeed.comm already initialised (rank {comm.get_rank()} of {comm.get_world_size()}); "
                "left as it is")
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        backend = torch.distributed.get_backend()
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        what = (f"deepspeed.comm now wraps the existing torch.distributed group ({backend}, rank "
                f"{comm.get_rank()} of {comm.get_world_size()})")
    else:
        device = get_accelerator().device_name()
        missing = [name for name in LAUNCHER_VARIABLES if not os.environ.get(name)]
        if device != "cpu":
            what = (f"deepspeed.comm not initialised: DeepSpeed's accelerator is {device!r}, where the framework "
                    "initialises it once the device is chosen")
        elif missing:
            what = (f"deepspeed.comm not initialised: no process group and no launcher environment (missing "
                    f"{', '.join(missing)}): a single process, or a launcher zero_bnb does not join (MPI)")
        else:
            _check_launcher_environment()
            backend = get_accelerator().communication_backend_name()
            _join_launcher_rendezvous(backend)
            what = (f"deepspeed.comm initialised from the launcher's environment ({backend}, rank "
                    f"{comm.get_rank()} of {comm.get_world_size()}, MASTER_ADDR={os.environ['MASTER_ADDR']}, "
                    f"MASTER_PORT={os.environ['MASTER_PORT']})")
    logger.debug("zero_bnb.enable(): %s", what)
    return what
