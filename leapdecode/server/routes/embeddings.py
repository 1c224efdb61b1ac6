"""``POST /v1/embeddings``: pooled, normalised hidden states of the served decoder model
(:mod:`leapdecode.server.embeddings`)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from leapdecode.server import protocol as P
from leapdecode.server.embeddings import EmbeddingRequest, EmbeddingResponse, Pooling, embed, response
from leapdecode.server.openapi import route
from leapdecode.server.serving import Serving, not_unicode


def add_routes(app: FastAPI, serving: Serving, pooling: Pooling = "last") -> None:
    engine = serving.engine
    lock = asyncio.Lock()  # one embedding pass at a time beside the engine's own steps

    @route(app, "POST", "/v1/embeddings", EmbeddingRequest, EmbeddingResponse, (400, 404, 413))
    async def embeddings(request: Request) -> Any:
        req: EmbeddingRequest = await serving.parse(request, EmbeddingRequest)
        serving.check_model(req.model)
        hidden = engine.model_config.hidden_size
        if req.dimensions is not None and req.dimensions > hidden:
            raise P.APIError(f"dimensions must be at most the model's {hidden}", param="dimensions")
        inputs = req.inputs()
        texts = [x for x in inputs if isinstance(x, str)]
        if (why := not_unicode(texts)) is not None:
            raise P.APIError(why, param="input")

        def tokenize() -> list[list[int]]:
            return [engine.tokenizer.encode(x, add_special_tokens=True) if isinstance(x, str) else list(x)
                    for x in inputs]

        token_lists = await asyncio.to_thread(tokenize)
        for tokens in token_lists:
            if not tokens:
                raise P.APIError("an input is empty", param="input")
            if len(tokens) > engine.max_model_len:
                raise P.APIError(f"an input has {len(tokens)} tokens but the model's context is "
                                 f"{engine.max_model_len} tokens", param="input", code="context_length_exceeded")
            serving.check_token_ids(tokens, "input")
        async with lock:
            vectors = await asyncio.to_thread(embed, engine.model, token_lists, pooling)
        return response(serving.name, vectors, sum(len(t) for t in token_lists), req)
