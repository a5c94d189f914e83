"""Offline checkpoint tools, one process, no engine and no torch.distributed: whole checkpoints in
memory and the one offline writer (``offline``), finding checkpoints (``checkpoint_paths``), where
outputs may go (``outputs``), inspect and export (``views``), universal conversion and stock rescue
(``convert``), ``zero_to_fp32`` (``recovery``).

May import: torch, bitsandbytes, ``zero_bnb.core``, ``zero_bnb.format``, ``zero_bnb.checkpoint``
(its local, non-collective functions), and ``zero_bnb.ds.loss_scaler`` inside the one function that needs it
(an fp16 checkpoint converted to universal: stock DeepSpeed unpickles its own loss-scaler object). Never the engine.
"""
