#!/usr/bin/env bash
# Install zero_bnb and its dependencies into the current Python environment, CPU-only.
# Reuses an installed torch; otherwise installs the CPU build torch==2.13.0 (never the CUDA bundle).
# Idempotent: a second run only re-checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 DS_BUILD_OPS=0

if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "setup: using installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
else
    echo "setup: installing the CPU build of torch 2.13.0"
    "$PYTHON" -m pip install -q "torch==2.13.0"
    if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)"; then :; else
        echo "setup: warning: the torch that was installed is a CUDA build" >&2
    fi
fi

extras="${1:-test,demo}"
if ! "$PYTHON" -c "import zero_bnb, deepspeed, bitsandbytes, safetensors, tqdm, pytest, hypothesis, matplotlib" 2>/dev/null \
   || [ "$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("zero_bnb"))' 2>/dev/null)" != "$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)" ]; then
    echo "setup: installing zero_bnb[$extras] (DS_BUILD_OPS=0: no DeepSpeed ops are compiled)"
    "$PYTHON" -m pip install -q -e ".[$extras]"
fi
"$PYTHON" - <<'PY'
import importlib.metadata as m
print("setup: " + ", ".join(f"{p} {m.version(p)}" for p in ("zero_bnb", "torch", "deepspeed", "bitsandbytes")))
PY
