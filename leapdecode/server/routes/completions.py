"""``POST /v1/completions``: a text prompt or token ids, completed as is (no chat template)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from leapdecode.server import protocol as P
from leapdecode.server.openapi import route
from leapdecode.server.serving import COMPLETION_ERRORS, Serving, not_unicode


def add_routes(app: FastAPI, serving: Serving) -> None:
    name = serving.name

    @route(app, "POST", "/v1/completions", P.CompletionRequest, P.CompletionResponse, COMPLETION_ERRORS,
           streams=True)
    async def completions(request: Request) -> Any:
        req: P.CompletionRequest = await serving.parse(request, P.CompletionRequest)
        serving.check_model(req.model)
        req.check_supported()
        prompt_text: str | None = None
        if isinstance(req.prompt, str):
            prompt_text = req.prompt
            try:
                tokens, _ = await asyncio.to_thread(serving.llm._tokenize, req.prompt)  # off the event loop
            except Exception as e:
                why = not_unicode([req.prompt]) or str(e)
                raise P.APIError(f"could not tokenize the prompt: {why}", param="prompt") from None
        else:
            tokens = list(req.prompt)
            vocab = serving.engine.model_config.vocab_size
            if any(t < 0 or t >= vocab for t in tokens):
                raise P.APIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        params = serving.sampling_params(req, len(tokens), "prompt")
        stream = await serving.submit(tokens, params, prompt_text, "prompt")
        rid, ts = P.random_id("cmpl"), P.now_s()

        def chunk(text: str | None, reason: str | None, first: bool) -> dict[str, Any]:
            return P.CompletionResponse(
                id=rid,
                created=ts,
                model=name,
                choices=[P.CompletionChoice(text=text or "", finish_reason=reason)],
            ).model_dump()

        return await serving.respond(
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
                usage=serving.usage(final),
                choices=[P.CompletionChoice(text=final.text, finish_reason=final.finish_reason)],
            ),
        )
