"""Presence/frequency penalties, logit_bias, min_tokens, stop strings and n > 1: against a reference written from
the definitions (OpenAI's for the penalties), end to end on a tiny model, and lossless under speculation (greedy
token-identical, sampled equal in distribution)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2_contingency

from leapdecode import LLM, SamplingParams
from leapdecode.engine.sampling import stack_rows
from leapdecode.layers.sampler import RowContext, apply_processors

from .conftest import SPEC_PROMPTS, assert_no_leaks

EOS = 2


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


def reference_processors(logits: torch.Tensor, p: SamplingParams, ctx: list[int], num_prompt: int,
                         stop_ids: set[int]) -> torch.Tensor:
    """The definitions, one token at a time: HF repetition penalty over prompt + output; OpenAI's
    ``logit - count * frequency - (count > 0) * presence`` over the output; bias added; stop tokens at -inf
    until ``min_tokens`` outputs."""
    x = logits.clone().double()
    out = ctx[num_prompt:]
    for t in set(ctx):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= out.count(t) * p.frequency_penalty + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(out) < p.min_tokens:
        for t in stop_ids:
            x[t] = float("-inf")
    return x.float()


def test_processors_match_the_definitions():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.4),
        SamplingParams(logit_bias={3: 5.0, 7: -100}, min_tokens=4),
        SamplingParams(),
    ]
    ctxs = [[1, 2, 3, 4, 5, 5, 5, 9], [4, 4, 6, 6, 6, 1], [9, 9, 2], [3, 3]]
    num_prompt = [3, 2, 1, 1]
    logits = torch.randn(4, vocab, generator=g) * 3
    rows = [RowContext(p, c, n, {2, 11}) for p, c, n in zip(params, ctxs, num_prompt)]
    got = apply_processors(logits, rows)
    for i in range(4):
        want = reference_processors(logits[i], params[i], ctxs[i], num_prompt[i], {2, 11})
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    assert apply_processors(logits, [RowContext(SamplingParams(), [1], 1)]) is logits  # nothing to do: no copy


def test_greedy_penalties_match_a_reference_decoder(plain, tiny_hf):
    p = SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.8, frequency_penalty=0.6,
                       repetition_penalty=1.2, logit_bias={100: 3.0}, ignore_eos=True)
    out = plain.generate("a b c a b c a b", p, use_tqdm=False)[0]
    ids = list(out.prompt_token_ids)
    n = len(ids)
    with torch.no_grad():
        for _ in range(20):
            logits = tiny_hf(torch.tensor([ids])).logits[0, -1]
            ids.append(int(reference_processors(logits, p, ids, n, set()).argmax()))
    assert out.outputs[0].token_ids == ids[n:]
    plain_out = plain.generate("a b c a b c a b", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                               use_tqdm=False)[0]
    assert plain_out.outputs[0].token_ids != ids[n:]  # the penalties changed something


def test_logit_bias_and_min_tokens(plain):
    force_eos = {EOS: 100.0}
    out = plain.generate("Hello", SamplingParams(temperature=0, max_tokens=10, logit_bias=force_eos),
                         use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [EOS] and out.finish_reason == "stop"
    for temperature in (0, 1.0):
        p = SamplingParams(temperature=temperature, max_tokens=10, logit_bias=force_eos, min_tokens=4, seed=1)
        out = plain.generate("Hello", p, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 5 and EOS not in out.token_ids[:4] and out.token_ids[4] == EOS
    out = plain.generate("Hello", SamplingParams(temperature=0, max_tokens=6, logit_bias={77: 100.0}),
                         use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [77] * 6
    with pytest.raises(ValueError, match="logit_bias"):
        plain.generate("Hello", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    # (min_tokens masks the stop ids: one outside the vocabulary would fail the step of every running request)
    with pytest.raises(ValueError, match="stop_token_ids"):
        plain.generate("Hello", SamplingParams(stop_token_ids=[10**6], min_tokens=2), use_tqdm=False)
    assert plain.generate("Hello", SamplingParams(max_tokens=3, min_tokens=2), use_tqdm=False)[0].finished
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 200.0})
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=20, max_tokens=10)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_stop_strings_with_and_without_the_stop_text(plain):
    base = plain.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    cut = base.index(stop)
    for include in (False, True):
        p = SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=include,
                           ignore_eos=True)
        out = plain.generate("The quick brown fox", p, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (base[: cut + len(stop)] if include else base[:cut])


def test_stop_string_before_min_tokens_does_not_stop_a_speculative_run(tiny_model_dir, plain):
    """A stop string whose text appears before ``min_tokens`` does not count, also when a speculative step
    accepts a run reaching past ``min_tokens`` (the drafter is the target itself: every draft is accepted)."""
    spec = LLM.from_engine_of(plain, speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                                         "use_cost_model": False, "num_speculative_tokens": 6})
    prompt = "The quick brown fox"
    base = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    # the text of output tokens 1-2: the first speculative step (after the prefill's token 0) accepts tokens 1-7,
    # a run that passes min_tokens=6 with the stop text inside it
    tok = plain.get_tokenizer()
    before = tok.decode(base.token_ids[:1], skip_special_tokens=True)
    stop = tok.decode(base.token_ids[:3], skip_special_tokens=True)[len(before):].strip()
    assert len(stop) >= 2 and base.text.find(stop) < len(tok.decode(base.token_ids[:3], skip_special_tokens=True))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=6)
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(prompt, params, use_tqdm=False)[0]
    assert got.metrics.num_accepted_tokens > 0
    assert (got.outputs[0].token_ids, got.outputs[0].text) == (want.token_ids, want.text)
    assert len(want.token_ids) >= 6  # min_tokens held in plain decoding too


PROCESSED = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={5: 2.0, 9: -3.0},
                 min_tokens=3)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_is_lossless_with_processors_greedy(method, tiny_model_dir, plain):
    cfg = {"method": method, "use_cost_model": False}
    cfg.update({"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram"
               else {"model": str(tiny_model_dir)})
    spec = LLM.from_engine_of(plain, speculative_config=cfg)
    params = [SamplingParams(temperature=0, max_tokens=30, **PROCESSED),
              SamplingParams(temperature=0, max_tokens=30, presence_penalty=-1.5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, frequency_penalty=-0.5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, logit_bias={2: 4.0}, min_tokens=12)]
    want = plain.generate(SPEC_PROMPTS, params, use_tqdm=False)
    got = spec.generate(SPEC_PROMPTS, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert sum(g.metrics.num_accepted_tokens for g in got) > 0
    assert_no_leaks(spec)


def _last_tokens(llm: LLM, prompt, n: int, seed0: int, **kw) -> tuple[list[int], int, int]:
    """The 4th sampled token of n seeded requests, and the drafts proposed and accepted."""
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=4, seed=seed0 + i, ignore_eos=True, **kw)
              for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    return ([o.outputs[0].token_ids[-1] for o in outs], sum(o.metrics.num_draft_tokens for o in outs),
            sum(o.metrics.num_accepted_tokens for o in outs))


def _same_distribution(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square p-value, rare tokens merged so expected counts stay large enough."""
    vocab = sorted(set(a) | set(b))
    table = [[a.count(v) for v in vocab], [b.count(v) for v in vocab]]
    keep = [i for i in range(len(vocab)) if table[0][i] + table[1][i] >= 10]
    rare = [i for i in range(len(vocab)) if i not in keep]
    rows = [[r[i] for i in keep] + [sum(r[i] for i in rare)] for r in table]
    rows = [[c for c, tot in zip(r, map(sum, zip(*rows))) if tot > 0] for r in rows]
    assert len(rows[0]) > 2, rows
    return float(chi2_contingency(rows).pvalue)


def test_speculation_is_lossless_with_processors_sampled(tiny_model_dir, plain):
    """Two-sample chi-square on the 4th sampled token with penalties on: the drafter (the target itself, without
    the penalties) proposes from q != p, so rejection sampling must use the processed p at every position."""
    spec = LLM.from_engine_of(plain, speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                                         "use_cost_model": False, "num_speculative_tokens": 3})
    prompt = "a b c a b c a b"
    kw = dict(presence_penalty=2.0, frequency_penalty=1.0, logit_bias={5: 3.0})
    a, _, _ = _last_tokens(plain, prompt, 250, 1000, **kw)
    b, drafted, accepted = _last_tokens(spec, prompt, 250, 5000, **kw)
    assert 0 < accepted < drafted  # drafts were verified, and some rejected
    assert _same_distribution(a, b) > 1e-3
    # the penalties do change the distribution, so skipping them in verification would be noticed
    c, _, _ = _last_tokens(spec, prompt, 250, 9000)
    assert _same_distribution(b, c) < 1e-3


# ------------------------------------------------------------------------------------------------------ n
def test_n_completions_seeded_reproducible_and_independent(plain):
    p = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=7, ignore_eos=True)
    out = plain.generate("Once upon a time", p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    texts = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(texts)) == 4  # independent streams
    again = plain.generate("Once upon a time", p, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == texts
    one = plain.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=8, seed=7, ignore_eos=True),
                         use_tqdm=False)[0]
    assert tuple(one.outputs[0].token_ids) == texts[0]  # the first sample keeps the request's own seed
    greedy = plain.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8, n=3), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert_no_leaks(plain)


def test_n_shares_the_prompt_blocks_and_streams_all(plain):
    prompt = "word " * 70  # several full KV blocks
    p = SamplingParams(temperature=1.0, max_tokens=5, n=3, seed=3, logprobs=1, ignore_eos=True)
    out = plain.generate(prompt, p, use_tqdm=False)[0]
    num_prompt = len(out.prompt_token_ids)
    full = num_prompt // plain.config.block_size * plain.config.block_size
    # samples 1 and 2 reuse every full prompt block sample 0 computed (sample 0 may also hit earlier requests)
    assert out.metrics.num_cached_prompt_tokens >= 2 * min(full, num_prompt - 1) - plain.config.block_size
    assert out.metrics.num_output_tokens == 15
    assert all(len(c.logprobs) == 5 and c.cumulative_logprob < 0 for c in out.outputs)
    seen = list(plain.stream(prompt, SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=1)))
    assert all(len(o.outputs) == 2 for o in seen) and seen[-1].finished and not seen[0].finished
    rid = plain.engine.add_request(out.prompt_token_ids, SamplingParams(max_tokens=50, n=3))
    plain.engine.step()
    plain.engine.abort_request(rid)
    assert_no_leaks(plain)


def test_n_with_speculation(tiny_model_dir, plain):
    spec = LLM.from_engine_of(plain, speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                                         "use_cost_model": False})
    p = SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True)
    got = spec.generate(SPEC_PROMPTS[:2], p, use_tqdm=False)
    want = plain.generate(SPEC_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [w.outputs[0].token_ids] * 2
    assert_no_leaks(spec)


def test_tree_verification_applies_the_processors_along_each_path(plain, tmp_path):
    """Hybrid candidate trees (the target itself as trunk drafter, random heads branching beside it): each node's
    row is processed with the tokens on its own path. Greedy: token-identical; seeded sampling: the tree walk
    draws exactly what plain decoding draws; logprobs equal; and with a grammar the masks follow each path."""
    from .conftest import save_random_heads

    heads = save_random_heads(tmp_path / "heads", [1, 1, 1, 2, 2, 3], seed=3, first_head_seed=9)
    spec = LLM.from_engine_of(plain, speculative_config={
        "method": "hybrid", "heads": str(heads), "model": "target", "use_cost_model": False,
        "num_speculative_tokens": 3, "min_draft_prob": 0.0, "branches": 2})
    kinds = [dict(temperature=0), dict(temperature=0.8, top_p=0.95, seed=5)]
    for kw in kinds:
        p = SamplingParams(max_tokens=16, logprobs=1, **kw, **PROCESSED)
        want = plain.generate(SPEC_PROMPTS, p, use_tqdm=False)
        got = spec.generate(SPEC_PROMPTS, p, use_tqdm=False)
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
        # (the sampled run verifies trees too, but the random model's samples rarely match the argmax trunk)
        assert sum(g.metrics.num_accepted_tokens if kw["temperature"] == 0 else g.metrics.num_draft_tokens
                   for g in got) > 0
        for g, w in zip(got, want):
            assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return
    from leapdecode import StructuredOutputsParams

    so = StructuredOutputsParams(regex=r"[^0-9e]{1,400}")
    p = SamplingParams(temperature=0, max_tokens=16, structured_outputs=so)
    want = plain.generate(SPEC_PROMPTS, p, use_tqdm=False)
    got = spec.generate(SPEC_PROMPTS, p, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert sum(g.metrics.num_accepted_tokens for g in got) > 0
    assert_no_leaks(spec)


def test_stack_rows_views_consecutive_rows_and_copies_the_others():
    logits = torch.randn(6, 11)
    rows = [logits[i : i + 1][-1] for i in range(1, 5)]  # a step's decode rows: row i of one forward's logits
    stacked = stack_rows(rows)
    shared = logits.untyped_storage().data_ptr()
    assert torch.equal(stacked, logits[1:5]) and stacked.untyped_storage().data_ptr() == shared
    # not consecutive rows of one tensor: gaps, out of order, another tensor, a strided column
    for other in ([logits[1], logits[3]], [logits[2], logits[1]], [logits[0], torch.randn(11)],
                  [logits[0, :5], logits[0, 6:11]], [logits[:, 0], logits[:, 1]]):
        out = stack_rows(other)
        assert torch.equal(out, torch.stack(other)) and out.untyped_storage().data_ptr() != shared
