#!/bin/sh
# The user's path, end to end: build leapdecode's wheel, install it into a fresh virtual environment, serve a GGUF
# file with it (the CPU kernels built cold, in a build folder of their own) and ask one chat completion through the
# OpenAI API. Prints each step's time. Usage: scripts/wheel_check.sh MODEL.gguf [WORK_DIR]
set -eu
MODEL=${1:?usage: scripts/wheel_check.sh MODEL.gguf [WORK_DIR]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${2:-$(mktemp -d)}
PY=${PYTHON:-python3}
mkdir -p "$WORK"
LOG="$WORK/serve.log"

now() { date +%s.%N; }
took() { echo "   ($(echo "$(now) - $1" | bc | xargs printf '%.1f') s)"; }

echo "== 1. build the wheel"
t=$(now)
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$ROOT"
ls "$WORK/dist"
took "$t"

echo "== 2. a fresh venv, pip install the wheel (its dependencies from pip's configured indexes; TORCH_INDEX, e.g."
echo "   https://download.pytorch.org/whl/cpu, picks torch's build)"
t=$(now)
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q torch ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
"$WORK/venv/bin/pip" install -q "$WORK"/dist/leapdecode-*.whl
"$WORK/venv/bin/leapdecode" --help >/dev/null
took "$t"

echo "== 3. leapdecode serve $MODEL (kernels built on first use, cold)"
t=$(now)
TORCH_EXTENSIONS_DIR="$WORK/torch_extensions" LEAPDECODE_CACHE="$WORK/cache" \
  "$WORK/venv/bin/leapdecode" serve "$MODEL" --port 0 --disable-log-stats >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
URL=""
while [ -z "$URL" ]; do
  kill -0 $PID 2>/dev/null || { cat "$LOG"; echo "the server exited"; exit 1; }
  URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$LOG" | head -1 || true)
  sleep 0.5
done
grep -v "^INFO:" "$LOG" | head -5
echo "   serving at $URL"
took "$t"

echo "== 4. one chat completion (curl)"
t=$(now)
curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "default", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0}'
echo
took "$t"
