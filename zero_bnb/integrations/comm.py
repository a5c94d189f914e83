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
   ``deepspeed.init_distributed`` with the accelerator's backend (gloo, or ccl with oneCCL's bindings), the
   ``env://`` rendezvous. Accelerate and Trainer then find the group and use it.

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
import os

__all__ = ["LAUNCHER_VARIABLES", "join_deepspeed_comm"]

logger = logging.getLogger(__name__)

#: The variables of the ``env://`` rendezvous, set by ``torchrun``, the ``deepspeed`` launcher and ``accelerate launch``.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _check_launcher_environment() -> None:
    """Refuse launcher variables that no rendezvous can use, naming them (torch would fail on them later, with
    ``invalid literal for int()``).

    Raises:
        ValueError: ``RANK``, ``WORLD_SIZE`` or ``MASTER_PORT`` is not a number, or ``RANK`` is not below ``WORLD_SIZE``.
    """
    values = {name: os.environ[name].strip() for name in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    wrong = [f"{name}={value!r}" for name, value in values.items() if not value.isdigit()]
    if not wrong and not int(values["RANK"]) < int(values["WORLD_SIZE"]) > 0:
        wrong = [f"RANK={values['RANK']!r} with WORLD_SIZE={values['WORLD_SIZE']!r}"]
    if not wrong and not 0 < int(values["MASTER_PORT"]) < 65536:
        wrong = [f"MASTER_PORT={values['MASTER_PORT']!r}"]
    if wrong:
        raise ValueError(
            f"zero_bnb.enable(): the launcher's environment cannot start DeepSpeed's communication: "
            f"{', '.join(wrong)} (RANK and WORLD_SIZE are integers with 0 <= RANK < WORLD_SIZE, MASTER_PORT a TCP "
            f"port). Launch with torchrun, deepspeed or accelerate launch, which set them, or unset "
            f"{', '.join(LAUNCHER_VARIABLES)} to run one process"
        )


def join_deepspeed_comm() -> str:
    """Initialise ``deepspeed.comm`` when it can (see the module docstring); return what it did, in words.

    Collective only in case 3 (a CPU launch with no group yet): that joins the launcher's rendezvous, so every rank
    must call it (as every rank calls :func:`zero_bnb.enable`); otherwise local.

    Raises:
        ValueError: in case 3, launcher variables that cannot be used (:func:`_check_launcher_environment`).
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
            import deepspeed

            backend = get_accelerator().communication_backend_name()
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
            what = (f"deepspeed.comm initialised from the launcher's environment ({backend}, rank "
                    f"{comm.get_rank()} of {comm.get_world_size()}, MASTER_ADDR={os.environ['MASTER_ADDR']}, "
                    f"MASTER_PORT={os.environ['MASTER_PORT']})")
    logger.debug("zero_bnb.enable(): %s", what)
    return what
