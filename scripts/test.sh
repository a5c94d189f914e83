#!/usr/bin/env bash
# Set up (CPU) and run the full test suite: bash scripts/test.sh [pytest args]
# With the Python that scripts/setup.sh installed into (scripts/python.sh: on an externally managed system Python,
# the virtual environment .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo,hf,lightning
. scripts/python.sh
if [ "$#" -eq 0 ]; then
    # the whole suite (README, .ci/run): a run past this many seconds fails (tests/conftest.py). 840 s to 1246 s
    # measured on one 2-core box (quiet to busy, 2026-11-29; 1246 s with issue 45's Triton tests and check.sh's two
    # new dry-run steps, 1283 passed; the multi-rank dry run since trimmed by about 20 s): 1.2x the slowest;
    # issue 44 aims at 720.
    export ZERO_BNB_SUITE_BUDGET_S="${ZERO_BNB_SUITE_BUDGET_S:-1500}"
fi
exec "$PYTHON" -m pytest "$@"
