"""``POST /v1/completions``: text prompts or token ids (one or a batch), completed as is (no chat template)."""

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

    async def encode(prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, list):
            serving.check_token_ids(prompt, "prompt")
            return prompt, None
        try:
            tokens, _ = await asyncio.to_thread(serving.llm._tokenize, prompt)  # off the event loop
        except Exception as e:
            why = not_unicode([prompt]) or str(e)
            raise P.APIError(f"could not tokenize the prompt: {why}", param="prompt") from None
        return tokens, prompt

    @route(app, "POST", "/v1/completions", P.CompletionRequest, P.CompletionResponse, COMPLETION_ERRORS,
           streams=True)
    async def completions(request: Request) -> Any:
        req: P.CompletionRequest = await serving.parse(request, P.CompletionRequest)
        serving.check_model(req.model)
        req.check_supported()
        prompts = [await encode(p) for p in req.prompts()]
        params = [serving.sampling_params(req, len(tokens), "prompt") for tokens, _ in prompts]
        streams = await serving.submit_all(prompts, params, "prompt")
        rid, ts = P.random_id("cmpl"), P.now_s()
        n = req.n or 1

        def chunk(delta: Delta) -> dict[str, Any]:
            choice = P.CompletionChoice(index=delta.index, text=delta.text or "", finish_reason=delta.finish_reason)
            return P.CompletionResponse(id=rid, created=ts, model=name, choices=[choice]).model_dump()

        def body(finals: list[StreamOutput]) -> P.CompletionResponse:
            choices = [
                P.CompletionChoice(index=k * n + c.index, text=c.text, finish_reason=c.finish_reason)
                for k, out in enumerate(finals)
                for c in out.choices
            ]
            return P.CompletionResponse(id=rid, created=ts, model=name, usage=serving.usage(finals), choices=choices)

        return await serving.respond(
            request,
            streams,
            n,
            bool(req.stream),
            req.include_usage(),
            chunk,
            lambda u: P.CompletionResponse(id=rid, created=ts, model=name, choices=[], usage=u),
            body,
        )
