#!/usr/bin/env bash
# Set up (CPU) and run the full test suite: bash scripts/test.sh [pytest args]
# With the Python that scripts/setup.sh installed into (scripts/python.sh: on an externally managed system Python,
# the virtual environment .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo,hf,lightning
. scripts/python.sh
exec "$PYTHON" -m pytest "$@"
