"""``zero_to_fp32.py`` in a save folder: DeepSpeed's script of that name, for zero_bnb checkpoints.

``python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]`` writes
``pytorch_model.bin`` (or ``model.safetensors``) with the consolidated fp32 module state dict
(:func:`zero_bnb.tools.recovery.get_fp32_state_dict_from_zero_checkpoint`).
"""

from __future__ import annotations

import argparse
import os
import sys

from zero_bnb.errors import CheckpointError
from zero_bnb.tools.recovery import get_fp32_state_dict_from_zero_checkpoint
from zero_bnb.tools.views import write_state_dict

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, write the consolidated weights; returns the exit code (1 on a checkpoint error)."""
    parser = argparse.ArgumentParser(description="consolidated fp32 weights of a zero_bnb checkpoint")
    parser.add_argument("checkpoint_dir", help="the save folder (holding 'latest') or a tag folder")
    parser.add_argument("output_dir", help="folder for pytorch_model.bin (or model.safetensors)")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("--max_shard_size", default=None, help="accepted for compatibility; one file is written")
    args = parser.parse_args(argv)
    out = os.path.join(args.output_dir, "model.safetensors" if args.safe_serialization else "pytorch_model.bin")
    try:
        state = get_fp32_state_dict_from_zero_checkpoint(args.checkpoint_dir, args.tag, args.exclude_frozen_parameters)
        count = write_state_dict(state, out, metadata={"format": "pt"})  # tied names too: every name is written
    except CheckpointError as error:  # a full disk included: nothing written, one line
        print(f"zero_to_fp32: {type(error).__name__}: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    print(f"zero_bnb: wrote {count} tensors to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
