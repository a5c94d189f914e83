"""The fused CPU blockwise 8-bit optimizer update and its specification.

Owns: the arithmetic bitsandbytes' CUDA kernels apply to 8-bit state (``reference``: plain torch, the
specification), its per-step float32 scalars (``hyper``), the C++/OpenMP kernel that computes the same
bits one 256-element block at a time (``csrc/``, compiled by ``build`` into a cache whose files ``cache`` guards:
what may be loaded or replaced there and the build lock; called by ``fused``),
and the replacement of a bitsandbytes optimizer's ``update_step`` that sends every 8-bit update whose
state lives on the CPU to that kernel (``cpu_update``, chosen by ``zero_cpu_update``); the same library holds the
bf16 residual split of a checkpoint's masters (``residual``: the torch version where no compiler is found).

May import: torch, bitsandbytes, ``zero_bnb.errors``, ``zero_bnb.core``, ``zero_bnb.kernels``.
"""
