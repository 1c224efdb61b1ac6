"""Chunked verification (speculator.py, policy.chunk_size): a long chain verified a few drafts per pass, its tail
kept back and resumed without drafting while it still holds; lossless for greedy and sampled requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from scipy.stats import chi2_contingency

from leapdecode import LLM, SamplingParams
from leapdecode.config import SpeculativeConfig
from leapdecode.speculative.policy import StepCostModel, chunk_size
from leapdecode.speculative.state import DraftState

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


def test_chunking_is_a_no_op_for_chains_sized_on_an_edgeless_cost_curve():
    """On by default, so it must cost nothing where it cannot pay: on a flat or linear step cost, a chain of the
    length ``best_gamma`` chose is always verified in one pass."""
    for slope in (0.0, 0.02, 0.15, 1.0):
        cost = StepCostModel([(1, 1.0), (65, 1.0 + 64 * slope)])
        for batch in (1, 4, 16):
            for alpha in [a / 20 for a in range(1, 20)]:
                for cap in range(1, 13):
                    gamma = cost.best_gamma(alpha, cap, batch, batch)
                    assert chunk_size(cost, alpha, gamma, batch) == gamma, (slope, batch, alpha, cap)


def _chunked_config(method: str, tiny_model_dir, **extra) -> dict:
    """6-token chains verified 2 drafts at a time: prompt lookup on short n-grams, or the target as its own draft
    model (every draft holds, so tails are resumed)."""
    cfg = {"method": method, "num_speculative_tokens": 6, "verify_chunk": 2, **extra}
    if method == "ngram":
        cfg.update(prompt_lookup_min=1, prompt_lookup_max=2)
    else:
        cfg["model"] = str(tiny_model_dir)
    return cfg


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_chunked_verification_is_token_identical_greedy(method, tiny_model_dir, plain_tiny):
    cfg = _chunked_config(method, tiny_model_dir, use_cost_model=False)
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


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_kept_tails_inside_grouped_sizing_stay_lossless(method, tiny_model_dir, plain_tiny):
    """At batch 8 with the cost model on (so each step's drafts are sized together), resumed tails enter the plan
    as fixed sizes beside fresh chains; tokens equal plain decoding's."""
    cfg = _chunked_config(method, tiny_model_dir, group_by_acceptance=True)
    spec = LLM.from_engine_of(plain_tiny, speculative_config=cfg)
    sp = spec.engine.speculator
    sp.cost = StepCostModel([(1, 1.0), (65, 1.0)])  # drafting pays, whatever this machine's timing
    if method == "draft_model":
        sp.proposer.step_cost_fn = lambda n: 0.0
    planned: list[int] = []
    plan = sp._plan_group

    def record(batch: int, plan=plan) -> None:
        plan(batch)
        planned.append(len(sp._group))

    sp._plan_group = record
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = spec.generate(PROMPTS * 2, params, use_tqdm=False)
    base = plain_tiny.generate(PROMPTS * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert sp.num_chunked > 0 and max(planned) > 1  # chains split, and steps planned several sequences together
    assert method == "ngram" or sp.num_resumed > 0  # the draft holds every draft: its tails resume
    assert_no_leaks(spec)


def test_a_kept_tail_is_resumed_only_while_it_still_holds(plain_tiny):
    """Greedy output cannot show it (the target checks every token either way): a tail that no longer follows the
    sequence, because a draft was rejected or the target's next token differs from the tail's first, is dropped
    rather than verified for nothing."""
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "verify_chunk": 2,
                                                               "use_cost_model": False})
    sp = spec.engine.speculator
    seq = SimpleNamespace(token_ids=[1, 2, 3, 9], num_tokens=4, draft_state=DraftState())

    def kept(method: str = "ngram") -> DraftState:
        st = seq.draft_state
        st.pending, st.pending_at, st.pending_method, st.method = [9, 5, 6], 4, method, None
        return st

    st = kept()
    assert sp._pending_budget(seq, 10) == 2 and st.method == "ngram" and st.pending == [9, 5, 6]
    kept()
    assert sp._pending_budget(seq, 1) == 1  # no more than the room left
    seq.token_ids[-1] = 8  # the target's token is not the tail's first
    assert sp._pending_budget(seq, 10) == 0 and kept().pending and sp._pending_budget(seq, 10) == 0
    seq.token_ids[-1], seq.num_tokens = 9, 3  # a draft of the verified chunk was rejected
    assert sp._pending_budget(seq, 10) == 0 and seq.draft_state.pending == []
    seq.num_tokens = 4
    kept("eagle")  # a drafter this engine does not run
    assert sp._pending_budget(seq, 10) == 0 and seq.draft_state.pending_method is None
