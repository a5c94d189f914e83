#!/usr/bin/env bash
# Set up (CPU) and run the elastic-resume demo: train at DP=2, checkpoint, resume at DP=3.
# With the Python that scripts/setup.sh installed into (scripts/python.sh: on an externally managed system Python,
# the virtual environment .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo
. scripts/python.sh
exec "$PYTHON" -m zero_bnb demo "$@"
