"""``import zero_bnb.lightning``: register zero_bnb's DeepSpeed strategies with Lightning (the front door).

The strategy lives in :mod:`zero_bnb.integrations.lightning`; importing this module imports
it, which registers ``"deepspeed_zero_bnb_stage_1"``, ``"deepspeed_zero_bnb_stage_2"`` and
``"deepspeed_zero_bnb_stage_3"`` (and their ``_offload`` variants).
"""

from __future__ import annotations

from zero_bnb.integrations.lightning import *  # noqa: F403 - the front door re-exports the integration
from zero_bnb.integrations.lightning import __all__  # noqa: F401
