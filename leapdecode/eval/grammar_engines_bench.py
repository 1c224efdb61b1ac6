"""Micro-benchmark behind the choice of grammar engine (docs/sampling.md): per-token cost of xgrammar, llguidance
and outlines-core with the bundled tokenizer (49,152 tokens).

Run: ``python -m leapdecode.eval.grammar_engines_bench`` (engines that are not installed are skipped; install them
with ``pip install xgrammar llguidance outlines-core``). For a 4-property JSON schema and a 36-token document,
times the schema's compile, then per token: the allowed-token mask, then advancing by the token; best of 3 passes,
each with a fresh matcher.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from leapdecode.models.loader import bundled_model_path
from leapdecode.models.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"],
}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], "ok": True})
VOCAB = 49152
EOS = 2


def _time_passes(new_matcher: Callable[[], Any], step: Callable[[Any, int], None], ids: list[int]) -> float:
    best = float("inf")
    for _ in range(3):
        m = new_matcher()
        t0 = time.perf_counter()
        for t in ids:
            step(m, t)
        best = min(best, (time.perf_counter() - t0) / len(ids))
    return best


def bench_xgrammar(tok: Any, ids: list[int]) -> tuple[float, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)

    def step(m: Any, t: int) -> None:
        m.fill_next_token_bitmask(bitmask)
        assert m.accept_token(t)

    return compile_s, _time_passes(lambda: xgr.GrammarMatcher(compiled), step, ids)


def bench_llguidance(tok: Any, ids: list[int]) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, VOCAB)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, VOCAB)

    def step(m: Any, t: int) -> None:
        llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
        assert m.consume_token(t)

    return compile_s, _time_passes(lambda: llguidance.LLMatcher(lltok, grammar), step, ids)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = dict(zip(keep, keep)), 0
    for b in range(256):
        if b not in chars:
            chars[b], n = 256 + n, n + 1
    return {chr(c): b for b, c in chars.items()}


def bench_outlines_core(tok: Any, ids: list[int]) -> tuple[float, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    decoder = _byte_decoder()
    vocab: dict[Any, list[int]] = {}
    for s, i in tok.get_vocab().items():
        if i != EOS:
            key = bytes(decoder[c] for c in s) if all(c in decoder for c in s) else s
            vocab.setdefault(key, []).append(i)
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), Vocabulary(EOS, vocab))
    compile_s = time.perf_counter() - t0

    def step(g: Any, t: int) -> None:
        allowed = torch.zeros(VOCAB, dtype=torch.bool)
        allowed[torch.tensor(g.get_tokens())] = True
        g.advance(t)

    return compile_s, _time_passes(lambda: Guide(index), step, ids)


ENGINES = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance, "outlines_core": bench_outlines_core}


def main() -> None:
    torch.set_num_threads(1)
    tok = load_tokenizer(bundled_model_path())
    ids = tok.encode(DOC, add_special_tokens=False)
    print(f"{len(ids)}-token document, vocabulary {VOCAB}")
    for name, bench in ENGINES.items():
        if importlib.util.find_spec(name) is None:
            print(f"{name:14s} not installed")
            continue
        compile_s, per_token = bench(tok, ids)
        print(f"{name:14s} compile {compile_s * 1e3:8.1f} ms   mask + advance {per_token * 1e6:9.1f} us per token")


if __name__ == "__main__":
    main()
