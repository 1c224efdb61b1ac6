"""ASGI middleware of the server: per-endpoint status counting for ``/metrics``, the API key, request ids."""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from collections.abc import Collection
from typing import Any

from starlette.responses import JSONResponse

from leapdecode.server.protocol import APIError
from leapdecode.server.request_ids import request_id

logger = logging.getLogger("leapdecode.server.access")

_SANE_ID = re.compile(r"[\x21-\x7e]{1,128}")


class StatusCounter:
    """Counts every HTTP answer by endpoint and status code (paths outside ``endpoints`` count as ``other``, so
    a scanner cannot grow the label set)."""

    def __init__(self, app: Any, counter: Any, endpoints: Collection[str]) -> None:
        self.app = app
        self.counter = counter
        self.endpoints = endpoints

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        status: dict[str, int] = {}

        async def send_counting(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            self.counter.labels(endpoint=endpoint, status=str(status.get("code", 500))).inc()


class ApiKeyAuth:
    """Requires ``Authorization: Bearer <api_key>`` on every path but ``open_paths`` (and CORS preflights, which
    browsers send without credentials); anything else gets 401 with OpenAI's error body."""

    def __init__(self, app: Any, api_key: str, open_paths: Collection[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope.get("path", "") in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        err = APIError(
            "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
            status=401,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)


class RequestId:
    """Gives every request an id: the client's ``X-Request-Id`` when it is a sane token (printable ASCII, at most
    128 characters), else a fresh one. The answer echoes it, the server's log records of the request carry it
    (see :mod:`leapdecode.server.request_ids`), and one access line per request names it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _SANE_ID.fullmatch(given) else uuid.uuid4().hex
        token = request_id.set(rid)
        start = time.perf_counter()
        status: dict[str, int] = {}

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            logger.info(
                "%s %s %s -> %s in %.3f s",
                rid,
                scope.get("method", ""),
                scope.get("path", ""),
                status.get("code", 500),
                time.perf_counter() - start,
            )
            request_id.reset(token)
