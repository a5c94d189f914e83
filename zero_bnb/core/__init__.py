"""Pure layout math and state declarations: block-aligned partition geometry and copy planning
(``layout``), the kinds of optimizer state and each optimizer family's declaration (``state_spec``),
how each kind is split across ranks and merged back (``kinds``), 8-bit <-> fp32 conversion
(``quant``), zero_bnb's config keys (``config``), fp32 masters from bf16 weights and 16-bit
residuals (``residual``).

May import: torch, ``zero_bnb.errors`` and each other; bitsandbytes only inside functions.
Never torch.distributed, DeepSpeed or any other zero_bnb package.
"""
