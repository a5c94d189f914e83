"""Scripts started by a real ``torchrun`` (``python -m torch.distributed.run``), not by the tests' launcher:
nothing initialises ``deepspeed.comm`` before they run, as in a user's launch. Run as
``python tests/torchrun_scenarios.py SCENARIO OUT.json``; rank 0 writes what ``tests/test_comm_init.py`` checks.

* ``trainer_z3``: ``zero_bnb.enable()`` first, then Trainer at ZeRO stage 3 with ``use_cpu=True`` and
  ``optim="adamw_bnb_8bit"``, the model built under ``deepspeed.zero.Init`` (as ``from_pretrained`` builds it), 2 steps.
* ``wrap``: the user's own ``torch.distributed.init_process_group("gloo")``, then ``zero_bnb.enable()``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from zero_bnb.testing.launch import exit_skipping_finalization

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _watch_comm() -> _Messages:
    handler = _Messages()
    logger = logging.getLogger("zero_bnb.integrations.comm")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    return handler


def trainer_z3() -> dict:
    import zero_bnb

    messages = _watch_comm()
    zero_bnb.enable()  # before TrainingArguments and the model, as the docs say
    from hf_scenarios import GLOBAL_BATCH, MICRO, Z3_EMBD, TokenData, tiny_gpt2
    from hf_stage3_scenarios import z3_config
    from transformers import Trainer, TrainingArguments

    world = int(os.environ["WORLD_SIZE"])
    args = TrainingArguments(output_dir=os.environ["ZERO_BNB_TEST_OUT"], per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * world), max_steps=2,
                             learning_rate=3e-3, optim="adamw_bnb_8bit", deepspeed=z3_config(True), use_cpu=True,
                             save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1)
    model = tiny_gpt2(n_embd=Z3_EMBD, from_config=True)
    # zero.Init partitions each parameter over the world it sees: ceil(numel / world) elements here
    partitions = {name: [p.ds_numel, p.ds_tensor.numel()] for name, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=TokenData())
    trainer.train()
    described = zero_bnb.describe(trainer.model_wrapped)
    return {"comm": messages.messages, "world": world, "partitions": partitions,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "dp_size": described["dp_size"], "zero_stage": described["zero_stage"],
            "eight_bit_groups": len(described["eight_bit_groups"])}


def wrap() -> dict:
    import torch
    import torch.distributed as dist

    import zero_bnb

    dist.init_process_group("gloo")
    messages = _watch_comm()
    zero_bnb.enable()
    zero_bnb.enable()  # the second call is a no-op
    from deepspeed import comm

    total = torch.ones(1)
    comm.all_reduce(total)
    return {"comm": messages.messages, "initialized": comm.is_initialized(), "world": comm.get_world_size(),
            "sum": total.item(), "same_group": comm.get_world_group() is dist.group.WORLD}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    result = {"trainer_z3": trainer_z3, "wrap": wrap}[scenario]()
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(result, handle)
    dist.barrier()
    dist.destroy_process_group()
    # Left to interpreter finalization, a gloo worker thread could abort the process (see the function).
    exit_skipping_finalization()


if __name__ == "__main__":
    main()
