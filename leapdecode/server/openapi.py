"""The request and response bodies of every operation, declared in ``/openapi.json``.

The completion handlers read their bodies by hand (the size limit is checked before anything is parsed, and bad
JSON gets an OpenAI-style error rather than FastAPI's), so FastAPI cannot infer the bodies from their
signatures. Each route therefore passes :func:`operation_doc` as its ``openapi_extra``, and
:func:`install_component_schemas` puts the pydantic models' JSON schemas under ``components/schemas`` where those
references point. The schemas come from the same models the handlers validate with, so the document cannot drift
from what the server accepts: client generators and schema-driven fuzzers see OpenAI's field names and types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from leapdecode.server.protocol import ErrorResponse

REF = "#/components/schemas/{model}"
JsonMode = Literal["validation", "serialization"]

# every error answer has the same body; the reasons are what a client can act on
ERROR_REASONS = {
    400: "invalid request (bad JSON, a wrong type or range, an unsupported field, a prompt that cannot fit)",
    404: "unknown model or path",
    408: "the request body arrived too slowly, or generation ran past the server's --request-timeout",
    413: "request body over the server's limit",
    500: "server bug",
    503: "queue full or engine stopped: retry after the Retry-After header's seconds",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def operation_doc(
    request: type[BaseModel] | None,
    response: type[BaseModel] | None,
    error: type[BaseModel],
    errors: Iterable[int],
    streams: bool | type[BaseModel] = False,
    text_media_type: str | None = None,
) -> dict[str, Any]:
    """The ``openapi_extra`` of one operation: its JSON request body (``request``), its 200 answer (``response``,
    or with ``streams`` also ``text/event-stream``, each event's data a ``response`` chunk, or the model ``streams``
    names where the events are not chunks of the answer; ``text_media_type`` when it answers text instead) and the
    ``error`` bodies of the ``errors`` statuses."""
    doc: dict[str, Any] = {"responses": {}}
    if text_media_type is not None:
        text = {text_media_type: {"schema": {"type": "string"}}}
        doc["responses"]["200"] = {"description": "success", "content": text}
    if request is not None:
        doc["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    if response is not None:
        content: dict[str, Any] = {"application/json": {"schema": _ref(response)}}
        if streams:
            # server-sent events; before OpenAPI 3.2's itemSchema, `schema` describes one event: its "data" holds
            # one chunk (the response model) as JSON, and the last event's is "[DONE]"
            event = {
                "type": "object",
                "required": ["data"],
                "properties": {
                    "data": {"type": "string", "contentMediaType": "application/json",
                             "contentSchema": _ref(response if streams is True else streams)}
                },
            }
            content["text/event-stream"] = {"schema": event}
        doc["responses"]["200"] = {"description": "success", "content": content}
    for status in errors:
        doc["responses"][str(status)] = {
            "description": ERROR_REASONS[status],
            "content": {"application/json": {"schema": _ref(error)}},
        }
    return doc


def component_schemas(
    models: Iterable[tuple[type[BaseModel], JsonMode]],
) -> dict[str, Any]:
    """JSON schemas of ``models`` (and of the models they contain), named by class, for ``components/schemas``."""
    _, top = models_json_schema(list(models), ref_template=REF)
    return dict(top.get("$defs", {}))


def install_component_schemas(app: FastAPI, models: Iterable[tuple[type[BaseModel], JsonMode]]) -> None:
    """Make ``app.openapi()`` include the schemas of ``models`` (built once, on first request of the document)."""
    wanted = list(models)
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not cache:
            doc = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(component_schemas(wanted))
            cache.update(doc)
        return cache

    app.openapi = openapi  # type: ignore[method-assign]



def route(
    app: FastAPI,
    method: str,
    path: str,
    request_model: type[BaseModel] | None = None,
    response_model: type[BaseModel] | None = None,
    errors: Iterable[int] = (),
    streams: bool | type[BaseModel] = False,
    text_media_type: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that registers a handler on ``app`` with its bodies declared for ``/openapi.json`` (the handler
    parses its own body, so FastAPI cannot infer it); every error status answers :class:`ErrorResponse`."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        doc = operation_doc(request_model, response_model, ErrorResponse, errors, streams, text_media_type)
        app.add_api_route(path, fn, methods=[method], response_model=None, openapi_extra=doc)
        return fn

    return register
