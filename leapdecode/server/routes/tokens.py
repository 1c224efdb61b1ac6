"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's shapes): the model's tokenizer, and
its chat template. ``/tokenize`` answers at most the model's context length in tokens (a 400 beyond it, as a prompt
that long could not run), and tokenizes and builds its answer off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from leapdecode.server import protocol as P
from leapdecode.server.openapi import route
from leapdecode.server.serving import Serving, not_unicode

TOKEN_ERRORS = (400, 404, 408, 413, 500)


def add_routes(app: FastAPI, serving: Serving) -> None:
    tokenizer = serving.engine.tokenizer

    @route(app, "POST", "/tokenize", P.TokenizeRequest, P.TokenizeResponse, TOKEN_ERRORS)
    async def tokenize(request: Request) -> Response:
        req = (await serving.parse(request, P.TokenizeRequest)).root
        serving.check_model(req.model)
        chat = isinstance(req, P.TokenizeChatRequest)
        param = "messages" if chat else "prompt"
        texts = [m["content"] for m in req.conversation()] if chat else [req.prompt]
        serving.check_text_fits(texts, param)  # far too long to fit: refused before tokenizing
        try:
            if chat:
                escape = req.escape_special_tokens
                tokens = await asyncio.to_thread(
                    lambda: serving.llm.apply_chat_template(req.conversation(), escape_special_tokens=escape)
                )
            else:
                special = req.add_special_tokens
                tokens = await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=special)
        except Exception as e:
            why = not_unicode(texts) or str(e)
            raise P.APIError(f"could not tokenize: {why}", param=param) from None
        max_len = serving.engine.max_model_len
        if len(tokens) > max_len:
            raise P.APIError(
                f"the {param} has {len(tokens)} tokens, more than the model's context of {max_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

        def encoded() -> bytes:  # off the event loop: FastAPI would otherwise walk the lists on it
            strs = tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
            answer = P.TokenizeResponse(count=len(tokens), max_model_len=max_len, tokens=tokens, token_strs=strs)
            return answer.model_dump_json().encode()

        return Response(await asyncio.to_thread(encoded), media_type="application/json")

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
