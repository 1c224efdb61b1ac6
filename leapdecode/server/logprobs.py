"""Log-probabilities in OpenAI's two shapes, from the engine's per-position ``{token_id: Logprob}`` dicts.

* Chat (``logprobs: true, top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``,
  one entry per generated token; ``top_logprobs`` lists the ``k`` most likely tokens of that position.
* Completions (``logprobs: k``, the legacy format): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  parallel lists over the tokens of the choice's text (with ``echo``, the prompt's tokens first: the first has no
  log-probability, ``null``, as nothing predicts it). ``top_logprobs`` maps token text to log-probability for the
  ``k`` most likely tokens and the chosen one; ``text_offset`` is where each token's text starts in the choice's
  text.

The numbers are the engine's: log-probabilities of the distribution the token was drawn from, after the request's
processors (see docs/sampling.md). ``-inf`` (a token a processor ruled out) is reported as -9999.0, since JSON has
no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from leapdecode.outputs import Logprob, PositionLogprobs

FLOOR = -9999.0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def _ranked(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely entries of one position, most likely first."""
    entries = sorted(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                       -kv[1].logprob))
    return entries[:k]


class LogprobFormatter:
    """Turns engine log-probabilities into OpenAI's shapes; token texts come from the engine when it decoded them,
    else from the tokenizer (one token alone)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int, entry: Logprob | None = None) -> str:
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id])

    def chat(self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs], k: int) -> ChatLogprobs:
        content = []
        for token, position in zip(token_ids, positions, strict=True):
            text = self.text(token, position.get(token))
            top = [
                TopLogprob(token=(t := self.text(tid, lp)), logprob=_finite(lp.logprob), bytes=list(t.encode()))
                for tid, lp in _ranked(position, k)
            ]
            content.append(
                ChatTokenLogprob(
                    token=text, logprob=_finite(position[token].logprob), bytes=list(text.encode()), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)

    def completion(
        self,
        token_ids: Sequence[int],
        positions: Sequence[PositionLogprobs | None],
        k: int,
        offset: int = 0,
    ) -> CompletionLogprobs:
        """``positions[i]`` holds token ``i``'s log-probability (None: the first prompt token); the first token's
        text starts at character ``offset`` of the choice's text."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token, position in zip(token_ids, positions, strict=True):
            text = self.text(token, position.get(token) if position else None)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if position is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_finite(position[token].logprob))
            top = {self.text(tid, lp): _finite(lp.logprob) for tid, lp in _ranked(position, k)}
            top.setdefault(text, _finite(position[token].logprob))  # the chosen token is always listed
            top_logprobs.append(top)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
        )
