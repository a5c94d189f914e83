"""``zero_to_fp32.py`` beside every checkpoint, as DeepSpeed writes it: the script, not what it runs.

The script imports :mod:`zero_bnb.cli.zero_to_fp32` (the consolidated fp32 state dict of a
zero_bnb checkpoint, through :mod:`zero_bnb.tools.recovery`). Local: one process (rank 0 of a
save) writes it.
"""

from __future__ import annotations

import logging
import os
import stat

from zero_bnb.format.durable import write_text
from zero_bnb.format.publish import replacing

__all__ = ["SCRIPT_NAME", "write_recovery_script"]

logger = logging.getLogger(__name__)

SCRIPT_NAME = "zero_to_fp32.py"

_SCRIPT = '''#!/usr/bin/env python
"""Consolidated fp32 weights of the zero_bnb checkpoints in this folder (written by zero_bnb).

Same use as DeepSpeed's zero_to_fp32.py:
    python zero_to_fp32.py . OUTPUT_DIR [-t TAG] [--safe_serialization]
or, in Python, DeepSpeed's functions of the script:
    from zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint(".")
    load_state_dict_from_zero_checkpoint(model, "."), convert_zero_checkpoint_to_fp32_state_dict(".", OUTPUT_DIR),
    convert_zero_checkpoint_to_state_dict(".", OUTPUT_DIR, dtype=torch.bfloat16)
Needs zero_bnb installed (pip install zero_bnb).
"""
import os
import sys

# This folder is sys.path[0] when the script runs (and often the working directory when it is
# imported): never import zero_bnb, torch or anything else from files planted beside it.
_HERE = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
_PATH = list(sys.path)
sys.path[:] = [entry for entry in sys.path if os.path.realpath(os.path.abspath(entry or os.curdir)) != _HERE]
try:
    from zero_bnb.cli.zero_to_fp32 import (  # noqa: F401 - DeepSpeed's script offers these
        convert_zero_checkpoint_to_fp32_state_dict,
        convert_zero_checkpoint_to_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
        main,
    )
finally:
    if __name__ != "__main__":
        sys.path[:] = _PATH  # imported: the caller's sys.path is theirs

if __name__ == "__main__":
    sys.exit(main())
'''


def write_recovery_script(save_dir: str) -> str | None:
    """Write ``zero_to_fp32.py`` into ``save_dir`` (a new file renamed into place, executable); returns its path.

    Replaces whatever was there (stock DeepSpeed's script, which cannot read zero_bnb checkpoints).
    Local: call on one rank (rank 0), as DeepSpeed does, after the checkpoint is committed. A
    failure is logged, not raised: the checkpoint itself is complete without the script.
    """
    path = os.path.join(save_dir, SCRIPT_NAME)
    try:
        with replacing(path) as temporary:
            write_text(_SCRIPT, temporary, root=os.path.dirname(temporary))
            os.chmod(temporary, os.stat(temporary).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError as error:
        logger.warning("zero_bnb: could not write %s (%r); the checkpoint is complete without it", path, error)
        return None
    return path
