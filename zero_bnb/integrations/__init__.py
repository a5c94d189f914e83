"""Front doors for training frameworks: transformers' Trainer on resume (``hf``,
``scheduler_groups``; installed by ``zero_bnb.enable()``, :mod:`zero_bnb.integrations.substitute`), Accelerate's
optimizer offload keeping the user's optimizer (``accelerate``; installed the same way),
Lightning (``lightning``), ``deepspeed.comm`` initialised by ``zero_bnb.enable()`` before a stage-3 model is built
(``comm``), and DeepSpeed's / Lightning's ``zero_to_fp32`` functions on zero_bnb
checkpoints (``conversions``). Preemption: each front door's automatic resume takes the newest complete checkpoint
(``resume``; Accelerate's ``save_state``/``load_state``, ``accelerate_checkpoints``; Lightning's ``ckpt_path="last"``,
``lightning_resume``), a checkpoint on the preemption signal (``preemption``; Trainer's callback,
``hf_preemption``); patches installed when a framework's module is imported (``import_watch``). Each imports its framework only inside itself, so ``import zero_bnb``
stays light.

May import: any zero_bnb package except ``cli`` and ``testing``.
"""
