"""Multi-process scenarios for the Hugging Face front doors (Trainer, Accelerate): real packages, gloo, CPU.

Each function is one launch; rank 0 writes what pytest checks.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
import torch.distributed as dist
from scenarios import _error, run_phases

import zero_bnb

VOCAB, SEQ, SAMPLES = 96, 16, 240
MICRO = 2
GLOBAL_BATCH = 12
#: Hidden size of the stage-3 GPT-2 (``hf_stage3_scenarios``): its token embedding (96 x 48 = 4608 elements) is above
#: bitsandbytes' min_8bit_size (4096), so only Trainer's 32-bit override for embeddings keeps its state fp32.
Z3_EMBD = 48


def tiny_gpt2(seed: int = 0, *, n_embd: int = 32, from_config: bool = False):
    """GPT-2 of 2 layers built from a config (nothing downloaded). ``from_config`` builds it the way
    ``from_pretrained`` does, under ``deepspeed.zero.Init`` while a stage-3 DeepSpeed config is alive."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=n_embd, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(config) if from_config else GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    """Deterministic token sequences (a noisy counting pattern), the same in every process."""

    def __init__(self, count: int = SAMPLES):
        generator = torch.Generator().manual_seed(7)
        starts = torch.randint(0, VOCAB, (count, 1), generator=generator)
        steps = torch.randint(1, 4, (count, 1), generator=generator)
        self.ids = (starts + steps * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def ds_config(**extra) -> dict:
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        **extra,
    }


#: Trainer's other bitsandbytes optimizer names, each saved at 2 processes and resumed at 3 (short runs), with the
#: optimizer offloaded to the CPU (Accelerate would swap them for DeepSpeedCPUAdam without zero_bnb).
OTHER_OPTIMS = ("lion_8bit", "paged_adamw_8bit", "paged_lion_32bit", "rmsprop_bnb_8bit", "ademamix_8bit")
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}


def offload_config(stage: int = 1, **extra) -> dict:
    return ds_config(zero_optimization={"stage": stage, **OFFLOAD}, **extra)


#: Trainer's remaining bitsandbytes names: the optimizer Trainer builds for each (its class and arguments, from
#: Trainer.get_optimizer_cls_and_kwargs) under zero_bnb on the toy model, saved at DP=2 and loaded at DP=3.
MORE_OPTIMS = ("adamw_8bit", "lion_32bit", "paged_adamw_32bit", "paged_lion_8bit", "rmsprop_bnb", "rmsprop_bnb_32bit",
               "paged_ademamix_8bit", "paged_ademamix_32bit", "ademamix")


def _trainer(workdir, world, *, name="out", optim="adamw_bnb_8bit", max_steps=8, save_steps=4, config=None,
             accumulation=None, stage3=False, callbacks=None, **arguments):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=os.path.join(workdir, name),
        per_device_train_batch_size=MICRO,
        # the default keeps the global batch at any DP size
        gradient_accumulation_steps=accumulation or GLOBAL_BATCH // (MICRO * world),
        max_steps=max_steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        optim=optim,
        deepspeed=config or ds_config(),
        use_cpu=True,
        logging_steps=1,
        save_steps=save_steps,
        save_strategy="steps",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **arguments,
    )
    # At stage 3 the model is built after TrainingArguments (whose DeepSpeed config is then alive), as
    # from_pretrained would be: under deepspeed.zero.Init.
    model = tiny_gpt2(n_embd=Z3_EMBD, from_config=True) if stage3 else tiny_gpt2()
    return Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=callbacks)


def _losses(trainer):
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def _describe_engine(engine) -> dict:
    groups = [[engine.param_names[p] for p in group] for group in engine.optimizer.bit16_groups]
    base = engine.optimizer.optimizer
    flat = engine.optimizer.single_partition_of_fp32_groups  # one flat fp32 tensor per group (ZeRO-1)
    dtypes = [str(base.state[p]["state1"].dtype) if p in base.state else None for p in flat]
    return {"engine": type(engine).__name__, "groups": groups, "state1_dtypes": dtypes,
            "optimizer": f"{type(base).__module__}.{type(base).__qualname__}",
            "cpu_offload": bool(engine.optimizer.cpu_offload)}


def trainer_run(workdir, world, *, name="out", resume_from=None, **settings):
    """Trainer + adamw_bnb_8bit (or ``optim=``): 8 steps saving at step 4, or resume from ``resume_from``."""
    trainer = _trainer(workdir, world, name=name, **settings)
    trainer.train(resume_from_checkpoint=resume_from)
    return {"losses": _losses(trainer), **_describe_engine(trainer.model_wrapped)}


def _global_batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return TokenData().ids[torch.randperm(SAMPLES, generator=generator)[:GLOBAL_BATCH]]


def _accelerate_steps(accelerator, model, optimizer, first: int, count: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = GLOBAL_BATCH // (MICRO * world)
    losses = []
    for step in range(first, first + count):
        ids = _global_batch(step)
        total = torch.zeros(())
        for micro in range(accum):
            rows = ids[(micro * world + rank) * MICRO:(micro * world + rank + 1) * MICRO]
            with accelerator.accumulate(model):  # DeepSpeed steps only where Accelerate syncs gradients
                loss = model(input_ids=rows, labels=rows).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (accum * world))
    return losses


class CallRecorder:
    """A user's own ``deepspeed.initialize`` wrapper (as MS-AMP or a logging patch would install)."""

    def __init__(self, wrapped):
        self.wrapped, self.calls = wrapped, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.wrapped(*args, **kwargs)


def accelerate_run(workdir, world, *, resume: bool, offload: bool = False) -> dict:
    """Accelerate without Trainer: prepare inside ``with zero_bnb.enabled()``, save_state / load_state.

    A user wrapper is installed on ``deepspeed.initialize`` before: zero_bnb must call through it.
    With ``offload`` the optimizer is offloaded to the CPU (Accelerate's swap to DeepSpeedCPUAdam must not happen).
    """
    import bitsandbytes as bnb
    import deepspeed
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(reset_partial_state=False)  # a Trainer ran in this process before
    config = ds_config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * world), gradient_clipping=1.0)
    if offload:
        config["zero_optimization"].update(OFFLOAD)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = tiny_gpt2()
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=3e-3)
    original = deepspeed.initialize
    recorder = deepspeed.initialize = CallRecorder(original)
    try:
        with zero_bnb.enabled():
            model, optimizer = accelerator.prepare(model, optimizer)
    finally:
        deepspeed.initialize = original
    out = {"engine": type(model).__name__, "user_wrapper_calls": recorder.calls,
           "enabled_after_block": zero_bnb.is_enabled()}
    folder = os.path.join(workdir, "accelerate_state")
    if resume:
        accelerator.load_state(folder)
        out["global_steps"] = model.global_steps
        out["losses"] = _accelerate_steps(accelerator, model, optimizer, 4, 4)
    else:
        out["losses"] = _accelerate_steps(accelerator, model, optimizer, 0, 4)
        accelerator.save_state(folder)
        out["losses"] += _accelerate_steps(accelerator, model, optimizer, 4, 4)
    return {**out, **_describe_engine(model)}  # after training: the state exists


class Captured(logging.Handler):
    """Log records of one logger while a block runs."""

    def __init__(self, *names: str):
        super().__init__(logging.DEBUG)
        self.names, self.messages = names, []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        for name in self.names:
            logging.getLogger(name).addHandler(self)
            logging.getLogger(name).setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        for name in self.names:
            logging.getLogger(name).removeHandler(self)


def _refusals(workdir, world) -> dict:
    """The optimizer-section mistakes, each refused before anything is built."""
    import bitsandbytes as bnb

    section = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    out = {}
    with zero_bnb.enabled():
        out["trainer_optimizer_section"] = _error(
            lambda: _trainer(workdir, world, name="refused", config=ds_config(optimizer=section)).train())
    model = tiny_gpt2()
    config = ds_config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * world), gradient_clipping=1.0,
                       optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    out["client_and_section"] = _error(lambda: zero_bnb.initialize(
        model=model, optimizer=bnb.optim.AdamW8bit(model.parameters()), config=config))
    return out


def _assigned_initialize(world) -> dict:
    """The obvious ``deepspeed.initialize = zero_bnb.initialize`` (recursed forever before)."""
    import bitsandbytes as bnb
    import deepspeed

    from zero_bnb.testing.toy import DEFAULT_RUN, build_model, param_groups, train_steps

    original = deepspeed.initialize
    deepspeed.initialize = zero_bnb.initialize
    try:
        model = build_model()
        engine, *_ = deepspeed.initialize(model=model, optimizer=bnb.optim.Adam8bit(param_groups(model), lr=1e-2),
                                          config=DEFAULT_RUN.ds_config(world))
    finally:
        deepspeed.initialize = original
    return {"engine": type(engine).__name__, "losses": train_steps(engine, DEFAULT_RUN, 0, 1)}


def _plain_engine_load(workdir, world) -> str | None:
    """A zero_bnb checkpoint loaded by a plain DeepSpeed engine (zero_bnb.enable() forgotten): the error."""
    import bitsandbytes as bnb
    import deepspeed

    model = tiny_gpt2()
    config = ds_config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * world), gradient_clipping=1.0,
                       zero_allow_untested_optimizer=True)  # what Trainer and Accelerate set
    engine, *_ = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(model.parameters()), config=config)
    assert type(engine).__name__ == "DeepSpeedEngine"
    return _error(lambda: engine.load_checkpoint(os.path.join(workdir, "out", "checkpoint-4")))


def _readme_namespace(world) -> dict:
    """What the README's examples assume exists: a model, a dataset, a loader of micro-batches, WORLD_SIZE."""
    subset = torch.utils.data.Subset(TokenData(), range(2 * GLOBAL_BATCH))  # 2 optimizer steps at any DP size
    return {"model": tiny_gpt2(), "dataset": TokenData(), "WORLD_SIZE": world,
            "loader": torch.utils.data.DataLoader(subset, batch_size=MICRO)}


def readme_trainer(workdir, world, part: str, *, use_cpu: bool = True, stock: bool = False) -> dict:
    """The README's Trainer example (and its ds.json), set-up + ``part`` ("# first run" or "# later"), 2 steps each.

    ``use_cpu=False`` runs it without the README's CPU advice; ``stock`` without ``zero_bnb.enable()``.
    """
    import json

    from readme_examples import adapt, block, run, segment, segments

    # The variants without the README's advice get folders of their own: where they do train (transformers 4.x
    # counts the processes without use_cpu=True), their checkpoints must not land in the example's checkpoint folder.
    variant = ("" if use_cpu else "_without_use_cpu") + ("_stock" if stock else "")
    folder = os.path.join(workdir, "readme_trainer" + variant)
    if dist.get_rank() == 0:  # one writer, complete before any rank reads it
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "ds.json.tmp"), "w") as handle:
            json.dump(json.loads(block("Hugging Face Trainer", "json")), handle)
        os.replace(os.path.join(folder, "ds.json.tmp"), os.path.join(folder, "ds.json"))
    dist.barrier()
    parts = segments(block("Hugging Face Trainer"))
    steps = 2 if part == "# first run" else 4
    code = adapt(parts["setup"] + segment(parts, part), {
        'deepspeed="ds.json",': f'deepspeed="ds.json", use_cpu={use_cpu}, max_steps={steps}, disable_tqdm=True,',
        **({"zero_bnb.enable()": "zero_bnb.disable()"} if stock else {}),
        "save_steps=500": "save_steps=2",
        **({'"out/checkpoint-500"': '"out/checkpoint-2"'} if part == "# later" else {}),
    })
    try:
        with Captured("zero_bnb") as log:
            namespace = run(code, _readme_namespace(world), folder)
    finally:
        zero_bnb.disable()  # the example enables zero_bnb process-wide
    trainer = namespace["trainer"]
    return {"engine": type(trainer.model_wrapped).__name__, "global_step": trainer.state.global_step,
            "log": log.messages}


def _gathered(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def accelerate_without_cpu_state(world) -> list[int]:
    """Every process's ``process_index`` when an Accelerator is created on CPU without ``PartialState(cpu=True)``
    first: the reason the README gives that advice (its Accelerate example, run by ``accelerate launch`` in
    tests/test_readme_launch.py, creates it and gets one index per process)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(reset_partial_state=True)  # as in a new process
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO,
                                                     gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * world)))
    indices = _gathered(Accelerator(deepspeed_plugin=plugin).process_index)
    AcceleratorState._reset_state(reset_partial_state=True)
    return indices


def _trainer_named_optimizer(workdir, world, name: str, *, load: bool) -> dict:
    """The optimizer Trainer's ``optim=name`` builds, under zero_bnb on the toy model: 2 steps and a save at DP=2,
    or the load at DP=3; bitsandbytes' view of the state either way (``optimizer_scenarios.bnb_view``: no zero_bnb
    code)."""
    import functools

    from optimizer_scenarios import bnb_view
    from transformers import Trainer, TrainingArguments

    from zero_bnb.testing.toy import DEFAULT_RUN, build_engine, param_groups, train_steps

    args = TrainingArguments(output_dir=os.path.join(workdir, "names"), optim=name, report_to=[])
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    engine = build_engine(world, functools.partial(cls, **{k: v for k, v in kwargs.items() if k != "lr"}))
    folder = os.path.join(workdir, "names", name)
    if load:
        engine.load_checkpoint(folder)
    else:
        train_steps(engine, DEFAULT_RUN, 0, 2)
        engine.save_checkpoint(folder, tag="t")
    return {"class": f"{cls.__name__}({kwargs.get('optim_bits')}-bit)", "state": bnb_view(engine, param_groups(engine.module))}


def _more_optims(workdir, world, *, load: bool) -> dict:
    return {name: _error_or(lambda name=name: _trainer_named_optimizer(workdir, world, name, load=load))
            for name in MORE_OPTIMS}


def _error_or(fn):
    """``fn()``, or the ``"Class: message"`` of what it raised."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"


def trainer_async(workdir, world) -> dict:
    """Trainer saving asynchronously (``zero_checkpoint_async``) every 2 steps with ``save_total_limit=1``: the
    losses of the synchronous run's first 6 steps, one complete checkpoint left (the older ones deleted only once
    the newer one was committed)."""
    trainer = _trainer(workdir, world, name="async", max_steps=6, save_steps=2, save_total_limit=1,
                       config=ds_config(zero_checkpoint_async=True))
    trainer.train()
    trainer.model_wrapped.wait_for_checkpoint()
    folder = os.path.join(workdir, "async")
    return {"losses": _losses(trainer), "folders": sorted(n for n in os.listdir(folder) if n.startswith("checkpoint")),
            "verify": _error_or(lambda: zero_bnb.verify_checkpoint(os.path.join(folder, "checkpoint-6")) and None)}


def accelerate_async(workdir, world) -> dict:
    """Accelerate's save_state with zero_checkpoint_async and ProjectConfiguration(total_limit=1): Accelerate deletes
    the older checkpoint folders before it saves, so a save still being written (slowed down here) is committed
    first, then deleted; the newest checkpoint is complete."""
    import time

    import bitsandbytes as bnb
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration

    from zero_bnb.format import durable

    AcceleratorState._reset_state(reset_partial_state=False)
    config = ds_config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * world), gradient_clipping=1.0,
                       zero_checkpoint_async=True)
    project = os.path.join(workdir, "accelerate_async")
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=1))
    model = tiny_gpt2()
    model, optimizer = accelerator.prepare(model, bnb.optim.AdamW8bit(model.parameters(), lr=3e-3))
    durable.set_io_hook(lambda event, path: time.sleep(0.05) if event == "write" else None)
    try:
        losses = _accelerate_steps(accelerator, model, optimizer, 0, 1)
        accelerator.save_state()
        pending = model._zero_bnb_background.pending
        losses += _accelerate_steps(accelerator, model, optimizer, 1, 1)
        accelerator.save_state()  # deletes checkpoint_0 first: only once it is committed
        model.wait_for_checkpoint()
    finally:
        durable.set_io_hook(None)
    folder = os.path.join(project, "checkpoints")
    return {"pending_after_save_state": pending, "folders": sorted(os.listdir(folder)), "losses": losses,
            "verify": _error_or(lambda: zero_bnb.verify_checkpoint(os.path.join(folder, "checkpoint_1"))
                                and None)}


def hf_dp2(rank, world, workdir):
    """One launch at DP=2: Trainer (zero_bnb and stock), Accelerate, refusals, plain-assignment enabling."""
    out = {}
    zero_bnb.enable()
    zero_bnb.enable()  # twice: a no-op
    try:
        with Captured("DeepSpeed") as deepspeed_log:
            out["trainer"] = trainer_run(workdir, world)
        out["deepspeed_log"] = deepspeed_log.messages
        for optim in OTHER_OPTIMS:
            out[optim] = trainer_run(workdir, world, name=optim, optim=optim, max_steps=4, save_steps=2,
                                     config=offload_config())
        out["offload_zero2"] = trainer_run(workdir, world, name="offload_zero2", max_steps=4, save_steps=2,
                                           config=offload_config(stage=2))
        out["trainer_async"] = trainer_async(workdir, world)
        out["accelerate_async"] = _error_or(lambda: accelerate_async(workdir, world))
    finally:
        zero_bnb.disable()
        zero_bnb.disable()  # without enable: a no-op
    with Captured("DeepSpeed") as deepspeed_log:
        out["stock_trainer"] = trainer_run(workdir, world, name="stock")  # stock DeepSpeed: zero_bnb disabled
    out["stock_deepspeed_log"] = deepspeed_log.messages
    with zero_bnb.enabled():  # the stock checkpoint, loaded directly at the DP size that wrote it
        out["stock_same_dp"] = trainer_run(workdir, world, name="stock_same_dp",
                                           resume_from=os.path.join(workdir, "stock", "checkpoint-4"))
    out["accelerate"] = accelerate_run(workdir, world, resume=False, offload=True)
    out.update(_refusals(workdir, world))
    out["assigned"] = _assigned_initialize(world)
    out["forgot_enable_same_dp"] = _plain_engine_load(workdir, world)
    out["readme_trainer"] = readme_trainer(workdir, world, "# first run")
    out["readme_trainer_without_use_cpu"] = [  # the README's reason for use_cpu=True, with zero_bnb and stock
        _error(lambda stock=stock: readme_trainer(workdir, world, "# first run", use_cpu=False, stock=stock))
        for stock in (False, True)]
    out["accelerate_without_cpu_state"] = accelerate_without_cpu_state(world)
    out["more_optims"] = _more_optims(workdir, world, load=False)
    from hf_stage3_scenarios import accelerate_z3_save, refusals_z3, save_16bit_model_bf16, trainer_z3_save

    # ZeRO stage 3 last: its DeepSpeed configs must be gone before any stage-1/2 model is built
    run_phases(out, {"world": world, "workdir": workdir}, trainer_z3_save, accelerate_z3_save, save_16bit_model_bf16,
               refusals_z3)
    if rank == 0:
        torch.save(out, os.path.join(workdir, "hf_dp2.pt"))


def _stock_module_only(workdir) -> dict:
    """Stock DeepSpeed (torch AdamW) reads the module weights of a zero_bnb Trainer checkpoint."""
    import deepspeed

    model = tiny_gpt2(seed=1)
    config = ds_config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * dist.get_world_size()),
                       gradient_clipping=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    engine.load_checkpoint(os.path.join(workdir, "out", "checkpoint-4"), load_module_only=True,
                           load_module_strict=False)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _changed_global_batch(workdir, world) -> list[str]:
    """Load the Accelerate checkpoint (global batch 12) with global batch 6: zero_bnb warns."""
    import bitsandbytes as bnb

    model = tiny_gpt2()
    config = ds_config(train_batch_size=MICRO * world, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=1, gradient_clipping=1.0)
    engine, *_ = zero_bnb.initialize(model=model, optimizer=bnb.optim.AdamW8bit(model.parameters(), lr=3e-3),
                                     config=config)
    with Captured("zero_bnb") as log:
        engine.load_checkpoint(os.path.join(workdir, "accelerate_state"), tag="pytorch_model")
    return log.messages


def hf_dp3(rank, world, workdir):
    """One launch at DP=3: resume everything hf_dp2 saved (accumulation 3 -> 2, global batch kept)."""
    out = {}
    # zero_bnb.enable() forgotten: Trainer's plain DeepSpeed engine refuses the checkpoint, naming zero_bnb.
    out["forgot_enable"] = _error(lambda: trainer_run(workdir, world, name="forgot",
                                                      resume_from=os.path.join(workdir, "out", "checkpoint-4")))
    with zero_bnb.enabled():
        with Captured("zero_bnb") as log:
            out["trainer"] = trainer_run(workdir, world, resume_from=os.path.join(workdir, "out", "checkpoint-4"))
        out["trainer_log"] = log.messages
        out["migrated"] = trainer_run(workdir, world, name="stock",
                                      resume_from=os.path.join(workdir, "stock", "checkpoint-4"))
        for optim in OTHER_OPTIMS:
            out[optim] = trainer_run(workdir, world, name=optim, optim=optim, max_steps=4, save_steps=2,
                                     config=offload_config(), resume_from=os.path.join(workdir, optim, "checkpoint-2"))
        # Saved offloaded at ZeRO-2, resumed without offload.
        out["offload_zero2"] = trainer_run(workdir, world, name="offload_zero2", max_steps=4, save_steps=2,
                                           config=ds_config(zero_optimization={"stage": 2}),
                                           resume_from=os.path.join(workdir, "offload_zero2", "checkpoint-2"))
        with Captured("zero_bnb") as log:  # global batch 12 -> 6: the warning in Trainer's words
            trainer_run(workdir, world, name="batch_changed", optim=OTHER_OPTIMS[0], max_steps=3, accumulation=1,
                        resume_from=os.path.join(workdir, OTHER_OPTIMS[0], "checkpoint-2"))
        out["trainer_batch_warning"] = log.messages
    out["readme_trainer"] = readme_trainer(workdir, world, "# later")
    out["accelerate"] = accelerate_run(workdir, world, resume=True)
    out["stock_module_only"] = _stock_module_only(workdir)
    out["batch_warning"] = _changed_global_batch(workdir, world)
    out["more_optims"] = _more_optims(workdir, world, load=True)
    from hf_stage3_scenarios import accelerate_z3_resume, trainer_z3_resume

    run_phases(out, {"world": world, "workdir": workdir}, trainer_z3_resume, accelerate_z3_resume)
    if rank == 0:
        torch.save(out, os.path.join(workdir, "hf_dp3.pt"))
