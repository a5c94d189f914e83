"""bitsandbytes glue: partitions above 2^31 elements updated in pieces (``chunked``), per-parameter
overrides under ZeRO (``overrides``).

May import: bitsandbytes, torch, ``zero_bnb.errors``, ``zero_bnb.core``.
"""
