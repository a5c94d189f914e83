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
# The modules each extra brings, for the already-installed check (a second run only re-checks).
modules="zero_bnb, deepspeed, bitsandbytes, safetensors, tqdm"
case ",$extras," in *,test,*) modules="$modules, pytest, hypothesis";; esac
case ",$extras," in *,demo,*) modules="$modules, matplotlib";; esac
case ",$extras," in *,hf,*) modules="$modules, transformers, accelerate";; esac
case ",$extras," in *,lightning,*) modules="$modules, lightning";; esac
if ! "$PYTHON" -c "import $modules" 2>/dev/null \
   || [ "$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("zero_bnb"))' 2>/dev/null)" != "$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)" ]; then
    echo "setup: installing zero_bnb[$extras] (DS_BUILD_OPS=0: no DeepSpeed ops are compiled)"
    # torch is pinned to the installed (or CPU) build so no extra pulls another torch or the CUDA bundle;
    # the other dependencies to the tested defaults (scripts/defaults.txt) inside the declared ranges.
    "$PYTHON" -m pip install -q -e ".[$extras]" -c scripts/defaults.txt \
        "torch==$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
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
