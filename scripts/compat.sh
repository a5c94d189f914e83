#!/usr/bin/env bash
# The compatibility matrix: one virtual environment per cell, a representative subset of the suite in each,
# and a checkpoint written in the oldest cell read in the newest and back. Writes docs/compatibility.md.
#
#   bash scripts/compat.sh              # every cell (about 15-20 minutes a cell on 2 CPU cores)
#   bash scripts/compat.sh oldest       # some cells (the table then lists only those)
#
# Each venv (under $COMPAT_VENVS, default ~/.cache/zero_bnb/compat) sees the installed torch through
# --system-site-packages and pip is constrained to that torch, so no other torch and no CUDA bundle is pulled;
# DeepSpeed installs with DS_BUILD_OPS=0. zero_bnb itself is this source tree (PYTHONPATH). Not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENVS=${COMPAT_VENVS:-$HOME/.cache/zero_bnb/compat}
OUT=docs/compatibility.md
export PIP_DISABLE_PIP_VERSION_CHECK=1 DS_BUILD_OPS=0 PYTHONPATH=$ROOT
TORCH=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')

# cell -> pinned releases (oldest of each range / the versions of a current CUDA image / the newest = defaults)
declare -A CELLS=(
    [oldest]="deepspeed==0.17.0 bitsandbytes==0.50.0 transformers==4.50.0 accelerate==1.2.0 lightning==2.4.0"
    [middle]="deepspeed==0.18.9 bitsandbytes==0.50.0 transformers==5.17.0 accelerate==1.12.0 lightning==2.5.6"
    [defaults]="$(grep -v '^#' scripts/defaults.txt | tr '\n' ' ')"
)
ORDER=(oldest middle defaults)
# The subset: elastic resume 2->3, both front doors' resume at 3, the CLI tools, the hostile launch, the version table.
CHECKS=(
    "elastic 2->3|tests/test_elastic.py::test_resume_at_another_dp_size_is_exact[3]"
    "Lightning resume 2->3|tests/test_front_doors_lightning.py -k resume_at_3_with_other_accumulation"
    "Trainer + Accelerate resume 2->3|tests/test_front_doors_hf.py -k trainer_saves_at_2_and_resumes_at_3_processes or accelerate_save_state_load_state_at_another_dp_size"
    "CLI tools (inspect, verify, convert, export)|tests/test_convert.py"
    "hostile launch and hostile files|tests/test_hostile.py -k not re_signed_manifest_mutation"
    "version table|tests/test_versions.py"
)
selected=("$@")
[ ${#selected[@]} -eq 0 ] && selected=("${ORDER[@]}")
for cell in "${selected[@]}"; do [ -n "${CELLS[$cell]:-}" ] || { echo "compat: unknown cell '$cell' (cells: ${ORDER[*]})" >&2; exit 2; }; done

LOGS=${COMPAT_LOGS:-$(mktemp -d)}; mkdir -p "$LOGS"
declare -A RESULT TIME VERSIONS
python_of() { echo "$VENVS/$1/bin/python"; }

build() {  # build (or reuse) the venv of cell $1
    local cell=$1 venv="$VENVS/$1"
    if [ ! -x "$venv/bin/python" ]; then
        "$PYTHON" -m venv --system-site-packages "$venv"
    fi
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q ${CELLS[$cell]} "torch==$TORCH" safetensors tqdm pytest hypothesis
}

run_check() {  # cell, label, pytest arguments: records pass/fail and seconds
    local cell=$1 label=$2 args=$3 start log status
    start=$(date +%s)
    log="$LOGS/$cell.$(echo "$label" | tr -c 'a-zA-Z0-9' _).log"
    local -a argv
    read -r -a argv <<< "${args%% -k *}"
    if [[ $args == *" -k "* ]]; then argv+=(-k "${args#* -k }"); fi
    if timeout 2400 "$(python_of "$cell")" -m pytest -q -p no:cacheprovider "${argv[@]}" > "$log" 2>&1; then status=pass; else status=FAIL; fi
    RESULT["$cell|$label"]="$status ($(tail -n 1 "$log" | sed 's/=//g; s/^ *//; s/ *$//'))"
    TIME["$cell|$label"]=$(( $(date +%s) - start ))
    echo "compat: $cell: $label: ${RESULT["$cell|$label"]} in ${TIME["$cell|$label"]} s (log $log)"
}

cross() {  # writer cell, reader cell: the checkpoint format across versions
    local writer=$1 reader=$2 dir="$LOGS/ckpt_$1" label="checkpoint written by $1, read at DP=3 by $2" start line
    start=$(date +%s)
    if [ ! -d "$dir/ckpt" ]; then "$(python_of "$writer")" scripts/compat_checkpoint.py write "$dir" > "$LOGS/write_$writer.log" 2>&1 || true; fi
    rm -f "$dir/resumed_dp3.pt"
    line=$("$(python_of "$reader")" scripts/compat_checkpoint.py read "$dir" 2>"$LOGS/read_${writer}_$reader.log" | tail -n 1) || true
    CROSS+=("| $writer | $reader | $([[ $line == "compat: ok"* ]] && echo pass || echo FAIL) | $(( $(date +%s) - start )) | ${line#compat: } |")
    echo "compat: $label: $line"
}

render() {  # the table of every cell run so far (rewritten after each cell: a cut-short run leaves a true table)
    local cell label row header rule check
    local -a done_cells=()
    for cell in "${ORDER[@]}"; do [ -n "${VERSIONS[$cell]:-}" ] && done_cells+=("$cell"); done
    {
        echo "# Compatibility matrix"
        echo
        echo "Written by \`bash scripts/compat.sh\` on $(date -u +%Y-%m-%d) ($(nproc) CPU cores, Python $("$PYTHON" -c 'import platform; print(platform.python_version())'), CPU only, gloo)."
        echo "Each cell is a virtual environment with the releases below and the installed torch $TORCH (the only CPU"
        echo "wheel here: older torch releases are not run; the declared floor \`torch>=2.6\` comes from the code, see"
        echo "\`zero_bnb.versions.SUPPORTED\`). The declared ranges are in \`pyproject.toml\`; \`zero_bnb.initialize\` refuses"
        echo "releases known not to work and warns once for releases newer than the newest tested."
        echo
        echo "## Cells"
        echo
        echo "| cell | versions |"
        echo "|---|---|"
        for cell in "${done_cells[@]}"; do echo "| $cell | ${VERSIONS[$cell]} |"; done
        echo
        echo "## Checks (pytest selections of the suite; result and wall time per cell)"
        echo
        header="| check |"; rule="|---|"
        for cell in "${done_cells[@]}"; do header+=" $cell |"; rule+="---|"; done
        echo "$header"; echo "$rule"
        for check in "${CHECKS[@]}"; do
            label=${check%%|*}; row="| $label (\`${check#*|}\`) |"
            for cell in "${done_cells[@]}"; do row+=" ${RESULT["$cell|$label"]}, ${TIME["$cell|$label"]} s |"; done
            echo "$row"
        done
        if [ ${#CROSS[@]} -gt 0 ]; then
            echo
            echo "## Checkpoints across cells"
            echo
            echo "Adam8bit trained at DP=2 and saved by \`scripts/compat_checkpoint.py write\` in one cell, loaded at DP=3 by"
            echo "\`scripts/compat_checkpoint.py read\` in another: fp32 masters and dequantized state bit for bit, step count, next loss."
            echo
            echo "| written by | read by | result | seconds | details |"
            echo "|---|---|---|---|---|"
            printf '%s\n' "${CROSS[@]}"
        fi
    } > "$OUT"
}

CROSS=()
# Run order: oldest and defaults first, so the checkpoint check between them runs early; the table keeps ORDER.
mapfile -t run_order < <(printf '%s\n' "${selected[@]}" | sort -u | awk '{print ($1=="oldest"?0:$1=="defaults"?1:2), $1}' | sort -n | cut -d' ' -f2)
for cell in "${run_order[@]}"; do
    echo "compat: building cell $cell: ${CELLS[$cell]}"
    build "$cell"
    VERSIONS[$cell]=$("$(python_of "$cell")" - <<'PY'
import importlib.metadata as m
print(", ".join(f"{p} {m.version(p)}" for p in ("torch", "deepspeed", "bitsandbytes", "transformers", "accelerate", "lightning")))
PY
)
    for check in "${CHECKS[@]}"; do run_check "$cell" "${check%%|*}" "${check#*|}"; done
    if [ "$cell" = defaults ] && [ -n "${VERSIONS[oldest]:-}" ]; then cross oldest defaults; cross defaults oldest; fi
    render
done

render
echo "compat: wrote $OUT (logs in $LOGS)"
! grep -q FAIL "$OUT"
