"""llama-server's state endpoints: ``GET /props`` (the server's properties) and ``GET /slots`` (every sequence in
the engine), built by :mod:`leapdecode.server.props`."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import FastAPI

from leapdecode.server.openapi import route
from leapdecode.server.props import PropsResponse, SlotsResponse, props
from leapdecode.server.serving import Serving


def add_routes(app: FastAPI, serving: Serving) -> None:
    @route(app, "GET", "/props", response_model=PropsResponse)
    async def server_props() -> dict[str, Any]:
        memory = serving.aengine.gauges.drafter_memory
        return props(serving.engine, serving.name, serving.share_output, memory).model_dump()

    @route(app, "GET", "/slots", response_model=SlotsResponse)
    async def slots() -> dict[str, Any]:
        return SlotsResponse(data=[asdict(s) for s in serving.aengine.gauges.slots]).model_dump()
