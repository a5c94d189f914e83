"""The fused blockwise 8-bit optimizer updates (CPU and GPU) and their specification.

Owns: the arithmetic bitsandbytes' CUDA kernels apply to 8-bit state (``reference``: plain torch, the
specification), its per-step float32 scalars (``hyper``), the C++/OpenMP kernel that computes the same
bits one 256-element block at a time (``csrc/``, compiled by ``build`` into a cache whose files ``cache`` guards:
what may be loaded or replaced there and the build lock; called by ``fused``),
the same arithmetic as one Triton kernel for parameters on a GPU (``triton_kernel``, launched by ``triton_update``;
Triton is imported on first use, and its interpreter runs the kernel on CPU tensors for tests), and the replacement
of a bitsandbytes optimizer's ``update_step`` that sends each 8-bit update to one of them by the parameter's device
(``update``, chosen by ``zero_cpu_update`` and ``zero_gpu_update``); the same library holds the bf16 residual split
of a checkpoint's masters (``residual``: the torch version where no compiler is found).

May import: torch, bitsandbytes, triton (on first use), ``zero_bnb.errors``, ``zero_bnb.core``, ``zero_bnb.kernels``.
"""
