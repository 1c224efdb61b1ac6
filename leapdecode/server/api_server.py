"""OpenAI-compatible HTTP server: ``leapdecode serve`` and :func:`build_app`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both non-streaming and SSE streaming),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). The model answers to its own name and to
``default``. All requests share one engine loop (see :mod:`leapdecode.server.async_engine`).

Invariants
----------
* Bad input never reaches the engine loop as an exception and never yields a 5xx: it gets a 4xx and
  an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``; a full queue answers 503 with
  ``Retry-After``. A 500 means a server bug. A body over ``max_request_bytes`` gets a 413 before it is parsed.
* The event loop never tokenizes: tokenization (about a second per 2 MB of prompt) runs in a worker thread,
  so a long prompt does not stall the other streams.
* A client that goes away is aborted at once (streaming or not); the engine thread frees its KV blocks.
* Streamed deltas concatenate to exactly the non-streamed text: a delta never ends in an incomplete UTF-8
  character (``'\\ufffd'``) and, while stop strings are active, the last ``len(longest stop) - 1`` characters
  are held back so a stop string is never partially sent.

Heavy imports (FastAPI, uvicorn, prometheus-client) happen inside the functions so that ``leapdecode --help``
and the other sub-commands stay fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI, Request

    from leapdecode.engine.llm_engine import LLMEngine
    from leapdecode.llm import LLM
    from leapdecode.sampling_params import SamplingParams
    from leapdecode.server.async_engine import AsyncEngine, RequestStream, StreamOutput
    from leapdecode.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("leapdecode.server")

DEFAULT_MAX_QUEUE = 256
# far above any prompt the context can hold (1 token is ~4 bytes of text), far below what hurts memory
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
MODEL_ALIAS = "default"
RETRY_AFTER_S = 1
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
COMPLETION_ERRORS = (400, 404, 413, 500, 503)  # documented in /openapi.json
_PARAM_RE = re.compile(r"SamplingParams\.(\w+)")


# ------------------------------------------------------------------------------------------------ helpers


def default_model_name(engine: LLMEngine) -> str:
    """The served name: the model folder's name (or the ``.gguf`` file's stem)."""
    path = getattr(engine, "model_path", None)
    if not path:
        return "leapdecode"
    p = Path(str(path))
    return p.stem if p.suffix == ".gguf" else p.name


def _as_llm(llm_or_engine: LLM | LLMEngine) -> LLM:
    """An ``LLM`` facade for tokenization (``apply_chat_template`` / ``_tokenize`` only use ``.engine``)."""
    from leapdecode.llm import LLM

    if isinstance(llm_or_engine, LLM):
        return llm_or_engine
    llm = object.__new__(LLM)
    llm.engine = llm_or_engine
    return llm


class TextDeltas:
    """Turns cumulative texts into deltas.

    Invariant: the deltas returned so far are ``self.sent``, a prefix of the latest text; before the final
    update that prefix never ends in ``'\\ufffd'`` and never covers the last ``hold``
    characters (a stop string could still be completing there and would then be cut from the final text)."""

    def __init__(self, stop_list: list[str]) -> None:
        self.sent = ""
        self.hold = max((len(s) for s in stop_list), default=1) - 1

    def update(self, text: str, finished: bool) -> str:
        upto = len(text) if finished else len(text) - self.hold
        if not finished:
            while upto > 0 and text[upto - 1] == "\ufffd":
                upto -= 1
        if upto <= len(self.sent):
            return ""
        delta = text[len(self.sent) : upto]
        self.sent = text[:upto]
        return delta


@functools.cache
def _aborting_streaming_response() -> type:
    """The ``StreamingResponse`` subclass used for SSE (built lazily: starlette is imported on first use)."""
    from starlette.responses import StreamingResponse

    class AbortingStreamingResponse(StreamingResponse):
        """A ``StreamingResponse`` that always watches for the client going away and then calls ``on_close``.

        Starlette only watches for ``http.disconnect`` under ASGI spec < 2.4; this class also runs
        ``on_close`` (an idempotent abort) when the stream ends for any reason, so no abandoned request keeps
        generating."""

        def __init__(
            self, body: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]
        ) -> None:
            super().__init__(body, media_type="text/event-stream", headers=headers)
            self.on_close = on_close

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def watch() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self.on_close()
                        return

            watcher = asyncio.ensure_future(watch())
            try:
                await super().__call__(scope, receive, send)
            finally:
                watcher.cancel()
                self.on_close()
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()

    return AbortingStreamingResponse


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run ``work``; if the client disconnects first, cancel it. Returns ``(finished, result)``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    return False, None


def _not_unicode(texts: list[str]) -> str | None:
    """Why ``texts`` cannot be tokenized, if one holds a lone surrogate (JSON's ``"\\ud800"`` escapes decode to
    one, and the tokenizer then fails with a message about its own input types); None when all are valid."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"the text is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}"
    return None


def _sse(payload: dict[str, Any]) -> str:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


# --------------------------------------------------------------------------------------------------- app


class _StatusCounter:
    """ASGI middleware: counts every HTTP answer by endpoint and status code."""

    def __init__(self, app: Any, counter: Any) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        status: dict[str, int] = {}

        async def send_counting(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            self.counter.labels(endpoint=endpoint, status=str(status.get("code", 500))).inc()


def build_app(
    llm_or_engine: LLM | LLMEngine,
    model_name: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app serving ``llm_or_engine``. The engine thread starts and stops with the app's lifespan,
    so while the app runs, nothing else may call the engine. Request bodies over ``max_request_bytes`` get 413."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    import leapdecode
    from leapdecode.engine.llm_engine import KVCapacityError
    from leapdecode.server import protocol as P
    from leapdecode.server.async_engine import (
        AsyncEngine,
        EngineDeadError,
        EngineStepError,
        QueueFullError,
        RequestAbortedError,
    )
    from leapdecode.server.metrics import ServerMetrics
    from leapdecode.server.openapi import install_component_schemas, operation_doc

    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    llm = _as_llm(llm_or_engine)
    engine = llm.engine
    name = model_name or default_model_name(engine)
    created = P.now_s()
    metrics = ServerMetrics()
    aengine: AsyncEngine = AsyncEngine(engine, max_queue=max_queue)
    metrics.attach(aengine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        try:
            yield
        finally:
            aengine.stop()

    app = FastAPI(
        title="leapdecode",
        version=leapdecode.__version__,
        lifespan=lifespan,
        description="OpenAI-compatible server for leapdecode (lossless speculative decoding).",
    )
    app.state.async_engine = aengine
    app.state.model_name = name
    app.state.metrics = metrics
    app.add_middleware(_StatusCounter, counter=metrics.requests)
    install_component_schemas(
        app,
        [(P.ChatCompletionRequest, "validation"), (P.CompletionRequest, "validation")]
        + [(m, "serialization") for m in (P.ChatCompletionResponse, P.CompletionResponse, P.ModelList)]
        + [(P.ErrorResponse, "serialization")],
    )

    # ------------------------------------------------------------------------------------------ errors
    def error_response(err: P.APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = P.APIError(str(exc.detail), status=exc.status_code, type=kind)
        err.headers = dict(exc.headers or {})
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(P.APIError(f"invalid request: {exc.errors()[:3]}"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error serving %s", request.url.path)
        return error_response(P.APIError("internal server error", status=500, type="internal_error"))

    def validation_error(e: ValidationError) -> P.APIError:
        errors = e.errors()
        parts = []
        for err in errors[:3]:
            loc = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        first_loc = errors[0].get("loc", ()) if errors else ()
        param = str(first_loc[0]) if first_loc else None
        return P.APIError("invalid request: " + "; ".join(parts), param=param)

    def too_large() -> P.APIError:
        return P.APIError(
            f"the request body is larger than the server's limit of {max_request_bytes} bytes",
            status=413,
            code="request_too_large",
        )

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit: from ``Content-Length`` before
        reading anything, else (chunked upload) once the bytes read so far pass it, so nobody can make the
        server buffer an unbounded body."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            raise too_large()
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        raw = await read_body(request)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise P.APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise P.APIError("the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None

    def check_model(requested: str | None) -> None:
        if requested is not None and requested not in (name, MODEL_ALIAS):
            raise P.APIError(
                f"the model {requested!r} does not exist; this server serves {name!r} (or {MODEL_ALIAS!r})",
                status=404,
                param="model",
                code="model_not_found",
            )

    def sampling_params(
        req: P.ChatCompletionRequest | P.CompletionRequest, n_prompt: int, prompt_param: str
    ) -> SamplingParams:
        max_len = engine.max_model_len
        if n_prompt == 0:
            raise P.APIError("the prompt is empty", param=prompt_param)
        if n_prompt >= max_len:
            raise P.APIError(
                f"the prompt has {n_prompt} tokens but the model's context is {max_len} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if req.max_tokens is not None and n_prompt + req.max_tokens > max_len:
            raise P.APIError(
                f"the prompt ({n_prompt} tokens) + max_tokens ({req.max_tokens}) exceed the context of "
                f"{max_len} tokens; lower max_tokens to at most {max_len - n_prompt}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        vocab = engine.model_config.vocab_size
        if req.top_k is not None and req.top_k > vocab:
            raise P.APIError(f"top_k must be -1 or in [1, {vocab}], got {req.top_k}", param="top_k")
        bm = engine.block_manager
        capacity = bm.num_blocks * bm.block_size
        default_max = max(1, min(max_len, capacity) - n_prompt)
        try:
            return req.to_sampling_params(default_max)
        except ValueError as e:
            m = _PARAM_RE.search(str(e))
            raise P.APIError(str(e), param=m.group(1) if m else None) from None

    async def submit(
        tokens: list[int], params: SamplingParams, prompt: str | None, prompt_param: str
    ) -> RequestStream:
        try:
            return await aengine.add_request(tokens, params, prompt)
        except QueueFullError as e:
            raise P.APIError(
                f"the server is busy: {e}; retry later",
                status=503,
                type="server_busy",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except EngineDeadError as e:
            raise P.APIError(
                str(e), status=503, type="server_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except KVCapacityError as e:  # could never run, even alone: refused now, never preempted forever
            raise P.APIError(str(e), param="max_tokens", code="kv_cache_capacity_exceeded") from None
        except (ValueError, TypeError) as e:
            msg = str(e)
            param = "max_tokens" if "max_tokens" in msg else prompt_param
            raise P.APIError(msg, param=param) from None

    def usage(out: StreamOutput) -> P.Usage:
        m = out.metrics
        n_out = len(out.token_ids)
        return P.Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=n_out,
            total_tokens=out.num_prompt_tokens + n_out,
            num_draft_tokens=m.num_draft_tokens,
            num_accepted_tokens=m.num_accepted_tokens,
            mean_accepted_tokens=m.mean_accepted_tokens,
        )

    async def collect(request: Request, stream: RequestStream) -> StreamOutput | Response:
        """Wait for the final output; on client disconnect abort and answer 499 (nobody reads it)."""

        async def last() -> StreamOutput:
            final = None
            async for out in stream:
                final = out
            assert final is not None and final.finished
            return final

        try:
            finished, final = await _until_disconnect(request, last())
        except EngineStepError as e:
            metrics.observe_error()
            raise P.APIError(str(e), status=500, type="internal_error") from None
        except EngineDeadError as e:  # shutting down
            metrics.observe_error()
            raise P.APIError(str(e), status=503, type="server_unavailable") from None
        except RequestAbortedError:
            finished, final = False, None
        if not finished:
            stream.abort()
            return Response(status_code=499)
        return final

    def stream_response(
        stream: RequestStream,
        chunk: Callable[[str | None, str | None, bool], dict[str, Any]],
        final_usage: Callable[[StreamOutput], dict[str, Any]] | None,
    ) -> Response:
        """SSE: an opening chunk, one chunk per text delta, a closing chunk with ``finish_reason``, maybe a
        usage chunk, then ``data: [DONE]``. ``chunk(text, finish_reason, first)`` builds one payload."""
        deltas = TextDeltas(stream.params.stop_list)

        def payload(text: str | None, reason: str | None, first: bool) -> dict[str, Any]:
            d = chunk(text, reason, first)
            if final_usage is None:
                d.pop("usage", None)  # usage appears in chunks only when stream_options.include_usage asked
            return d

        async def body() -> AsyncIterator[str]:
            yield _sse(payload(None, None, True))
            try:
                async for out in stream:
                    delta = deltas.update(out.text, out.finished)
                    if delta:
                        yield _sse(payload(delta, None, False))
                    if out.finished:
                        yield _sse(payload(None, out.finish_reason or "stop", False))
                        if final_usage is not None:
                            yield _sse(final_usage(out))
            except (EngineStepError, EngineDeadError) as e:
                metrics.observe_error()
                yield _sse(P.APIError(str(e), status=500, type="internal_error").body())
            except RequestAbortedError:
                return
            yield "data: [DONE]\n\n"

        return _aborting_streaming_response()(
            body(), stream.abort, {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def respond(
        request: Request,
        stream: RequestStream,
        streaming: bool,
        include_usage: bool,
        chunk: Callable[[str | None, str | None, bool], dict[str, Any]],
        usage_chunk: Callable[[P.Usage], Any],
        body: Callable[[StreamOutput], Any],
    ) -> Any:
        """The tail both completion routes share: SSE chunks (and a usage-only chunk when asked), or one body
        once the request finishes. ``usage_chunk`` and ``body`` build pydantic models."""
        if streaming:
            final_usage = (lambda out: usage_chunk(usage(out)).model_dump()) if include_usage else None
            return stream_response(stream, chunk, final_usage)
        final = await collect(request, stream)
        if isinstance(final, Response):
            return final
        return body(final).model_dump()

    # ------------------------------------------------------------------------------------------ routes
    def route(
        method: str,
        path: str,
        request_model: type[BaseModel] | None = None,
        response_model: type[BaseModel] | None = None,
        errors: tuple[int, ...] = (),
        text_media_type: str | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register a handler. Its annotations are strings (``from __future__ import annotations``) naming
        imports local to this function, which FastAPI cannot resolve: give it the real ``Request`` class.
        The bodies (parsed by hand) are declared for ``/openapi.json`` (see :mod:`leapdecode.server.openapi`)."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            code = fn.__code__
            fn.__annotations__ = (
                {"request": Request} if "request" in code.co_varnames[: code.co_argcount] else {}
            )
            streams = request_model is not None  # both completion routes answer SSE when asked
            doc = operation_doc(
                request_model, response_model, P.ErrorResponse, errors, streams=streams, text_media_type=text_media_type
            )
            app.add_api_route(path, fn, methods=[method], response_model=None, openapi_extra=doc)
            return fn

        return register

    @route("GET", "/health")
    async def health() -> Response:
        if not aengine.is_running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @route("GET", "/metrics", text_media_type="text/plain")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @route("GET", "/v1/models", response_model=P.ModelList)
    async def models() -> dict[str, Any]:
        card = P.ModelCard(
            id=name,
            created=created,
            root=str(getattr(engine, "model_path", None) or name),
            max_model_len=engine.max_model_len,
        )
        return P.ModelList(data=[card]).model_dump()

    @route("POST", "/v1/chat/completions", P.ChatCompletionRequest, P.ChatCompletionResponse, COMPLETION_ERRORS)
    async def chat_completions(request: Request) -> Any:
        req: ChatCompletionRequest = await parse(request, P.ChatCompletionRequest)
        check_model(req.model)
        req.check_supported()
        try:
            # in a worker thread: the tokenizer releases the GIL, so the event loop keeps streaming meanwhile
            tokens = await asyncio.to_thread(llm.apply_chat_template, req.conversation())
        except Exception as e:  # template errors (e.g. role order rules) are the caller's input
            why = _not_unicode([m["content"] for m in req.conversation()]) or str(e)
            raise P.APIError(f"could not apply the chat template: {why}", param="messages") from None
        params = sampling_params(req, len(tokens), "messages")
        stream = await submit(tokens, params, None, "messages")
        rid, ts = P.random_id("chatcmpl"), P.now_s()

        def chunk(text: str | None, reason: str | None, first: bool) -> dict[str, Any]:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            d = P.ChatCompletionChunk(
                id=rid,
                created=ts,
                model=name,
                choices=[P.ChatChunkChoice(delta=P.ChatDelta(), finish_reason=reason)],
            ).model_dump()
            d["choices"][0]["delta"] = delta
            return d

        return await respond(
            request,
            stream,
            bool(req.stream),
            req.include_usage(),
            chunk,
            lambda u: P.ChatCompletionChunk(id=rid, created=ts, model=name, choices=[], usage=u),
            lambda final: P.ChatCompletionResponse(
                id=rid,
                created=ts,
                model=name,
                usage=usage(final),
                choices=[
                    P.ChatChoice(
                        message=P.ChatResponseMessage(content=final.text), finish_reason=final.finish_reason
                    )
                ],
            ),
        )

    @route("POST", "/v1/completions", P.CompletionRequest, P.CompletionResponse, COMPLETION_ERRORS)
    async def completions(request: Request) -> Any:
        req: CompletionRequest = await parse(request, P.CompletionRequest)
        check_model(req.model)
        req.check_supported()
        prompt_text: str | None = None
        if isinstance(req.prompt, str):
            prompt_text = req.prompt
            try:
                tokens, _ = await asyncio.to_thread(llm._tokenize, req.prompt)  # off the event loop, as above
            except Exception as e:
                why = _not_unicode([req.prompt]) or str(e)
                raise P.APIError(f"could not tokenize the prompt: {why}", param="prompt") from None
        else:
            tokens = list(req.prompt)
            vocab = engine.model_config.vocab_size
            if any(t < 0 or t >= vocab for t in tokens):
                raise P.APIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        params = sampling_params(req, len(tokens), "prompt")
        stream = await submit(tokens, params, prompt_text, "prompt")
        rid, ts = P.random_id("cmpl"), P.now_s()

        def chunk(text: str | None, reason: str | None, first: bool) -> dict[str, Any]:
            return P.CompletionResponse(
                id=rid,
                created=ts,
                model=name,
                choices=[P.CompletionChoice(text=text or "", finish_reason=reason)],
            ).model_dump()

        return await respond(
            request,
            stream,
            bool(req.stream),
            req.include_usage(),
            chunk,
            lambda u: P.CompletionResponse(id=rid, created=ts, model=name, choices=[], usage=u),
            lambda final: P.CompletionResponse(
                id=rid,
                created=ts,
                model=name,
                usage=usage(final),
                choices=[P.CompletionChoice(text=final.text, finish_reason=final.finish_reason)],
            ),
        )

    return app


# --------------------------------------------------------------------------------------------- running


def make_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
) -> uvicorn.Server:
    """A ``uvicorn.Server`` for ``app``; ``on_ready(base_url)`` runs once the socket is listening (``port=0``
    picks a free port, reported in the URL)."""
    import uvicorn

    class _Server(uvicorn.Server):
        base_url: str | None = None

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if not self.started:
                return
            bound = port
            for server in getattr(self, "servers", []):
                for sock in server.sockets or []:
                    bound = sock.getsockname()[1]
            shown = f"[{host}]" if ":" in host else host
            self.base_url = f"http://{shown}:{bound}"
            if on_ready is not None:
                on_ready(self.base_url)

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5
    )
    return _Server(config)


def cmd_serve(args: argparse.Namespace) -> int:
    """``leapdecode serve``: load the model, then serve until Ctrl-C."""
    from leapdecode import LLM

    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    kwargs: dict[str, Any] = {}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        speculative_config=args.speculative_config,
        kv_cache_blocks=args.kv_cache_blocks,
        max_num_seqs=args.max_num_seqs,
        num_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        **kwargs,
    )
    app = build_app(
        llm, model_name=args.served_model_name, max_queue=args.max_queue, max_request_bytes=args.max_request_bytes
    )
    name = app.state.model_name

    def ready(url: str) -> None:
        print(f"leapdecode: serving {name!r} at {url}/v1 (Ctrl-C to stop)", flush=True)

    server = make_server(app, args.host, args.port, args.log_level, on_ready=ready)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises the Ctrl-C it caught
        pass
    return 0


def add_cli(sub: Any) -> None:
    """Add ``serve`` to the ``leapdecode`` sub-commands."""
    from leapdecode.cli import EPILOG, add_model_args

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (chat/completions, SSE streaming, /metrics)",
        description=(
            "Serve the model over an OpenAI-compatible HTTP API: POST /v1/chat/completions, /v1/completions "
            "(streaming and not), GET /v1/models, /health and /metrics (Prometheus). All requests share one "
            "continuously batched engine. The model answers to its own name and to 'default'. Per request, "
            '"speculative": false opts out of speculative decoding.'
        ),
        epilog=EPILOG,
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 picks a free one)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests allowed to wait for their first token before new ones get 503 + Retry-After "
        f"(default: {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"larger request bodies get 413 (default: {DEFAULT_MAX_REQUEST_BYTES}, 8 MiB)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="name in /v1/models (default: the model folder's name)"
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests batched together (default: 64)")
    p.add_argument(
        "--kv-cache-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


if __name__ == "__main__":  # python -m leapdecode.server.api_server ...
    parser = argparse.ArgumentParser(prog="leapdecode")
    add_cli(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(ns.func(ns))
