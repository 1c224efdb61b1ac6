"""Routes around generation: ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /v1/models``, ``GET /version``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import leapdecode
from leapdecode.server import protocol as P
from leapdecode.server.openapi import route
from leapdecode.server.serving import Serving


def add_routes(app: FastAPI, serving: Serving) -> None:
    @route(app, "GET", "/health")
    async def health() -> Response:
        # 503 with the reason while the engine cannot serve (so an orchestrator restarts it), 200 otherwise
        reason = serving.aengine.unhealthy()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @route(app, "GET", "/metrics", text_media_type="text/plain")
    async def prometheus_metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @route(app, "GET", "/v1/models", response_model=P.ModelList)
    async def models() -> dict[str, Any]:
        engine = serving.engine
        card = P.ModelCard(
            id=serving.name,
            created=serving.created,
            root=serving.name,  # never the model's file-system path
            max_model_len=engine.max_model_len,
        )
        return P.ModelList(data=[card]).model_dump()

    @route(app, "GET", "/version", response_model=P.VersionResponse)
    async def version() -> dict[str, Any]:
        return P.VersionResponse(version=leapdecode.__version__).model_dump()
