"""Structured output through xgrammar (docs/sampling.md says why this engine).

JSON schemas, any JSON object (the schema ``{"type": "object"}``), regular expressions and EBNF grammars compile
with xgrammar's compiler; ``choice`` becomes an EBNF alternation of JSON-escaped string literals. Compiled
grammars are cached by their spec in xgrammar's own cache, bounded in bytes (``GrammarLimits.cache_bytes``).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import xgrammar as xgr

from leapdecode.sampling_params import StructuredOutputsParams
from leapdecode.structured.base import CompiledGrammar, GrammarMatcher, StructuredOutputBackend, bitmask_to_bool
from leapdecode.structured.limits import GrammarLimits

UNLIMITED_ROLLBACK = -1  # a matcher undoes any number of tokens (drafts of any length)
COMPILE_THREADS = 4  # compiles at once (xgrammar releases the GIL while compiling)


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
    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], limits: GrammarLimits | None = None
    ) -> None:
        self.limits = limits or GrammarLimits()
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # xgrammar's own cache (by spec) holds the compiled grammars, bounded in bytes (least recently used out)
        self._compiler = xgr.GrammarCompiler(
            self._info, max_threads=1, cache_enabled=True, cache_limit_bytes=self.limits.cache_bytes
        )
        self._vocab = vocab_size
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._running: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()  # guards _running only: never held while compiling

    @property
    def cache_limit_bytes(self) -> int:
        return int(self._compiler.cache_limit_bytes)

    def _compile_now(self, params: StructuredOutputsParams) -> CompiledGrammar:
        key = params.key()
        kind, spec = key
        c = self._compiler
        try:
            if kind in ("json", "json_compact"):
                handle = c.compile_json_schema(spec, any_whitespace=kind == "json")
            elif kind == "json_object":  # an object, as OpenAI's json_object means (the builtin takes any value)
                handle = c.compile_json_schema('{"type": "object"}')
            elif kind == "regex":
                handle = c.compile_regex(spec)
            elif kind == "choice":
                handle = c.compile_grammar(choice_grammar(list(params.choice or [])))
            else:
                handle = c.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {e}") from None
        return CompiledGrammar(key, handle)

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        self.limits.check(params)
        key = params.key()
        with self._lock:
            running = self._running.get(key)
            if running is not None:
                return running
            future = self._pool.submit(self._compile_now, params)
            self._running[key] = future
        future.add_done_callback(lambda _: self._done(key, future))
        return future

    def _done(self, key: tuple[str, str], future: Future[CompiledGrammar]) -> None:
        with self._lock:
            if self._running.get(key) is future:
                del self._running[key]

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        future = self.submit(params)
        try:
            return future.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeout:  # (the builtin TimeoutError from Python 3.11 on)
            raise self.limits.timeout_error(params) from None

    def matcher(self, params: StructuredOutputsParams, compiled: CompiledGrammar | None = None) -> GrammarMatcher:
        """A matcher for ``params``' grammar. Thread-safe: the server compiles in worker threads ahead of the
        engine thread and hands it the compiled grammar."""
        compiled = compiled if compiled is not None else self.compile(params)
        return XGrammarMatcher(compiled.handle, self._vocab, self._shifts)

    def to_wire(self, compiled: CompiledGrammar) -> str:
        if compiled.wire is None:
            compiled.wire = compiled.handle.serialize_json()
        return compiled.wire

    def from_wire(self, key: tuple[str, str], wire: str) -> CompiledGrammar:
        return CompiledGrammar(key, xgr.CompiledGrammar.deserialize_json(wire, self._info), wire)


__all__ = ["XGrammarBackend", "XGrammarMatcher", "choice_grammar"]
