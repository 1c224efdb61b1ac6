"""Structured output: constrain a request's tokens to a JSON schema, regex, choice or grammar (base.py: the
interface the engine uses; xgrammar_backend.py: the grammar engine behind it)."""

from __future__ import annotations

import importlib.util
from typing import Any

from leapdecode.structured.base import CompiledGrammar, GrammarMatcher, StructuredOutputBackend
from leapdecode.structured.limits import GrammarLimitError, GrammarLimits

MISSING = (
    "structured output (SamplingParams.structured_outputs) needs the xgrammar package: "
    "pip install 'leapdecode[structured]' (or pip install xgrammar)"
)


def available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def make_backend(
    tokenizer: Any, vocab_size: int, stop_token_ids: list[int], limits: GrammarLimits | None = None
) -> StructuredOutputBackend:
    """The grammar engine for one tokenizer, under ``limits`` (default ``GrammarLimits()``); ImportError with an
    install hint when xgrammar is missing."""
    if not available():
        raise ImportError(MISSING)
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer; this engine was built without one")
    # the optional dependency is imported only when a request asks for structured output
    from leapdecode.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, limits)


__all__ = [
    "CompiledGrammar",
    "GrammarLimitError",
    "GrammarLimits",
    "GrammarMatcher",
    "StructuredOutputBackend",
    "available",
    "make_backend",
]
