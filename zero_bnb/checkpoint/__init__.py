"""The save and load protocol: staged atomic commit (``commit``), writing an optimizer's partitions
(``save``), what is staged (``staging``: nothing copied for a synchronous save, host buffers for an asynchronous one)
and the save's second half, decide-write-commit, run at once or by the background writer (``staged``,
``background``), opening,
planning and applying a load at any DP size (``load``, ``restore``), DeepSpeed's model file checked before a load
applies it (``model_file``), checks before saving (``state_checks``), agreement across ranks (``collective``),
module weights derived from master weights (``derived``) and how a save stores the masters (``masters``), batch
geometry (``batch``), regrouping by parameter name (``regroup``), what a load did to state it could not copy as
saved, in words (``precision``), stock DeepSpeed checkpoints read into zero_bnb's layout (``stock_import``), whole
groups in memory (``whole``), what the protocol needs from an optimizer wrapper (``partitioned``) and the
``zero_to_fp32.py`` script written beside checkpoints (``recovery_script``), and a front door's checkpoint folder
counted complete only once all of it is durable (``front_door``).

May import: torch (and torch.distributed), ``zero_bnb.errors``, ``zero_bnb.versions``,
``zero_bnb.core``, ``zero_bnb.format``, ``zero_bnb.kernels`` (the compiled bf16 residual split). Never DeepSpeed:
it reaches the optimizer wrapper through :class:`~zero_bnb.checkpoint.partitioned.PartitionedOptimizer`.
"""
