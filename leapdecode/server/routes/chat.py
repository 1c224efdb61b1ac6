"""``POST /v1/chat/completions``: the conversation goes through the model's chat template."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from leapdecode.server import protocol as P
from leapdecode.server.async_engine import StreamOutput
from leapdecode.server.openapi import route
from leapdecode.server.serving import COMPLETION_ERRORS, Serving, not_unicode
from leapdecode.server.streaming import Delta


def add_routes(app: FastAPI, serving: Serving) -> None:
    name = serving.name

    @route(app, "POST", "/v1/chat/completions", P.ChatCompletionRequest, P.ChatCompletionResponse,
           COMPLETION_ERRORS, streams=True)
    async def chat_completions(request: Request) -> Any:
        req: P.ChatCompletionRequest = await serving.parse(request, P.ChatCompletionRequest)
        serving.check_model(req.model)
        req.check_supported()
        try:
            # in a worker thread: the tokenizer releases the GIL, so the event loop keeps streaming meanwhile
            tokens = await asyncio.to_thread(serving.llm.apply_chat_template, req.conversation())
        except Exception as e:  # template errors (e.g. role order rules) are the caller's input
            why = not_unicode([m["content"] for m in req.conversation()]) or str(e)
            raise P.APIError(f"could not apply the chat template: {why}", param="messages") from None
        params = serving.sampling_params(req, len(tokens), "messages")
        streams = await serving.submit_all([(tokens, None)], [params], "messages")
        rid, ts = P.random_id("chatcmpl"), P.now_s()
        n = req.n or 1

        def chunk(delta: Delta) -> dict[str, Any]:
            content: dict[str, Any] = {"role": "assistant", "content": ""} if delta.first else {}
            if delta.text:
                content["content"] = delta.text
            d = P.ChatCompletionChunk(
                id=rid,
                created=ts,
                model=name,
                choices=[P.ChatChunkChoice(index=delta.index, delta=P.ChatDelta(), finish_reason=delta.finish_reason)],
            ).model_dump()
            d["choices"][0]["delta"] = content
            return d

        def body(finals: list[StreamOutput]) -> P.ChatCompletionResponse:
            choices = [
                P.ChatChoice(
                    index=c.index, message=P.ChatResponseMessage(content=c.text), finish_reason=c.finish_reason
                )
                for c in finals[0].choices
            ]
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
