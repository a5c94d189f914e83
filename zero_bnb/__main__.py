"""``python -m zero_bnb``: the command line (see :mod:`zero_bnb.cli`)."""

import sys

from zero_bnb.cli import main

sys.exit(main())
