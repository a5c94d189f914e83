# Sourced (from the repository root) by scripts/setup.sh, test.sh and demo.sh: sets PYTHON, the interpreter they
# install into and run with.
#
# That is $PYTHON (default python3): the current environment, an activated virtual environment included. Except a
# system Python that its distribution manages (PEP 668: Debian 12, Ubuntu 24.04, Fedora 38 and later put an
# EXTERNALLY-MANAGED file in its standard library, and pip refuses to install into it): then PYTHON is the virtual
# environment .venv of the repository root (git-ignored), which setup.sh makes from that Python with
# --system-site-packages (an installed torch is reused, the CUDA bundle never pulled) or reuses, and
# ZERO_BNB_MANAGED_PYTHON names the managed Python (empty otherwise).
ZERO_BNB_MANAGED_PYTHON=
PYTHON=${PYTHON:-python3}
# pip's own test: the marker in sysconfig's stdlib directory, outside a virtual environment
if "$PYTHON" -c 'import os, sys, sysconfig
in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix) or hasattr(sys, "real_prefix")
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(1 if in_venv or not os.path.isfile(marker) else 0)' 2>/dev/null; then
    ZERO_BNB_MANAGED_PYTHON=$(command -v "$PYTHON")
    PYTHON=$PWD/.venv/bin/python
fi
