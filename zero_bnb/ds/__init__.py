"""The only code that touches DeepSpeed internals: the engine (``engine``), the block-aligned ZeRO and
BF16 optimizer wrappers (``aligned``, ``zero_optimizer``), ``zero_bnb.initialize`` (``initialize``), the dispatcher
that stands in for ``deepspeed.initialize`` while zero_bnb routes calls (``dispatch``; its front door,
``zero_bnb.enable()``, is ``integrations.substitute``) and DeepSpeed's loss-scaler objects (``loss_scaler``).

May import: DeepSpeed, torch, every zero_bnb package except ``tools``, ``integrations``, ``cli`` and ``testing``.
"""
