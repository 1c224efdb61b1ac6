#!/bin/sh
# Ask a running leapdecode server what a new user would, through curl: one chat completion, one Responses API
# answer, and /props, which must say the C++ kernels built (no silent torch fallback). Exits non-zero, naming the
# step, when one fails. scripts/wheel_check.sh runs it against the server of a freshly installed wheel;
# tests/test_wheel_check.py against a test server. Usage: scripts/serve_check.sh URL
set -eu
URL=${1:?usage: scripts/serve_check.sh URL}
fail() { echo "FAILED: $*"; exit 1; }

CHAT=$(curl -sf "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{"model": "default",
  "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0}') \
  || fail "POST /v1/chat/completions"
echo "$CHAT"
echo "$CHAT" | grep -q '"finish_reason"' || fail "no choice in the chat answer"
RESP=$(curl -sf "$URL/v1/responses" -H 'Content-Type: application/json' \
  -d '{"model": "default", "input": "Name three colours.", "max_output_tokens": 24, "temperature": 0}') \
  || fail "POST /v1/responses"
echo "$RESP" | grep -q '"output_text"' || fail "no output_text in the response: $RESP"
PROPS=$(curl -sf "$URL/props") || fail "GET /props"
echo "$PROPS" | grep -o '"kernel_plan":{[^}]*}' || true
echo "$PROPS" | grep -q '"kernels_built":true' || fail "the C++ kernels did not build"
echo "serve check passed"
