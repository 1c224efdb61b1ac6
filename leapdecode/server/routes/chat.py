"""``POST /v1/chat/completions``: the conversation goes through the model's chat template."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from leapdecode.server import protocol as P
from leapdecode.server.openapi import route
from leapdecode.server.serving import COMPLETION_ERRORS, Serving, not_unicode


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
        stream = await serving.submit(tokens, params, None, "messages")
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

        return await serving.respond(
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
                usage=serving.usage(final),
                choices=[
                    P.ChatChoice(
                        message=P.ChatResponseMessage(content=final.text), finish_reason=final.finish_reason
                    )
                ],
            ),
        )
