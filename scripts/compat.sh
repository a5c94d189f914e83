#!/usr/bin/env bash
# The compatibility matrix: one virtual environment per cell, a representative subset of the suite in each,
# and a checkpoint written in the oldest cell read in the newest and back. Writes the compatibility matrix into
# docs/support.md (between its compat:begin and compat:end marks).
#
#   bash scripts/compat.sh                          # every cell, then the checkpoint check (30+ min a cell on 2 cores)
#   bash scripts/compat.sh oldest                   # some cells
#   bash scripts/compat.sh --cross oldest defaults  # only the checkpoint check, both ways
#   COMPAT_ONLY=Trainer bash scripts/compat.sh oldest   # rerun only the matching checks of a cell
#   bash scripts/compat.sh --table                  # rewrite the table from the kept results
#
# Each venv (under $COMPAT_VENVS, default ~/.cache/zero_bnb/compat) sees the installed torch through
# --system-site-packages and pip is constrained to that torch, so no other torch and no CUDA bundle is pulled;
# DeepSpeed installs with DS_BUILD_OPS=0. zero_bnb itself is this source tree (PYTHONPATH). Each cell's results
# are kept in $COMPAT_VENVS/results (one file per cell, replaced when the cell runs again), and the table is
# written from all of them, so cells may run at different times or side by side. Not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENVS=${COMPAT_VENVS:-$HOME/.cache/zero_bnb/compat}
RESULTS=$VENVS/results
LOGS=$VENVS/logs
OUT=docs/support.md
PART=$VENVS/compatibility.part.md
export PIP_DISABLE_PIP_VERSION_CHECK=1 DS_BUILD_OPS=0 PYTHONPATH=$ROOT
TORCH=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
mkdir -p "$RESULTS" "$LOGS"

# cell -> pinned releases: the oldest of each range; the releases of a current CUDA image; the newest (= CI's defaults)
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
python_of() { echo "$VENVS/$1/bin/python"; }
# Each cell's DeepSpeed builds its JIT ops (the CPU shm comm op) in a folder of its own: torch's shared
# ~/.cache/torch_extensions would otherwise hold the last cell's build, which other DeepSpeed releases (and the
# user's own environment) then load or rebuild under each other.
in_cell() { local cell=$1; shift; TORCH_EXTENSIONS_DIR="$VENVS/$cell/torch_extensions" "$@"; }
known() { [ -n "${CELLS[$1]:-}" ] || { echo "compat: unknown cell '$1' (cells: ${ORDER[*]})" >&2; exit 2; }; }

build() {  # build (or reuse) the venv of cell $1 and record its versions
    local cell=$1 venv="$VENVS/$1"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$venv"
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q ${CELLS[$cell]} "torch==$TORCH" safetensors tqdm pytest hypothesis
    "$venv/bin/python" - > "$RESULTS/$cell.versions" <<'PY'
import importlib.metadata as m
print(", ".join(f"{p} {m.version(p)}" for p in ("torch", "deepspeed", "bitsandbytes", "transformers", "accelerate", "lightning")))
PY
}

run_check() {  # cell, label, pytest arguments: one line "label<TAB>result<TAB>seconds" in the cell's results
    local cell=$1 label=$2 args=$3 start log status seconds
    local -a argv
    start=$(date +%s)
    log="$LOGS/$cell.$(echo "$label" | tr -c 'a-zA-Z0-9' _).log"
    read -r -a argv <<< "${args%% -k *}"
    if [[ $args == *" -k "* ]]; then argv+=(-k "${args#* -k }"); fi
    if in_cell "$cell" timeout 2400 "$(python_of "$cell")" -m pytest -q -p no:cacheprovider "${argv[@]}" > "$log" 2>&1; then
        status=pass; else status=FAIL; fi
    status="$status ($(tail -n 1 "$log" | sed 's/=//g; s/^ *//; s/ *$//'))"
    seconds=$(( $(date +%s) - start ))
    printf '%s\t%s\t%s\n' "$label" "$status" "$seconds" >> "$RESULTS/$cell.tsv"
    echo "compat: $cell: $label: $status in $seconds s (log $log)"
}

cross() {  # writer cell, reader cell: the checkpoint format across versions
    local writer=$1 reader=$2 dir="$LOGS/ckpt_$1" start line status
    start=$(date +%s)
    if [ ! -d "$dir/ckpt" ]; then
        in_cell "$writer" "$(python_of "$writer")" scripts/compat_checkpoint.py write "$dir" > "$LOGS/write_$writer.log" 2>&1 || true
    fi
    rm -f "$dir/resumed_dp3.pt"
    line=$(in_cell "$reader" "$(python_of "$reader")" scripts/compat_checkpoint.py read "$dir" 2> "$LOGS/read_${writer}_$reader.log" | tail -n 1) || true
    [[ $line == "compat: ok"* ]] && status=pass || status=FAIL
    printf '%s\t%s\t%s\t%s\t%s\n' "$writer" "$reader" "$status" "$(( $(date +%s) - start ))" "${line#compat: }" \
        > "$RESULTS/cross_${writer}_$reader.tsv"
    echo "compat: checkpoint written by $writer, read by $reader: ${line:-no result (see $LOGS)}"
}

run_cell() {  # COMPAT_ONLY=REGEX reruns only the checks whose label matches, keeping the cell's other results
    local cell=$1 check label
    echo "compat: cell $cell: ${CELLS[$cell]}"
    build "$cell"
    if [ -n "${COMPAT_ONLY:-}" ] && [ -f "$RESULTS/$cell.tsv" ]; then
        awk -F'\t' -v only="$COMPAT_ONLY" '$1 !~ only' "$RESULTS/$cell.tsv" > "$RESULTS/$cell.tsv.kept"
        mv "$RESULTS/$cell.tsv.kept" "$RESULTS/$cell.tsv"
    else
        : > "$RESULTS/$cell.tsv"
    fi
    for check in "${CHECKS[@]}"; do
        label=${check%%|*}
        [[ -z ${COMPAT_ONLY:-} || $label =~ $COMPAT_ONLY ]] && run_check "$cell" "$label" "${check#*|}"
    done
    date -u +%Y-%m-%d > "$RESULTS/$cell.date"
}

render() {  # the table of every cell with results
    local cell label row header rule check found
    local -a cells=()
    for cell in "${ORDER[@]}"; do [ -s "$RESULTS/$cell.tsv" ] && cells+=("$cell"); done
    {
        echo "## Compatibility matrix"
        echo
        echo "Written by \`bash scripts/compat.sh\` ($(nproc) CPU cores shared with other jobs, Python"
        echo "$("$PYTHON" -c 'import platform; print(platform.python_version())'), CPU only, gloo). Each cell is a virtual environment with the releases"
        echo "below and the installed torch $TORCH, the only CPU wheel here: older torch releases are not run, and the declared"
        echo "floor \`torch>=2.6\` comes from the code (\`zero_bnb.versions.SUPPORTED\`). The declared ranges are in"
        echo "\`pyproject.toml\`; \`zero_bnb.initialize\` refuses releases known not to work and warns once for releases"
        echo "newer than the newest tested. The full suite runs on the defaults (\`scripts/defaults.txt\`) in CI."
        echo
        echo "### Cells"
        echo
        echo "| cell | versions | run on |"
        echo "|---|---|---|"
        for cell in "${cells[@]}"; do echo "| $cell | $(cat "$RESULTS/$cell.versions") | $(cat "$RESULTS/$cell.date" 2>/dev/null || echo "cut short") |"; done
        echo
        echo "### Checks: pytest selections of the suite, result and wall time"
        echo
        header="| check |"; rule="|---|"
        for cell in "${cells[@]}"; do header+=" $cell |"; rule+="---|"; done
        echo "$header"; echo "$rule"
        for check in "${CHECKS[@]}"; do
            label=${check%%|*}; row="| $label: \`${check#*|}\` |"
            for cell in "${cells[@]}"; do
                found=$(awk -F'\t' -v l="$label" '$1 == l {print $2 ", " $3 " s"}' "$RESULTS/$cell.tsv")
                row+=" ${found:-not run} |"
            done
            echo "$row"
        done
        echo
        cat <<'NOTES'
### What the matrix found (and what zero_bnb does about it)

* DeepSpeed 0.17.0 to 0.19.6 call `flatten_dense_tensors_aligned` without `param_padding`, 0.17.0 calls
  `_configure_checkpointing(dist_init_required)`, and `load_module_state_dict`'s arguments grew in 0.19: zero_bnb's
  overrides pass DeepSpeed's arguments through. `round_robin_bit16_padding` (0.19.7), `_uses_muon` (0.19.8) and
  stage 3's `use_muon` (0.18.9) are asked in `zero_bnb/ds/versions.py`. Lightning before 2.6 has no `weights_only`
  argument: passed through too.
* DeepSpeed before 0.19.7 loads a *universal* checkpoint's moments over the fp32 weights' fragment
  (`utils/tensor_fragment.py` `map_to_flat_opt_states`), whoever wrote it: stock DeepSpeed's load of
  `zero-bnb convert --to universal` output is a strict xfail there (`tests/test_convert.py`); zero_bnb's own loads
  and its conversion back from universal are unaffected. Load universal checkpoints with DeepSpeed >= 0.19.7.
* transformers 4.50 trains the README's Trainer example on CPU without `use_cpu=True` (transformers 5 refuses the
  batch); the test's variants without it now write into folders of their own (one overwrote the example's
  checkpoint, which zero_bnb's load then refused as overwritten).
* DeepSpeed 0.18.9 (the middle cell) fails in DeepSpeed's own step, in the all-gather of updated weights
  (`runtime/utils.py` `all_gather_into_tensor_dp_groups` -> gloo: "Output 0 of Split is a view and is being modified
  inplace"), on torch 2.13, in the elastic and Lightning checks alike. Stock DeepSpeed 0.18.9 with `torch.optim.AdamW`
  and no zero_bnb fails the same way at its first step (2 gloo processes, this venv): a DeepSpeed 0.18.9 x torch 2.13
  incompatibility, not zero_bnb's. Whether it hits older torch (a CUDA image's 2.11) could not be run here (no other
  CPU wheel), so the declared range still admits 0.18.x; 0.17.0 and 0.19.8 pass.
* Refused by `zero_bnb.initialize`: bitsandbytes < 0.50.0 (no CPU 8-bit update: the 8-bit step raises on CPU; and
  `get_config` reads an override registered after the first step only since 0.50.0), accelerate < 1.2.0 (replaces
  an offloaded optimizer by DeepSpeedCPUAdam inside `prepare`), torch < 2.5 (no `torch.serialization.safe_globals`).
NOTES
        if compgen -G "$RESULTS/cross_*.tsv" > /dev/null; then
            echo
            echo "### Checkpoints across cells"
            echo
            echo "Adam8bit trained at DP=2 and saved by \`scripts/compat_checkpoint.py write\` in one cell, loaded at DP=3 by"
            echo "\`scripts/compat_checkpoint.py read\` in another: fp32 masters and dequantized state bit for bit, step count, next loss."
            echo
            echo "| written by | read by | result | seconds | details |"
            echo "|---|---|---|---|---|"
            cat "$RESULTS"/cross_*.tsv | awk -F'\t' '{print "| " $1 " | " $2 " | " $3 " | " $4 " | " $5 " |"}'
        fi
    } > "$PART"
    "$PYTHON" - "$OUT" "$PART" <<'SPLICE'
import re, sys
page, part = sys.argv[1], open(sys.argv[2]).read()
text = open(page).read()
marks = re.compile(r"(<!-- compat:begin[^>]*-->\n).*?(<!-- compat:end -->)", re.S)
if not marks.search(text):
    sys.exit(f"compat: {page} has no compat:begin / compat:end marks")
open(page, "w").write(marks.sub(lambda m: m.group(1) + part + m.group(2), text))
SPLICE
    echo "compat: wrote the compatibility matrix into $OUT"
}

if [ "${1:-}" = --table ]; then
    :  # only rewrite the table from the kept results
elif [ "${1:-}" = --cross ]; then
    [ $# -eq 3 ] || { echo "usage: bash scripts/compat.sh --cross WRITER READER" >&2; exit 2; }
    known "$2"; known "$3"
    cross "$2" "$3"; cross "$3" "$2"
else
    selected=("$@")
    [ ${#selected[@]} -eq 0 ] && selected=("${ORDER[@]}")
    for cell in "${selected[@]}"; do known "$cell"; done
    for cell in "${selected[@]}"; do run_cell "$cell"; render; done
    if [ $# -eq 0 ]; then cross oldest defaults; cross defaults oldest; fi
fi
render
! grep -q FAIL "$PART"
