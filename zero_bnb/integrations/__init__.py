"""Front doors for training frameworks: transformers' Trainer on resume (``hf``,
``scheduler_groups``; installed by ``zero_bnb.enable()``, :mod:`zero_bnb.ds.substitute`) and
Lightning (``lightning``). Each imports its framework only inside itself, so ``import zero_bnb``
stays light.

May import: any zero_bnb package except ``cli`` and ``testing``.
"""
