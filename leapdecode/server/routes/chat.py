"""``POST /v1/chat/completions``: the conversation goes through the model's chat template.

``logprobs``/``top_logprobs`` add OpenAI's chat log-probabilities; ``response_format`` constrains the text;
``tools`` with ``tool_choice`` ``"required"`` or a named function constrain the output to the tools' JSON schemas
and answer ``tool_calls`` (``finish_reason: "tool_calls"``; ``"stop"`` for a named function, as OpenAI's API does;
see :mod:`leapdecode.server.tools`; streamed, the calls come whole in the choice's last chunk).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import FastAPI, Request

from leapdecode.server import protocol as P
from leapdecode.server.async_engine import ChoiceSnapshot, StreamOutput
from leapdecode.server.logprobs import ChatLogprobs, LogprobFormatter
from leapdecode.server.openapi import route
from leapdecode.server.serving import COMPLETION_ERRORS, Serving, not_unicode
from leapdecode.server.streaming import Delta
from leapdecode.server.tools import Tool, ToolCall, parse_tool_calls, tool_constraint

ToolConstraint = Tool | Literal["required"] | None


def answer(c: ChoiceSnapshot, tool: ToolConstraint) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """``(content, tool_calls, finish_reason)`` of a finished choice: a complete constrained output becomes tool
    calls; one cut short by ``max_tokens`` stays text. As in OpenAI's API, the finish reason of calls is
    ``tool_calls`` under ``"required"`` and ``stop`` under a named function (the client forced that call)."""
    calls = parse_tool_calls(c.text, tool) if tool is not None else None
    if calls is None:
        return c.text, None, c.finish_reason
    return None, calls, "tool_calls" if tool == "required" else "stop"


def delta_content(delta: Delta, tool: ToolConstraint) -> tuple[dict[str, Any], str | None] | None:
    """A streamed chunk's ``delta`` object and finish reason; None when nothing goes out for ``delta`` (a tool
    call still being generated: the calls go out whole, once the choice has finished)."""
    content: dict[str, Any] = {"role": "assistant", "content": ""} if delta.first else {}
    reason = delta.finish_reason
    c = delta.choice
    if tool is not None and c is not None:
        if reason is None:
            return None
        text, calls, reason = answer(c, tool)
        if calls is not None:
            content["tool_calls"] = [
                P.ToolCallDelta(index=i, **call.model_dump()).model_dump() for i, call in enumerate(calls)
            ]
        elif text:
            content["content"] = text
    elif delta.text:
        content["content"] = delta.text
    return content, reason


def add_routes(app: FastAPI, serving: Serving) -> None:
    name = serving.name
    tokenizer = serving.engine.tokenizer
    formatter = LogprobFormatter(tokenizer)

    async def encode(req: P.ChatCompletionRequest) -> list[int]:
        conversation = req.conversation()
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            # in a worker thread: the tokenizer releases the GIL, so the event loop keeps streaming meanwhile
            return await asyncio.to_thread(serving.llm.apply_chat_template, conversation, tools)
        except Exception as e:  # template errors (e.g. role order rules) are the caller's input
            why = not_unicode([m["content"] for m in conversation]) or str(e)
            raise P.APIError(f"could not apply the chat template: {why}", param="messages") from None

    @route(app, "POST", "/v1/chat/completions", P.ChatCompletionRequest, P.ChatCompletionResponse,
           COMPLETION_ERRORS, streams=True)
    async def chat_completions(request: Request) -> Any:
        req: P.ChatCompletionRequest = await serving.parse(request, P.ChatCompletionRequest)
        serving.check_model(req.model)
        req.check_supported()
        tool = req.tool_constraint()
        tokens = await encode(req)
        extra: dict[str, Any] = {"logprobs": req.num_logprobs()}
        if tool is not None:
            extra["structured_outputs"] = tool_constraint(req.tools or [], tool)
        params = serving.sampling_params(req, len(tokens), "messages", **extra)
        streams = await serving.submit_all([(tokens, None)], [params], "messages")
        rid, ts = P.random_id("chatcmpl"), P.now_s()
        n = req.n or 1

        def logprobs(c: ChoiceSnapshot, start: int) -> ChatLogprobs | None:
            if not req.logprobs or c.logprobs is None:
                return None
            return formatter.chat(c.token_ids[start:], c.logprobs[start:], req.top_logprobs or 0)

        def chunk(delta: Delta) -> dict[str, Any] | None:
            if (got := delta_content(delta, tool)) is None:
                return None
            content, reason = got
            c = delta.choice
            lp = logprobs(c, 0 if tool is not None else delta.tokens_from) if c is not None else None
            d = P.ChatCompletionChunk(
                id=rid,
                created=ts,
                model=name,
                choices=[P.ChatChunkChoice(index=delta.index, delta=P.ChatDelta(), logprobs=lp, finish_reason=reason)],
            ).model_dump()
            d["choices"][0]["delta"] = content
            return d

        def body(finals: list[StreamOutput]) -> P.ChatCompletionResponse:
            choices = []
            for c in finals[0].choices:
                text, calls, reason = answer(c, tool)
                message = P.ChatResponseMessage(content=text, tool_calls=calls)
                lp = logprobs(c, 0)
                choices.append(P.ChatChoice(index=c.index, message=message, logprobs=lp, finish_reason=reason))
            return P.ChatCompletionResponse(
                id=rid, created=ts, model=name, usage=serving.usage(finals), choices=choices
            )

        return await serving.respond(
            request,
            streams,
            n,
            bool(req.stream),
            req.include_usage(),
            chunk,
            lambda u: P.ChatCompletionChunk(id=rid, created=ts, model=name, choices=[], usage=u),
            body,
        )
