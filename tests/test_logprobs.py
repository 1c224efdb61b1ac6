"""Log-probabilities (SamplingParams.logprobs / prompt_logprobs) against HF transformers' log_softmax on the same
tiny model, and identical with speculation on and off.

Tolerance: 2e-4 absolute on log-probabilities (float32 engine vs float32 HF; the tiny model's widened weights
give logits of a few tens, whose last-bit differences between the two implementations stay below 1e-4)."""

from __future__ import annotations

import math

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.engine import output_assembly

from .conftest import SPEC_PROMPTS, assert_no_leaks

TOL = 2e-4


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


def hf_logits(tiny_hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny_hf(torch.tensor([ids])).logits[0].float()


def check_against(tiny_hf, prompt_ids, out, temperature: float = 1.0, top_k: int = -1) -> None:
    """Each generated token's entry equals HF's log_softmax (after temperature and top-k) at its position."""
    ids = list(prompt_ids) + list(out.token_ids)
    logits = hf_logits(tiny_hf, ids)[len(prompt_ids) - 1 : len(ids) - 1] / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    ref = torch.log_softmax(logits, dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok in entry
        for t, lp in entry.items():
            assert abs(lp.logprob - float(ref[j, t])) < TOL, (j, t, lp.logprob, float(ref[j, t]))
            assert lp.rank == 1 + int((ref[j] > ref[j, t]).sum()) or abs(lp.logprob - float(ref[j].max())) < TOL
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-6)


def test_greedy_logprobs_and_top_k_match_hf(plain, tiny_hf):
    prompt = "The quick brown fox jumps over"
    p = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    out = plain.generate(prompt, p, use_tqdm=False)[0]
    c = out.outputs[0]
    check_against(tiny_hf, out.prompt_token_ids, c)
    ref = torch.log_softmax(hf_logits(tiny_hf, out.prompt_token_ids + c.token_ids), dim=-1)
    for j, entry in enumerate(c.logprobs):
        row = ref[len(out.prompt_token_ids) - 1 + j]
        want = row.topk(3).indices.tolist()
        assert [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)][:3] == want
        assert entry[c.token_ids[j]].rank == 1  # greedy picks the most likely token
        assert all(lp.decoded_token == plain.get_tokenizer().decode([t]) for t, lp in entry.items())
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("temperature,top_k", [(0.7, -1), (1.3, 5)])
def test_sampled_logprobs_are_of_the_distribution_drawn_from(plain, tiny_hf, temperature, top_k):
    p = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=10, logprobs=2, seed=3, ignore_eos=True)
    out = plain.generate("Once upon a time", p, use_tqdm=False)[0]
    check_against(tiny_hf, out.prompt_token_ids, out.outputs[0], temperature, top_k)
    if top_k > 0:  # tokens outside the top-k have probability 0 and are never listed
        assert all(math.isfinite(lp.logprob) for e in out.outputs[0].logprobs for lp in e.values())


def test_logprobs_zero_lists_only_the_sampled_token(plain):
    out = plain.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=0), use_tqdm=False)[0]
    c = out.outputs[0]
    assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]


@pytest.mark.parametrize("chunk, rows", [(512, output_assembly.PROMPT_LOGPROB_ROWS),
                                         (7, output_assembly.PROMPT_LOGPROB_ROWS), (512, 5)])
def test_prompt_logprobs_match_hf_and_score_with_max_tokens_zero(tiny_model_dir, tiny_hf, chunk, rows, monkeypatch):
    monkeypatch.setattr(output_assembly, "PROMPT_LOGPROB_ROWS", rows)  # 5: a prefill chunk scored in several slices
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=256, max_num_batched_tokens=chunk)
    text = "The capital of France is Paris. The capital of Spain is Madrid. The capital of Italy is"
    # the same prompt twice: the second must not take its prompt from the prefix cache (it needs every row)
    for _ in range(2):
        out = llm.generate(text, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
        ids = out.prompt_token_ids
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length" and out.finished
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        ref = torch.log_softmax(hf_logits(tiny_hf, ids), dim=-1)
        for i in range(1, len(ids)):
            entry = out.prompt_logprobs[i]
            assert ids[i] in entry and len(entry) in (2, 3)
            for t, lp in entry.items():
                assert abs(lp.logprob - float(ref[i - 1, t])) < TOL
    assert_no_leaks(llm)


def test_prompt_logprobs_with_generation(plain, tiny_hf):
    p = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=0, logprobs=1)
    out = plain.generate("a b c a b c", p, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    ref = torch.log_softmax(hf_logits(tiny_hf, ids), dim=-1)
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in ids[1:]]
    assert all(abs(e[t].logprob - float(ref[i, t])) < TOL for i, (e, t) in enumerate(zip(out.prompt_logprobs[1:],
                                                                                        ids[1:])))
    check_against(tiny_hf, ids, out.outputs[0])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_logprobs_identical_with_speculation(method, tiny_model_dir, plain, tiny_hf):
    """Greedy: same tokens and same entries (to float tolerance); sampled: every entry is HF's log-probability
    of the speculatively emitted token at its position."""
    cfg = {"method": method, "use_cost_model": False}
    cfg.update({"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram"
               else {"model": str(tiny_model_dir)})
    spec = LLM.from_engine_of(plain, speculative_config=cfg)
    greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    want = plain.generate(SPEC_PROMPTS, greedy, use_tqdm=False)
    got = spec.generate(SPEC_PROMPTS, greedy, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for ew, eg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert ew.keys() == eg.keys()
            assert all(abs(ew[t].logprob - eg[t].logprob) < TOL and ew[t].rank == eg[t].rank for t in ew)
    if method == "draft_model":  # (prompt lookup finds nothing to draft in the random model's samples)
        sampled = SamplingParams(temperature=0.8, max_tokens=16, logprobs=1, seed=11, ignore_eos=True)
        outs = spec.generate(SPEC_PROMPTS, sampled, use_tqdm=False)
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
        for o in outs:
            check_against(tiny_hf, o.prompt_token_ids, o.outputs[0], temperature=0.8)
    assert_no_leaks(spec)
