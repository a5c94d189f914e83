#!/usr/bin/env bash
# Set up (CPU) and run the full test suite: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo,hf,lightning
exec "${PYTHON:-python3}" -m pytest "$@"
