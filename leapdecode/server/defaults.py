"""Limits the app factory and the ``serve`` command share (a light module: ``leapdecode --help`` imports it)."""

from __future__ import annotations

# requests allowed to wait for their first token before new ones get 503 + Retry-After
DEFAULT_MAX_QUEUE = 256
# far above any prompt the context can hold (1 token is ~4 bytes of text), far below what hurts memory
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
