#!/usr/bin/env bash
# Install zero_bnb and its dependencies, CPU-only: bash scripts/setup.sh [extras, default test,demo]
# Into the current Python environment, $PYTHON (default python3), an activated virtual environment included; where
# that is a system Python that its distribution manages (PEP 668: Debian 12, Ubuntu 24.04; pip refuses to install
# into it), into the virtual environment .venv of the repository root instead, made here (scripts/python.sh).
# Reuses an installed torch; otherwise installs the CPU build torch==2.13.0 (never the CUDA bundle).
# Idempotent: a second run only re-checks (scripts/installed.py, from the installed packages' metadata).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh
export PIP_DISABLE_PIP_VERSION_CHECK=1 DS_BUILD_OPS=0

if [ -n "$ZERO_BNB_MANAGED_PYTHON" ]; then
    managed="setup: $ZERO_BNB_MANAGED_PYTHON is externally managed (PEP 668: pip installs nothing into it)"
    if "$PYTHON" -c '' 2>/dev/null; then
        echo "$managed: using the virtual environment .venv"
    else
        # --system-site-packages: the venv sees the system's packages, an installed torch among them
        echo "$managed: making the virtual environment .venv (--system-site-packages)"
        if ! made=$("$ZERO_BNB_MANAGED_PYTHON" -m venv --clear --system-site-packages .venv 2>&1); then
            # Debian and Ubuntu ship venv's pip installer (ensurepip) apart, in python3-venv; without it, a venv
            # without a pip of its own runs the system's pip (python3-pip), which installs into the venv
            if "$ZERO_BNB_MANAGED_PYTHON" -m pip --version >/dev/null 2>&1; then
                echo "setup: this Python has no ensurepip (Debian's python3-venv): .venv runs the system's pip"
                "$ZERO_BNB_MANAGED_PYTHON" -m venv --clear --system-site-packages --without-pip .venv
            else
                rm -rf .venv  # half made (venv sees the system's packages only once its pip is in)
                echo "$made" >&2
                echo "setup: error: cannot make .venv, and this Python has no pip: install python3-venv" \
                     "(Debian, Ubuntu: sudo apt install python3-venv) or run inside a virtual environment" >&2
                exit 1
            fi
        fi
    fi
fi
echo "setup: Python environment $("$PYTHON" -c 'import sys; print(sys.prefix)')"

# torch's version, or nothing where none is installed (from its metadata: importing torch takes seconds)
torch_version() {
    "$PYTHON" -c 'import importlib.metadata as m, importlib.util as u, sys
if u.find_spec("torch") is None:
    sys.exit(1)
try:
    print(m.version("torch"))
except m.PackageNotFoundError:
    import torch
    print(torch.__version__)' 2>/dev/null
}
if torch=$(torch_version); then
    echo "setup: using installed torch $torch"
else
    echo "setup: installing the CPU build of torch 2.13.0"
    "$PYTHON" -m pip install -q "torch==2.13.0"
    if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)"; then :; else
        echo "setup: warning: the torch that was installed is a CUDA build" >&2
    fi
    torch=$(torch_version)
fi

extras="${1:-test,demo}"
if ! missing=$("$PYTHON" scripts/installed.py "$extras"); then
    echo "setup: $missing"
    echo "setup: installing zero_bnb[$extras] (DS_BUILD_OPS=0: no DeepSpeed ops are compiled)"
    # torch is pinned to the installed (or CPU) build so no extra pulls another torch or the CUDA bundle;
    # the other dependencies to the tested defaults (scripts/defaults.txt) inside the declared ranges.
    "$PYTHON" -m pip install -q -e ".[$extras]" -c scripts/defaults.txt "torch==${torch%%+*}"
fi
"$PYTHON" - <<'PY'
import importlib.metadata as m
def _installed(name):
    try:
        return bool(m.version(name))
    except m.PackageNotFoundError:
        return False
print("setup: " + ", ".join(f"{p} {m.version(p)}" for p in ("zero_bnb", "torch", "deepspeed", "bitsandbytes", "transformers", "accelerate", "lightning")
                        if _installed(p)))
PY
