"""``POST /v1/responses``: OpenAI's Responses API, the text case (:mod:`leapdecode.server.responses`), whole or as
its typed stream of events.

The stream sends, each as ``event: TYPE`` with its JSON ``data`` (``type`` and a ``sequence_number`` counting from
0): ``response.created`` and ``response.in_progress`` (the response, no output yet), ``response.output_item.added``
and ``response.content_part.added`` (the message and its text part, empty), one ``response.output_text.delta`` per
new text, then ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` (the
whole text) and ``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` cut it), the
response with its usage. An engine failure or the request timeout sends an ``error`` event instead and ends the
stream. The deltas add up to the whole text (a stop string is never partly sent).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from leapdecode.server import protocol as P
from leapdecode.server.async_engine import (
    EngineDeadError,
    EngineStepError,
    RequestAbortedError,
    RequestStream,
    StreamOutput,
)
from leapdecode.server.deadlines import DeadlineExceeded, deadline_after, until_deadline
from leapdecode.server.openapi import route
from leapdecode.server.responses import (
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    response_object,
    status_of,
    usage,
)
from leapdecode.server.serving import COMPLETION_ERRORS, Serving, not_unicode, validation_error
from leapdecode.server.streaming import AbortingStreamingResponse, TextDeltas


def event(kind: str, number: int, **payload: Any) -> str:
    """One server-sent event of the Responses stream."""
    data = json.dumps({"type": kind, "sequence_number": number, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


class ResponseStream:
    """The events of one streamed response (``build(status, output, final)``: the response in that state)."""

    def __init__(self, serving: Serving, stream: RequestStream, msg_id: str,
                 build: Callable[[str, list[OutputMessage], StreamOutput | None], ResponseObject]) -> None:
        self.serving, self.stream, self.msg_id, self.build = serving, stream, msg_id, build
        self.numbers = itertools.count()

    def emit(self, kind: str, **payload: Any) -> str:
        return event(kind, next(self.numbers), **payload)

    def part(self, kind: str, text: str) -> str:
        return self.emit(kind, item_id=self.msg_id, output_index=0, content_index=0,
                         part=OutputText(text=text).model_dump())

    def message(self, status: str, text: str | None) -> OutputMessage:
        return OutputMessage(id=self.msg_id, status=status, content=[] if text is None else [OutputText(text=text)])

    async def events(self) -> AsyncIterator[str]:
        shell = self.build("in_progress", [], None).model_dump()
        yield self.emit("response.created", response=shell)
        yield self.emit("response.in_progress", response=shell)
        yield self.emit("response.output_item.added", output_index=0,
                        item=self.message("in_progress", None).model_dump())
        yield self.part("response.content_part.added", "")
        deltas = TextDeltas(self.stream.params.stop_list)
        final: StreamOutput | None = None
        try:
            async for out in until_deadline(self.stream, deadline_after(self.serving.request_timeout_s)):
                c = out.choices[0]
                if text := deltas.update(c.text, c.finished):
                    yield self.emit("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                    content_index=0, delta=text, logprobs=[])
                if out.finished:
                    final = out
        except (EngineStepError, EngineDeadError) as e:
            self.serving.metrics.observe_error()
            yield self.emit("error", code="internal_error", message=str(e), param=None)
            return
        except DeadlineExceeded:
            self.stream.abort()  # frees its KV blocks now
            yield self.emit("error", code="request_timeout", message=self.serving.timed_out().message, param=None)
            return
        except RequestAbortedError:
            return
        assert final is not None
        text, status = final.choices[0].text, status_of(final.choices[0].finish_reason)
        yield self.emit("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                        text=text, logprobs=[])
        yield self.part("response.content_part.done", text)
        yield self.emit("response.output_item.done", output_index=0, item=self.message(status, text).model_dump())
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self.emit(kind, response=self.build(status, [self.message(status, text)], final).model_dump())


def add_routes(app: FastAPI, serving: Serving) -> None:
    @route(app, "POST", "/v1/responses", ResponsesRequest, ResponseObject, COMPLETION_ERRORS,
           streams=ResponseStreamEvent)
    async def responses(request: Request) -> Any:
        req: ResponsesRequest = await serving.parse(request, ResponsesRequest)
        serving.check_model(req.model)
        req.check_supported()
        conversation = req.messages()
        try:
            chat = req.as_chat()
        except ValidationError as e:
            raise validation_error(e) from None
        with serving.admission() as admitted:
            try:
                tokens = await asyncio.to_thread(serving.llm.apply_chat_template, conversation)
            except Exception as e:  # template errors (e.g. role order rules) are the caller's input
                why = not_unicode([m["content"] for m in conversation]) or str(e)
                raise P.APIError(f"could not apply the chat template: {why}", param="input") from None
            params = serving.sampling_params(chat, len(tokens), "input")
            [stream] = await serving.submit_all([(tokens, None)], [params], "input", admitted)
        rid, msg_id, created = P.random_id("resp"), P.random_id("msg"), P.now_s()

        def build(status: str, output: list[OutputMessage], final: StreamOutput | None) -> ResponseObject:
            u = usage(serving.usage([final]), final.metrics.num_cached_prompt_tokens) if final is not None else None
            return response_object(req, rid, created, serving.name, status, output, u)

        def body(finals: list[StreamOutput]) -> ResponseObject:
            c = finals[0].choices[0]
            status = status_of(c.finish_reason)
            return build(status, [OutputMessage(id=msg_id, status=status, content=[OutputText(text=c.text)])],
                         finals[0])

        if not req.stream:
            return await serving.answer(request, [stream], body)
        events = ResponseStream(serving, stream, msg_id, build)
        return AbortingStreamingResponse(events.events(), stream.abort,
                                         {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
