"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's shapes): the model's tokenizer, and
its chat template."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from leapdecode.server import protocol as P
from leapdecode.server.openapi import route
from leapdecode.server.serving import Serving, not_unicode

TOKEN_ERRORS = (400, 404, 413, 500)


def add_routes(app: FastAPI, serving: Serving) -> None:
    tokenizer = serving.engine.tokenizer

    @route(app, "POST", "/tokenize", P.TokenizeRequest, P.TokenizeResponse, TOKEN_ERRORS)
    async def tokenize(request: Request) -> dict[str, Any]:
        req = (await serving.parse(request, P.TokenizeRequest)).root
        serving.check_model(req.model)
        chat = isinstance(req, P.TokenizeChatRequest)
        try:
            if chat:
                texts = [m["content"] for m in req.conversation()]
                tokens = await asyncio.to_thread(serving.llm.apply_chat_template, req.conversation())
            else:
                texts = [req.prompt]
                special = req.add_special_tokens
                tokens = await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=special)
        except Exception as e:
            why = not_unicode(texts) or str(e)
            raise P.APIError(f"could not tokenize: {why}", param="messages" if chat else "prompt") from None
        # off the event loop too: a body near the size limit is millions of tokens
        strs = await asyncio.to_thread(tokenizer.convert_ids_to_tokens, tokens) if req.return_token_strs else None
        answer = P.TokenizeResponse(
            count=len(tokens), max_model_len=serving.engine.max_model_len, tokens=tokens, token_strs=strs
        )
        return answer.model_dump()

    @route(app, "POST", "/detokenize", P.DetokenizeRequest, P.DetokenizeResponse, TOKEN_ERRORS)
    async def detokenize(request: Request) -> dict[str, Any]:
        req: P.DetokenizeRequest = await serving.parse(request, P.DetokenizeRequest)
        serving.check_model(req.model)
        serving.check_token_ids(req.tokens, "tokens")
        text = await asyncio.to_thread(tokenizer.decode, req.tokens)
        return P.DetokenizeResponse(prompt=text).model_dump()

    @route(app, "GET", "/tokenizer_info", response_model=P.TokenizerInfoResponse)
    async def tokenizer_info() -> dict[str, Any]:
        def special(name: str) -> str | None:
            value = getattr(tokenizer, name, None)
            return value if isinstance(value, str) else None

        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        info = P.TokenizerInfoResponse(
            tokenizer_class=type(tokenizer).__name__,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            chat_template=template,
            model_max_length=serving.engine.max_model_len,
        )
        return info.model_dump()
