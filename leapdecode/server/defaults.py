"""Limits the app factory and the ``serve`` command share (a light module: ``leapdecode --help`` imports it)."""

from __future__ import annotations

# requests allowed to wait for their first token before new ones get 503 + Retry-After
DEFAULT_MAX_QUEUE = 256
# far above any prompt the context can hold (1 token is ~4 bytes of text), far below what hurts memory
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# a request body must arrive within this many seconds (slow uploads cannot each hold a connection and a buffer)
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
# open connections + running requests uvicorn allows before answering 503 (each streaming client holds one)
DEFAULT_LIMIT_CONCURRENCY = 1024
