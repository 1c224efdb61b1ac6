"""Structured output through xgrammar (docs/sampling.md says why this engine).

JSON schemas, any JSON object (the schema ``{"type": "object"}``), regular expressions and EBNF grammars compile
with xgrammar's compiler; ``choice`` becomes an EBNF alternation of JSON-escaped string literals. Compiled
grammars are cached by their spec.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
import xgrammar as xgr

from leapdecode.sampling_params import StructuredOutputsParams
from leapdecode.structured.base import GrammarMatcher, StructuredOutputBackend, bitmask_to_bool

UNLIMITED_ROLLBACK = -1  # a matcher undoes any number of tokens (drafts of any length)
CACHE_ENTRIES = 64


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: Any, vocab_size: int, shifts: torch.Tensor) -> None:
        self._m = xgr.GrammarMatcher(compiled, max_rollback_tokens=UNLIMITED_ROLLBACK)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab = vocab_size
        self._shifts = shifts

    def allowed_tokens(self) -> torch.Tensor:
        self._m.fill_next_token_bitmask(self._bitmask)
        return bitmask_to_bool(self._bitmask, self._vocab, self._shifts)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF root rule matching exactly one of ``choices`` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XGrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._vocab = vocab_size
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._cache: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()  # compiling and evicting (lookups read the dict without it)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind, spec = params.key()
        c = self._compiler
        if kind in ("json", "json_compact"):
            return c.compile_json_schema(spec, any_whitespace=kind == "json")
        if kind == "json_object":  # an object, as OpenAI's json_object means (the builtin grammar takes any value)
            return c.compile_json_schema('{"type": "object"}')
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(list(params.choice or [])))
        return c.compile_grammar(spec)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A matcher for ``params``' grammar, compiled once per spec. Thread-safe: the server compiles in worker
        threads ahead of the engine thread, which then finds the grammar cached (a hit takes no lock)."""
        key = params.key()
        compiled = self._cache.get(key)
        if compiled is None:
            with self._lock:
                compiled = self._cache.get(key)
                if compiled is None:
                    try:
                        compiled = self._compile(params)
                    except (RuntimeError, ValueError, TypeError) as e:
                        raise ValueError(f"structured_outputs.{key[0]} does not compile: {e}") from None
                    if len(self._cache) >= CACHE_ENTRIES:
                        self._cache.pop(next(iter(self._cache)))
                    self._cache[key] = compiled
        return XGrammarMatcher(compiled, self._vocab, self._shifts)


__all__ = ["XGrammarBackend", "XGrammarMatcher", "choice_grammar"]
