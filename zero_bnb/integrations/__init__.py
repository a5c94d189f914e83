"""Front doors for training frameworks: transformers' Trainer on resume (``hf``,
``scheduler_groups``; installed by ``zero_bnb.enable()``, :mod:`zero_bnb.ds.substitute`), Accelerate's
optimizer offload keeping the user's optimizer (``accelerate``; installed the same way),
Lightning (``lightning``), ``deepspeed.comm`` initialised by ``zero_bnb.enable()`` before a stage-3 model is built
(``comm``), and DeepSpeed's / Lightning's ``zero_to_fp32`` functions on zero_bnb
checkpoints (``conversions``). Each imports its framework only inside itself, so ``import zero_bnb``
stays light.

May import: any zero_bnb package except ``cli`` and ``testing``.
"""
