"""Structured output (SamplingParams.structured_outputs): JSON schema, any JSON object, regex, choice and EBNF
grammar on a tiny random model (whose unconstrained text is gibberish, so every valid output is the mask's
doing), composed with speculation (greedy token-identical to plain constrained decoding), n > 1 and logprobs."""

from __future__ import annotations

import json
import re

import pytest

from leapdecode import LLM, SamplingParams, StructuredOutputsParams

from .conftest import SPEC_PROMPTS, assert_no_leaks

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
# a random model given free whitespace between JSON tokens may emit whitespace forever
COMPACT = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


def _gen(llm: LLM, so: StructuredOutputsParams, prompts=("Hello",), **kw):
    p = SamplingParams(**{"temperature": 0, "max_tokens": 60, **kw}, structured_outputs=so)
    return [o.outputs[0] for o in llm.generate(list(prompts), p, use_tqdm=False)]


def test_each_kind_constrains_the_output(plain):
    for c in _gen(plain, COMPACT, SPEC_PROMPTS):
        doc = json.loads(c.text)
        assert c.finish_reason == "stop" and set(doc) == {"ok", "color"}
        assert isinstance(doc["ok"], bool) and doc["color"] in ("red", "green", "blue")
    text_schema = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    for c in _gen(plain, text_schema, SPEC_PROMPTS[:1], temperature=1.0, seed=2):
        assert json.loads(c.text)["color"] in ("red", "green", "blue")
    for c in _gen(plain, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), SPEC_PROMPTS, temperature=1.0, seed=4):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text), c.text
    choices = ["apple pie", "banana", "cherry tart"]
    for c in _gen(plain, StructuredOutputsParams(choice=choices), SPEC_PROMPTS, temperature=1.0, seed=5):
        assert c.text in choices and c.finish_reason == "stop"
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    for c in _gen(plain, StructuredOutputsParams(grammar=grammar), SPEC_PROMPTS, temperature=1.0, seed=6):
        assert re.fullmatch(r"yes|no|maybe [0-9]", c.text), c.text
    c = _gen(plain, StructuredOutputsParams(json_object=True), max_tokens=200)[0]
    if c.finish_reason == "stop":  # a random model may still be inside a long string at max_tokens
        assert isinstance(json.loads(c.text), dict)
    else:
        assert c.text.lstrip().startswith("{")
    assert_no_leaks(plain)


def test_bad_constraints_are_clear_errors(plain):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="json"):
        StructuredOutputsParams(json="{not json")
    deep: dict = {}
    for _ in range(100_000):  # JSON nested past the parser's recursion limit, as text or as a dict
        deep = {"items": deep}
    for schema in ("[" * 50_000 + "]" * 50_000, deep):
        with pytest.raises(ValueError, match="nested too deeply"):
            StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError, match="JSON data"):
        StructuredOutputsParams(json={"type": {1, 2}})
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="does not compile"):
        _gen(plain, StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="does not compile"):
        _gen(plain, StructuredOutputsParams(grammar="root ::= undefined_rule"))
    assert_no_leaks(plain)


def test_missing_grammar_engine_is_a_clear_error(plain, monkeypatch):
    import leapdecode.structured as structured

    monkeypatch.setattr(structured, "available", lambda: False)
    fresh = LLM.from_engine_of(plain)
    with pytest.raises(ImportError, match=r"leapdecode\[structured\]"):
        _gen(fresh, StructuredOutputsParams(choice=["a"]))


def test_masks_along_drafts_roll_back(plain):
    backend = plain.engine.structured_backend()
    so = StructuredOutputsParams(json=SCHEMA)
    tok = plain.get_tokenizer()
    ids = tok.encode('{"ok": true, "color": "red"}', add_special_tokens=False)
    m = backend.matcher(so)
    masks = m.masks_along(ids + [ids[0]])  # the last token breaks the grammar
    step = backend.matcher(so)
    for i, t in enumerate(ids):
        assert bool((step.allowed_tokens() == masks[i]).all()), i
        assert step.accept(t)
    assert bool((step.allowed_tokens() == masks[len(ids)]).all())
    assert bool((masks[-1] == masks[-2]).all())  # unreachable position: the last reachable mask
    assert bool((m.allowed_tokens() == masks[0]).all())  # rolled back to the start
    assert m.mask_after(ids[:3]) is not None and m.mask_after([ids[1]]) is None
    assert bool((m.allowed_tokens() == masks[0]).all())


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_composes_with_the_grammar(method, tiny_model_dir, plain):
    """Drafts are checked against the mask at each position and the matcher follows only accepted tokens:
    greedy constrained output is token-identical with and without speculation, sampled output stays valid."""
    cfg = {"method": method, "use_cost_model": False}
    cfg.update({"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram"
               else {"model": str(tiny_model_dir)})
    spec = LLM.from_engine_of(plain, speculative_config=cfg)
    accepted = 0
    for so in (COMPACT,
               StructuredOutputsParams(regex=r"(ab|a b c ){2,6}[0-9]"),
               StructuredOutputsParams(regex=r"[^0-9e]{1,400}")):  # loose: an unconstrained drafter often fits
        want = _gen(plain, so, SPEC_PROMPTS, logprobs=1)
        outs = spec.generate(SPEC_PROMPTS, SamplingParams(temperature=0, max_tokens=60, logprobs=1,
                                                          structured_outputs=so), use_tqdm=False)
        accepted += sum(o.metrics.num_accepted_tokens for o in outs)
        got = [o.outputs[0] for o in outs]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want):
            assert [e.keys() for e in g.logprobs] == [e.keys() for e in w.logprobs]
            assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3
    assert accepted > 0  # drafts that fit the grammar were kept, the matcher advanced along them
    if method == "draft_model":
        outs = spec.generate(SPEC_PROMPTS, SamplingParams(temperature=1.0, max_tokens=60, seed=1, n=2,
                                                          structured_outputs=COMPACT),
                             use_tqdm=False)
        # the unconstrained drafter proposes tokens outside the grammar: rejected (probability 0 under the mask)
        assert sum(o.metrics.num_accepted_tokens for o in outs) < sum(o.metrics.num_draft_tokens for o in outs)
        for o in outs:
            assert len(o.outputs) == 2
            for c in o.outputs:
                assert json.loads(c.text)["color"] in ("red", "green", "blue")
    assert_no_leaks(spec)


def test_sampled_choice_has_the_same_distribution_with_speculation(plain):
    """Chi-square over which choice 150 seeded requests pick, plain vs prompt lookup (whose drafts come from the
    prompt, where the choices' tokens appear, so drafts inside a choice are accepted)."""
    from scipy.stats import chi2_contingency

    spec = LLM.from_engine_of(plain, speculative_config={"method": "ngram", "use_cost_model": False,
                                                         "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    choices = ["apple pie with cream", "banana split", "cherry tart and tea"]
    prompt = "apple pie with cream, banana split, cherry tart and tea. " * 2
    so = StructuredOutputsParams(choice=choices)

    def picks(llm: LLM, seed0: int) -> tuple[list[int], int]:
        params = [SamplingParams(temperature=1.0, max_tokens=40, seed=seed0 + i, structured_outputs=so)
                  for i in range(150)]
        outs = llm.generate([prompt] * 150, params, use_tqdm=False)
        return [choices.index(o.outputs[0].text) for o in outs], sum(o.metrics.num_accepted_tokens for o in outs)

    a, _ = picks(plain, 0)
    b, accepted = picks(spec, 10_000)
    assert accepted > 0
    table = [[a.count(i) for i in range(3)], [b.count(i) for i in range(3)]]
    table = [[r[i] for i in range(3) if table[0][i] + table[1][i] > 0] for r in table]
    assert len(table[0]) >= 2 and chi2_contingency(table).pvalue > 1e-3, table
    assert_no_leaks(spec)
