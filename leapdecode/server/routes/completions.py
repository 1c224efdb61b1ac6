"""``POST /v1/completions``: text prompts or token ids (one or a batch), completed as is (no chat template).

With ``echo`` each choice's text starts with its prompt; with ``logprobs: k`` it carries OpenAI's legacy
log-probabilities (with ``echo``, the prompt's tokens first). ``max_tokens: 0`` with ``echo`` scores the prompt
without generating (what evaluation harnesses send for log-likelihoods).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from leapdecode.server import protocol as P
from leapdecode.server.async_engine import ChoiceSnapshot, StreamOutput
from leapdecode.server.logprobs import CompletionLogprobs, LogprobFormatter
from leapdecode.server.openapi import route
from leapdecode.server.serving import COMPLETION_ERRORS, Serving, not_unicode
from leapdecode.server.streaming import Delta


def add_routes(app: FastAPI, serving: Serving) -> None:
    name = serving.name
    tokenizer = serving.engine.tokenizer
    formatter = LogprobFormatter(tokenizer)

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
        with serving.admission() as admitted:  # the queue cap, before tokenizing and compiling
            prompts = [await encode(p) for p in req.prompts()]
            extra = {"logprobs": req.logprobs, "prompt_logprobs": req.prompt_logprobs()}
            params = [serving.sampling_params(req, len(tokens), "prompt", **extra) for tokens, _ in prompts]
            echoed = [text if text is not None else tokenizer.decode(tokens) for tokens, text in prompts]
            streams = await serving.submit_all(prompts, params, "prompt", admitted)
        rid, ts = P.random_id("cmpl"), P.now_s()
        n = req.n or 1
        token_chars: dict[int, int] = {}  # per choice: the text of the tokens streamed so far, where the next starts

        def logprobs(out: StreamOutput, c: ChoiceSnapshot, start: int, echo: bool, offset: int) -> CompletionLogprobs:
            tokens, positions = list(c.token_ids[start:]), list(c.logprobs[start:] if c.logprobs else ())
            if echo:
                tokens = list(out.prompt_token_ids) + tokens
                positions = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + positions
            return formatter.completion(tokens, positions, req.logprobs or 0, offset)

        def chunk(delta: Delta) -> dict[str, Any]:
            text, lp = delta.text or "", None
            if not delta.first and delta.choice is not None and delta.output is not None:
                echo = req.echo and delta.tokens_from == 0  # the choice's first chunk after the opening one
                if echo:
                    text = echoed[delta.index // n] + text
                if req.logprobs is not None:
                    start = token_chars.get(delta.index, 0)
                    lp = logprobs(delta.output, delta.choice, delta.tokens_from, echo, start)
                    token_chars[delta.index] = start + sum(len(t) for t in lp.tokens)
            choice = P.CompletionChoice(index=delta.index, text=text, logprobs=lp, finish_reason=delta.finish_reason)
            return P.CompletionResponse(id=rid, created=ts, model=name, choices=[choice]).model_dump()

        def body(finals: list[StreamOutput]) -> P.CompletionResponse:
            choices = []
            for k, out in enumerate(finals):
                for c in out.choices:
                    lp = logprobs(out, c, 0, req.echo, 0) if req.logprobs is not None else None
                    text = echoed[k] + c.text if req.echo else c.text
                    choices.append(
                        P.CompletionChoice(index=k * n + c.index, text=text, logprobs=lp, finish_reason=c.finish_reason)
                    )
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
