"""The on-disk checkpoint format and its safe I/O: the manifest and its validation (``manifest``),
the shard and replicated payload records with their checks, reader and writer (``payload``), how
master weights are stored, whole or derived from the module weights, and rebuilt (``masters``),
durable fsynced and hashed writes (``durable``; ``torch.save`` without the zip CRC-32, ``zip_crc``; around the page
cache for a background writer, ``direct_io``), file and checksum checks
(``integrity``), names that stay inside their folder (``paths``), ``weights_only`` loading
(``unpickle``), the save-folder lock (``lock``), tags and pointer files (``tags``), the loss
scaler as plain data (``wrapper_state``), DeepSpeed's stock file layout (``stock_files``), the
one reader of a checkpoint folder (``reader``) and whether a folder holds a complete checkpoint or an interrupted
save (``progress``).

May import: torch, ``zero_bnb.errors``, ``zero_bnb.versions``, ``zero_bnb.core``. Never
torch.distributed or DeepSpeed (``unpickle`` allows DeepSpeed's loss-scaler and enum classes by
name when unpickling DeepSpeed's files, importing them only then).
"""
