#!/usr/bin/env bash
# Make the wheels benchmarks/gpu/check.sh installs on a GPU machine without network (Python 3.12, x86-64 Linux):
#
#   bash benchmarks/gpu/wheels.sh [FOLDER]     # default .gpu/wheels (git-ignored); then, on the GPU machine:
#   ZERO_BNB_WHEELS=FOLDER bash benchmarks/gpu/check.sh OUTDIR
#
# deepspeed is built here with DS_BUILD_OPS=0 (pure Python; its ops JIT-build there), the others are downloaded as
# binary wheels for CPython 3.12 / manylinux x86-64 at the versions of scripts/defaults.txt; zero_bnb is this checkout.
# bitsandbytes' wheel is repacked with only its CPU and CUDA 13.0 libraries (43 MB -> about 8 MB), so the whole folder
# travels in the device tool's 64 MiB. Needs torch installed here (scripts/setup.sh) and the package index.
set -euo pipefail
cd "$(dirname "$0")/../.."
FOLDER=${1:-.gpu/wheels}
PYTHON=${PYTHON:-python3}
CUDA_LIB=${ZERO_BNB_BNB_CUDA:-cuda130}
mkdir -p "$FOLDER"
pin() { sed -n "s/^$1==\(.*\)/\1/p" scripts/defaults.txt; }
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$(pin deepspeed)" -w "$FOLDER"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation . -w "$FOLDER"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$FOLDER" \
    "bitsandbytes==$(pin bitsandbytes)" pydantic pydantic-core annotated-types typing-inspection hjson typing-extensions \
    "blake3>=1.0,<2"
"$PYTHON" - "$FOLDER" "$CUDA_LIB" <<'PY'
import glob, os, sys, zipfile
folder, keep = sys.argv[1], sys.argv[2]
for path in glob.glob(os.path.join(folder, "bitsandbytes-*.whl")):
    scratch = path + ".tmp"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(scratch, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            name = os.path.basename(item.filename)
            if name.startswith("libbitsandbytes_") and not name.startswith(("libbitsandbytes_cpu.", f"libbitsandbytes_{keep}.")):
                continue
            target.writestr(item, source.read(item))
    os.replace(scratch, path)
PY
ls -l "$FOLDER"
du -sh "$FOLDER"
