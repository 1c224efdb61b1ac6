"""ASGI middleware of the server: per-endpoint status counting for ``/metrics``."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


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
