"""Chunked verification (speculator.py, policy.chunk_size): a long chain verified a few drafts per pass, its tail
kept back and resumed without drafting while it still holds; lossless for greedy and sampled requests."""

from __future__ import annotations

import pytest
from scipy.stats import chi2_contingency

from leapdecode import LLM, SamplingParams
from leapdecode.config import SpeculativeConfig
from leapdecode.speculative.policy import StepCostModel, chunk_size

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks


@pytest.fixture(scope="module")
def plain_tiny(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


def test_chunk_size_follows_the_cost_model():
    flat = StepCostModel([(1, 1.0), (65, 1.0)])  # verification rows cost nothing extra (a GPU): never chunk
    assert chunk_size(flat, 0.5, 8, 1) == 8
    assert chunk_size(StepCostModel([(1, 1.0), (65, 65.0)]), 0.9, 3, 1) == 3  # too short to split
    # a step cost that jumps past 4 rows (a kernel's tile edge): at middling acceptance verify 3, keep the rest
    jump = StepCostModel([(1, 1.0), (4, 1.05), (5, 3.0), (9, 3.2), (65, 8.0)])
    assert chunk_size(jump, 0.5, 8, 1) == 3
    assert chunk_size(jump, 0.99, 8, 1) == 8  # nearly always accepted: one pass beats two


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_chunked_verification_is_token_identical_greedy(method, tiny_model_dir, plain_tiny):
    cfg = {"method": method, "num_speculative_tokens": 6, "verify_chunk": 2, "use_cost_model": False}
    if method == "ngram":
        cfg.update(prompt_lookup_min=1, prompt_lookup_max=2)
    else:
        cfg["model"] = str(tiny_model_dir)  # the target as its own draft: every draft holds, tails are resumed
    spec = LLM.from_engine_of(plain_tiny, speculative_config=cfg)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    base = plain_tiny.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    sp = spec.engine.speculator
    assert sp.num_chunked > 0 and (method == "ngram" or sp.num_resumed > 0)  # tails resume when they still hold
    assert all(o.metrics.num_draft_tokens <= 2 * o.metrics.num_target_steps for o in outs)  # 2 drafts per pass
    assert_no_leaks(spec)
    with pytest.raises(ValueError, match="verify_chunk"):
        SpeculativeConfig.from_dict({"method": "ngram", "verify_chunk": -1})


def test_chunked_verification_keeps_the_sampling_distribution(tiny_model_dir, plain_tiny):
    """Two-sample chi-square of the token sampled after a resumed tail, against plain sampling."""
    spec = LLM.from_engine_of(plain_tiny, speculative_config={
        "method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 5, "verify_chunk": 2,
        "use_cost_model": False})
    prompt = {"prompt_token_ids": plain_tiny.get_tokenizer().encode("a b c a b c a b")}
    n = 200

    def last(llm, seed0):
        params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=8, seed=seed0 + i, ignore_eos=True)
                  for i in range(n)]
        return [o.outputs[0].token_ids[-1] for o in llm.generate([prompt] * n, params, use_tqdm=False)]

    plain, specd = last(plain_tiny, 1000), last(spec, 5000)
    assert spec.engine.speculator.num_resumed > 0
    vocab = sorted(set(plain) | set(specd))
    table = [[plain.count(v) for v in vocab], [specd.count(v) for v in vocab]]
    keep = [i for i in range(len(vocab)) if table[0][i] + table[1][i] >= 10]
    rows = [[r[i] for i in keep] + [sum(r[i] for i in range(len(vocab)) if i not in keep)] for r in table]
    rows = [[c for c, tot in zip(r, map(sum, zip(*rows))) if tot > 0] for r in rows]
    assert chi2_contingency(rows).pvalue > 1e-3, rows
    assert_no_leaks(spec)
