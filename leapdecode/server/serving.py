"""What every route shares: the engine and its async loop, the served name, the metrics, and the request plumbing
(reading and validating a body, checking the model name, building ``SamplingParams``, submitting, collecting or
streaming the answer).

Invariants
----------
* Bad input never reaches the engine loop as an exception and never yields a 5xx: it gets a 4xx and an OpenAI
  error body; a full queue answers 503 with ``Retry-After``. A body over ``max_request_bytes`` gets a 413 before
  it is parsed.
* The event loop never tokenizes: tokenization (about a second per 2 MB of prompt) runs in a worker thread, so a
  long prompt does not stall the other streams.
* A client that goes away is aborted at once (streaming or not); the engine thread frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from leapdecode.engine.llm_engine import KVCapacityError, LLMEngine
from leapdecode.llm import LLM
from leapdecode.models.hub import display_name, is_repo_id
from leapdecode.sampling_params import SamplingParams
from leapdecode.server import protocol as P
from leapdecode.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
    StreamOutput,
)
from leapdecode.server.chat_output import ChatOutputConfig
from leapdecode.server.deadlines import DeadlineExceeded, deadline_after, until_deadline
from leapdecode.server.metrics import ServerMetrics
from leapdecode.server.streaming import (
    SSE_DONE,
    AbortingStreamingResponse,
    ChoiceDeltas,
    ChunkBuilder,
    Delta,
    merge_streams,
    sse,
    until_disconnect,
)
from leapdecode.structured import CompiledGrammar, GrammarLimitError

MODEL_ALIAS = "default"
RETRY_AFTER_S = 1
COMPLETION_ERRORS = (400, 404, 408, 413, 500, 503)  # what the generation routes may answer, documented in /openapi.json
_PARAM_RE = re.compile(r"SamplingParams\.(\w+)")
TEXT_MARGIN = 4  # Unicode normalization merges at most a few characters into one (e.g. Hangul jamo)
OFF_LOOP_BYTES = 1 << 20  # bodies larger than this are parsed in a worker thread


def default_model_name(engine: LLMEngine) -> str:
    """The served name: the Hugging Face repo id the model was named by, else the model folder's name (or the
    ``.gguf`` file's stem)."""
    asked = str(engine.config.model or "")
    if is_repo_id(asked) and not Path(asked).exists():
        return display_name(asked)
    path = getattr(engine, "model_path", None)
    if not path:
        return "leapdecode"
    p = Path(str(path))
    return p.stem if p.suffix == ".gguf" else p.name


def as_llm(llm_or_engine: LLM | LLMEngine) -> LLM:
    """An ``LLM`` facade for tokenization (``apply_chat_template`` / ``_tokenize`` only use ``.engine``)."""
    if isinstance(llm_or_engine, LLM):
        return llm_or_engine
    llm = object.__new__(LLM)
    llm.engine = llm_or_engine
    return llm


def not_unicode(texts: list[str]) -> str | None:
    """Why ``texts`` cannot be tokenized, if one holds a lone surrogate (JSON's ``"\\ud800"`` escapes decode to
    one, and the tokenizer then fails with a message about its own input types); None when all are valid."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"the text is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}"
    return None


def validation_error(e: ValidationError) -> P.APIError:
    """A pydantic validation failure as a 400 naming (up to three of) the offending fields."""
    errors = e.errors()
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    first_loc = errors[0].get("loc", ()) if errors else ()
    param = str(first_loc[0]) if first_loc else None
    return P.APIError("invalid request: " + "; ".join(parts), param=param)


class Admission:
    """One request's place under the queue cap while it is prepared, before the engine's queue counts it."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.serving.preparing -= 1


class Serving:
    """The state and plumbing the routes share; one per app."""

    def __init__(
        self,
        llm: LLM,
        name: str,
        aengine: AsyncEngine,
        metrics: ServerMetrics,
        max_request_bytes: int,
        chat_output: ChatOutputConfig | None = None,
        body_timeout_s: float | None = None,
        request_timeout_s: float | None = None,
        share_output: bool = True,
    ) -> None:
        self.llm = llm
        self.share_output = share_output  # the SamplingParams.share_output of requests that do not say
        self.chat_output = chat_output or ChatOutputConfig()
        self.body_timeout_s = body_timeout_s
        self.request_timeout_s = request_timeout_s
        self.preparing = 0  # requests past parsing, not yet queued (tokenizing, compiling): only the loop counts
        self.engine = llm.engine
        self.name = name
        self.aengine = aengine
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self.created = P.now_s()
        tok = self.engine.tokenizer
        vocab = tok.get_vocab() if tok is not None else {}
        self.longest_token_chars = max((len(t) for t in vocab), default=1)

    # ----------------------------------------------------------------------------------------------- input
    def too_large(self) -> P.APIError:
        return P.APIError(
            f"the request body is larger than the server's limit of {self.max_request_bytes} bytes",
            status=413,
            code="request_too_large",
        )

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit: from ``Content-Length`` before
        reading anything, else (chunked upload) once the bytes read so far pass it, so nobody can make the
        server buffer an unbounded body."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise self.too_large()
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in until_deadline(request.stream(), deadline_after(self.body_timeout_s)):
                size += len(chunk)
                if size > self.max_request_bytes:
                    raise self.too_large()
                chunks.append(chunk)
        except DeadlineExceeded:
            raise P.APIError(
                f"the request body did not arrive within the server's body timeout of {self.body_timeout_s:g} s "
                f"({size} bytes read)",
                status=408,
                type="timeout",
                code="request_body_timeout",
            ) from None
        return b"".join(chunks)

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        """The body validated as ``model``; bad JSON or a bad field is a 400."""
        raw = await self.read_body(request)
        if len(raw) > OFF_LOOP_BYTES:  # megabytes of JSON take tens of milliseconds: not on the event loop
            return await asyncio.to_thread(self.validate, raw, model)
        return self.validate(raw, model)

    @staticmethod
    def validate(raw: bytes, model: type[BaseModel]) -> Any:
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
        except RecursionError:  # a validator walking hostile nesting
            raise P.APIError("the request body is nested too deeply", code="invalid_json") from None

    def check_text_fits(self, texts: list[str], param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit the context: no token stands for more characters
        than the vocabulary's longest token string, so text over ``context x longest x TEXT_MARGIN``
        characters (the margin for normalizers that merge characters) has more tokens than the context."""
        limit = self.engine.max_model_len * self.longest_token_chars * TEXT_MARGIN
        size = sum(len(t) for t in texts)
        if size > limit:
            raise P.APIError(
                f"the {param} has {size} characters, far more than the model's context of "
                f"{self.engine.max_model_len} tokens can hold (at most {limit} characters)",
                param=param,
                code="context_length_exceeded",
            )

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in (self.name, MODEL_ALIAS):
            raise P.APIError(
                f"the model {requested!r} does not exist; this server serves {self.name!r} (or {MODEL_ALIAS!r})",
                status=404,
                param="model",
                code="model_not_found",
            )

    def check_token_ids(self, tokens: list[int], param: str) -> None:
        vocab = self.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in tokens):
            raise P.APIError(f"token ids must be in [0, {vocab})", param=param)

    def sampling_params(
        self, req: P.ChatCompletionRequest | P.CompletionRequest, n_prompt: int, prompt_param: str, **extra: Any
    ) -> SamplingParams:
        """``req``'s ``SamplingParams`` for a prompt of ``n_prompt`` tokens (``extra``: fields the route sets); what
        cannot fit the context is a 400."""
        max_len = self.engine.max_model_len
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
        vocab = self.engine.model_config.vocab_size
        if req.top_k is not None and req.top_k > vocab:
            raise P.APIError(f"top_k must be -1 or in [1, {vocab}], got {req.top_k}", param="top_k")
        self.check_token_ids(list(req.token_bias() or ()), "logit_bias")
        self.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        default_max = self.engine.max_tokens_fitting(n_prompt, req.n or 1)  # the n samples' KV fits
        extra.setdefault("share_output", self.share_output if req.share_output is None else req.share_output)
        try:
            return req.to_sampling_params(default_max, **extra)
        except ValueError as e:
            m = _PARAM_RE.search(str(e))
            raise P.APIError(str(e), param=m.group(1) if m else None) from None

    # ---------------------------------------------------------------------------------------------- engine
    def busy(self, why: str) -> P.APIError:
        return P.APIError(
            f"the server is busy: {why}; retry later",
            status=503,
            type="server_busy",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    @contextlib.contextmanager
    def admission(self) -> Iterator[Admission]:
        """The queue cap, applied before a request's expensive work (tokenizing, compiling its grammar): the
        requests being prepared count against ``max_queue`` with the ones waiting in the engine. A request stops
        counting here when :meth:`submit_all` hands it to the engine's queue, so it is never counted twice."""
        waiting = self.aengine.num_queued + self.preparing
        if waiting >= self.aengine.max_queue:
            raise self.busy(f"{waiting} requests are already waiting (max_queue={self.aengine.max_queue})")
        self.preparing += 1
        admitted = Admission(self)
        try:
            yield admitted
        finally:
            admitted.release()

    async def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """Compile the request's output grammar in the grammar engine's worker threads, so that the engine
        thread gets it ready-made and never stalls the other streams while a schema compiles. A constraint over
        the grammar limits, one that does not compile within the compile timeout (the compile goes on without
        this request; others are not held behind it), or a server without the grammar engine, is a 400."""
        spec = params.structured_outputs
        if spec is None:
            return None
        try:
            backend = await asyncio.to_thread(self.engine.structured_backend)  # built on first use
            future = await asyncio.to_thread(backend.submit, spec)  # limits checked first
        except ImportError as e:
            raise P.APIError(str(e), code="structured_output_unavailable") from None
        except GrammarLimitError as e:
            raise P.APIError(str(e), code="grammar_too_large") from None
        except ValueError as e:
            raise P.APIError(str(e)) from None
        # asyncio.wait neither cancels the compile on time-out nor when this request is cancelled: other
        # requests asking for the same spec share it
        waited = asyncio.wrap_future(future)
        done, _ = await asyncio.wait({waited}, timeout=backend.limits.compile_timeout_s)
        if not done:
            raise P.APIError(str(backend.limits.timeout_error(spec)), code="grammar_compile_timeout")
        try:
            compiled = waited.result()
        except ValueError as e:
            raise P.APIError(str(e)) from None
        matcher = await asyncio.to_thread(backend.matcher, spec, compiled)
        if not bool(matcher.allowed_tokens().any()):  # e.g. "root ::= root": nothing could ever be sampled
            raise P.APIError(f"structured_outputs.{spec.kind} admits no output at all")
        if self.engine.executor is not None:  # the tensor-parallel workers' copy, serialised here, not in a step
            await asyncio.to_thread(backend.to_wire, compiled)
        return compiled

    async def submit(
        self, tokens: list[int], params: SamplingParams, prompt: str | None, prompt_param: str,
        grammar: CompiledGrammar | None,
    ) -> RequestStream:
        """Hand the request to the engine loop; a full queue or a stopped engine is a 503, a refusal a 400."""
        try:
            return await self.aengine.add_request(tokens, params, prompt, grammar=grammar)
        except QueueFullError as e:
            raise self.busy(str(e)) from None
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

    async def submit_all(
        self,
        prompts: list[tuple[list[int], str | None]],
        params: list[SamplingParams],
        prompt_param: str,
        admitted: Admission,
    ) -> list[RequestStream]:
        """Compile every prompt's grammar, then :meth:`submit` each prompt; if one is refused, the ones already
        submitted are aborted. From the first submit on, the engine's queue counts the request, not ``admitted``."""
        grammars = [await self.compile_grammar(p) for p in params]
        admitted.release()
        streams: list[RequestStream] = []
        try:
            for (tokens, text), p, grammar in zip(prompts, params, grammars, strict=True):
                streams.append(await self.submit(tokens, p, text, prompt_param, grammar))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    @staticmethod
    def usage(finals: list[StreamOutput]) -> P.Usage:
        """Token counts summed over the prompts of one HTTP request (and over the ``n`` samples of each)."""
        n_prompt = sum(out.num_prompt_tokens for out in finals)
        n_out = sum(out.num_output_tokens for out in finals)
        steps = sum(out.metrics.num_target_steps for out in finals)
        produced = sum(out.metrics.num_output_tokens for out in finals)
        return P.Usage(
            prompt_tokens=n_prompt,
            completion_tokens=n_out,
            total_tokens=n_prompt + n_out,
            num_draft_tokens=sum(out.metrics.num_draft_tokens for out in finals),
            num_accepted_tokens=sum(out.metrics.num_accepted_tokens for out in finals),
            mean_accepted_tokens=produced / steps if steps else 1.0,
        )

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[StreamOutput] | Response:
        """Wait for every stream's final output; on client disconnect abort them all and answer 499 (nobody
        reads it)."""

        async def last(stream: RequestStream) -> StreamOutput:
            final = None
            async for out in stream:
                final = out
            assert final is not None and final.finished
            return final

        try:
            finished, finals = await until_disconnect(request, asyncio.gather(*(last(s) for s in streams)))
        except EngineStepError as e:
            self.metrics.observe_error()
            raise P.APIError(str(e), status=500, type="internal_error") from None
        except EngineDeadError as e:  # shutting down
            self.metrics.observe_error()
            raise P.APIError(str(e), status=503, type="server_unavailable") from None
        except RequestAbortedError:
            finished, finals = False, None
        finally:
            for stream in streams:  # a no-op for the ones that finished
                stream.abort()
        if not finished:
            return Response(status_code=499)
        return list(finals)

    def timed_out(self) -> P.APIError:
        return P.APIError(
            f"the request ran past the server's request timeout of {self.request_timeout_s:g} s and was stopped "
            "(lower max_tokens to finish sooner)",
            status=408,
            type="timeout",
            code="request_timeout",
        )

    # --------------------------------------------------------------------------------------------- answers
    def stream_response(
        self,
        streams: list[RequestStream],
        n: int,
        chunk: ChunkBuilder,
        usage_chunk: Callable[[P.Usage], BaseModel] | None,
    ) -> Response:
        """SSE: an opening chunk per choice, one chunk per text delta (the last one with ``finish_reason``), a
        usage chunk when asked, then ``data: [DONE]``."""

        def payload(delta: Delta) -> str | None:
            d = chunk(delta)
            if d is None:  # nothing to send for this delta (e.g. a tool call still being generated)
                return None
            if usage_chunk is None:
                d.pop("usage", None)  # usage appears in chunks only when stream_options.include_usage asked
            return sse(d)

        deadline = deadline_after(self.request_timeout_s)

        async def body() -> AsyncIterator[str]:
            for index in range(len(streams) * n):
                if (event := payload(Delta(index, None, None, None, 0, first=True))) is not None:
                    yield event
            finals: dict[int, StreamOutput] = {}
            deltas = ChoiceDeltas([s.params.stop_list for s in streams], n)
            try:
                async for k, out in until_deadline(merge_streams(streams), deadline):
                    for delta in deltas.update(k, out):
                        if (event := payload(delta)) is not None:
                            yield event
                    if out.finished:
                        finals[k] = out
            except (EngineStepError, EngineDeadError) as e:
                self.metrics.observe_error()
                yield sse(P.APIError(str(e), status=500, type="internal_error").body())
            except DeadlineExceeded:
                abort_all()  # frees their KV blocks now
                yield sse(self.timed_out().body())
            except RequestAbortedError:
                return
            else:
                if usage_chunk is not None:
                    yield sse(usage_chunk(self.usage(list(finals.values()))).model_dump())
            yield SSE_DONE

        def abort_all() -> None:
            for stream in streams:
                stream.abort()

        return AbortingStreamingResponse(body(), abort_all, {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def respond(
        self,
        request: Request,
        streams: list[RequestStream],
        n: int,
        streaming: bool,
        include_usage: bool,
        chunk: ChunkBuilder,
        usage_chunk: Callable[[P.Usage], BaseModel],
        body: Callable[[list[StreamOutput]], BaseModel],
    ) -> Any:
        """The tail both completion routes share: SSE chunks (and a usage-only chunk when asked), or one body
        once every request finished."""
        if streaming:
            return self.stream_response(streams, n, chunk, usage_chunk if include_usage else None)
        return await self.answer(request, streams, body)

    async def answer(
        self, request: Request, streams: list[RequestStream], body: Callable[[list[StreamOutput]], BaseModel]
    ) -> Any:
        """One body once every request finished, within the request timeout (499 when the client left)."""
        try:  # on time-out collect is cancelled, which aborts the streams (freeing their KV blocks)
            finals = await asyncio.wait_for(self.collect(request, streams), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise self.timed_out() from None
        if isinstance(finals, Response):
            return finals
        return body(finals).model_dump()
