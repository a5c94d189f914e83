#!/usr/bin/env bash
# Set up (CPU) and run the elastic-resume demo: train at DP=2, checkpoint, resume at DP=3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo
exec "${PYTHON:-python3}" -m zero_bnb demo "$@"
