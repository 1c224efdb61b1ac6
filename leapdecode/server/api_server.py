"""The OpenAI-compatible HTTP app: :func:`build_app` (``leapdecode serve`` runs it, see :mod:`.serve`).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (all three
non-streaming and SSE streaming), ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``, ``GET /version``, ``GET /health``, ``GET /metrics`` (Prometheus), ``POST /v1/embeddings``,
and llama-server's ``GET /props`` and ``GET /slots``. The model answers to its own name and to
``default``. All requests share one engine loop (see :mod:`leapdecode.server.async_engine`); the routes live in
:mod:`leapdecode.server.routes`, their shared plumbing in :mod:`leapdecode.server.serving`, the streaming
invariants in :mod:`leapdecode.server.streaming`. A 500 means a server bug.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute

import leapdecode
from leapdecode.engine.llm_engine import LLMEngine
from leapdecode.llm import LLM
from leapdecode.server import protocol as P
from leapdecode.server.async_engine import AsyncEngine
from leapdecode.server.chat_output import ChatOutputConfig
from leapdecode.server.defaults import DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES
from leapdecode.server.embeddings import POOLINGS, EmbeddingRequest, EmbeddingResponse, Pooling
from leapdecode.server.errors import install_error_handlers
from leapdecode.server.metrics import ServerMetrics
from leapdecode.server.middleware import ApiKeyAuth, RequestId, StatusCounter
from leapdecode.server.openapi import install_component_schemas
from leapdecode.server.props import PropsResponse, SlotsResponse
from leapdecode.server.responses import ResponseObject, ResponsesRequest, ResponseStreamEvent
from leapdecode.server.routes import admin, chat, completions, embeddings, props, responses, tokens
from leapdecode.server.serving import Serving, as_llm, default_model_name
from leapdecode.server.stats_log import StatsLogger

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without the API key (probes and scrapers)


# the request and response bodies /openapi.json declares as components, in the mode each is read in
COMPONENT_SCHEMAS = (
    [(m, "validation") for m in (P.ChatCompletionRequest, P.CompletionRequest, P.TokenizeRequest)]
    + [(P.DetokenizeRequest, "validation"), (EmbeddingRequest, "validation"), (ResponsesRequest, "validation")]
    + [(m, "serialization") for m in (P.ChatCompletionResponse, P.CompletionResponse, P.ModelList, P.TokenizeResponse)]
    + [(m, "serialization") for m in (P.DetokenizeResponse, P.TokenizerInfoResponse, P.VersionResponse)]
    + [(m, "serialization") for m in (EmbeddingResponse, ResponseObject, ResponseStreamEvent)]
    + [(m, "serialization") for m in (PropsResponse, SlotsResponse)]
    + [(P.ErrorResponse, "serialization")]
)


def check_app_args(embedding_pooling: str, api_key: str | None, max_request_bytes: int,
                   body_read_timeout_s: float | None, request_timeout_s: float | None) -> None:
    """build_app's settings that no type says is wrong, refused before anything starts."""
    if embedding_pooling not in POOLINGS:
        raise ValueError(f"embedding_pooling must be one of {', '.join(POOLINGS)}, got {embedding_pooling!r}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty (pass None for no key)")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    for name, value in (("body_read_timeout_s", body_read_timeout_s), ("request_timeout_s", request_timeout_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 (or None for no limit), got {value}")


def add_middleware(app: FastAPI, metrics: ServerMetrics, api_key: str | None,
                   allowed_origins: list[str] | None) -> None:
    """After the routes (the answer counter knows their paths). The last added runs first: count every answer,
    then CORS (a preflight carries no key), ids, the key."""
    endpoints = frozenset(r.path for r in app.routes if isinstance(r, APIRoute))
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key, open_paths=OPEN_PATHS)
    app.add_middleware(RequestId)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(StatusCounter, counter=metrics.requests, endpoints=endpoints)


def build_app(
    llm_or_engine: LLM | LLMEngine,
    model_name: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    chat_output: ChatOutputConfig | None = None,
    log_stats_interval: float | None = None,
    embedding_pooling: Pooling = "last",
    body_read_timeout_s: float | None = DEFAULT_BODY_READ_TIMEOUT_S,
    request_timeout_s: float | None = None,
    share_output: bool = True,
) -> FastAPI:
    """The FastAPI app serving ``llm_or_engine``. The engine thread starts and stops with the app's lifespan,
    so while the app runs, nothing else may call the engine. Request bodies over ``max_request_bytes`` get 413.

    ``api_key``: every path but ``/health`` and ``/metrics`` then requires ``Authorization: Bearer <api_key>``.
    ``allowed_origins``: the browser origins allowed by CORS (``["*"]`` for any); None answers no CORS headers.
    ``chat_output``: the tool-call and reasoning parsers of chat answers (default: chosen from the chat template).
    ``log_stats_interval``: log a line of engine stats every that many seconds while there is work (None: never).
    ``embedding_pooling``: how ``/v1/embeddings`` pools hidden states (``last`` token or ``mean``).
    ``body_read_timeout_s``: a body that takes longer to arrive gets 408. ``request_timeout_s``: a request still
    generating that long after the engine accepted it is stopped (its KV freed) and answered 408 (streamed: an
    error event); None: no limit. ``share_output``: the ``SamplingParams.share_output`` of requests that do not set
    it (False: their outputs never join what other requests draft from, the suffix method's global tree)."""
    check_app_args(embedding_pooling, api_key, max_request_bytes, body_read_timeout_s, request_timeout_s)
    llm = as_llm(llm_or_engine)
    name = model_name or default_model_name(llm.engine)
    metrics = ServerMetrics(name)
    aengine = AsyncEngine(llm.engine, max_queue=max_queue)
    metrics.attach(aengine)
    serving = Serving(
        llm, name, aengine, metrics, max_request_bytes, chat_output,
        body_timeout_s=body_read_timeout_s, request_timeout_s=request_timeout_s, share_output=share_output,
    )

    stats_logger = StatsLogger(aengine, log_stats_interval) if log_stats_interval is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        stats_task = asyncio.ensure_future(stats_logger.run()) if stats_logger is not None else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            aengine.stop()

    app = FastAPI(
        title="leapdecode",
        version=leapdecode.__version__,
        lifespan=lifespan,
        description="OpenAI-compatible server for leapdecode (lossless speculative decoding).",
    )
    app.state.async_engine = aengine
    app.state.model_name = serving.name
    app.state.metrics = metrics
    install_error_handlers(app)
    for module in (admin, chat, completions, tokens, props, responses):
        module.add_routes(app, serving)
    embeddings.add_routes(app, serving, embedding_pooling)
    add_middleware(app, metrics, api_key, allowed_origins)
    install_component_schemas(app, COMPONENT_SCHEMAS)
    return app
