"""The only code that touches DeepSpeed internals: the engine (``engine``), the block-aligned ZeRO and
BF16 optimizer wrappers (``aligned``, ``zero_optimizer``), ``zero_bnb.initialize`` (``initialize``), the
``deepspeed.initialize`` substitution behind ``zero_bnb.enable()`` (``substitute``) and DeepSpeed's
loss-scaler objects (``loss_scaler``).

May import: DeepSpeed, torch, every zero_bnb package except ``tools``, ``integrations``, ``cli``
and ``testing``; declared exceptions: ``substitute`` imports ``integrations.hf`` when a
transformers Trainer is the caller (Trainer's scheduler fix on resume), ``integrations.accelerate``
when it installs the dispatcher (Accelerate's offload swap keeps the user's optimizer), and
``integrations.conversions`` (DeepSpeed's ``zero_to_fp32`` functions routed to zero_bnb's export for zero_bnb
checkpoints), and ``integrations.comm`` (``enable()`` initialises ``deepspeed.comm`` before a stage-3 model is built).
"""
