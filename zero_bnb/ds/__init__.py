"""The only code that touches DeepSpeed internals: the engine (``engine``; its checkpoint engine and the record of
the save or load under way, ``checkpoint_engine``; its account of a load, ``load_log``), the block-aligned ZeRO and
BF16 optimizer wrappers (``aligned``, ``zero_optimizer``, ``stage3``), ``zero_bnb.initialize`` (``initialize``;
DeepSpeed's names rebound while it builds, ``patching``), the dispatcher that stands in for ``deepspeed.initialize``
while zero_bnb routes calls (``dispatch``; its front door, ``zero_bnb.enable()``, is ``integrations.substitute``)
and DeepSpeed's loss-scaler objects (``loss_scaler``).

May import: DeepSpeed, torch, every zero_bnb package except ``tools``, ``integrations``, ``cli`` and ``testing``.
"""
