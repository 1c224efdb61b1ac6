"""``ngram`` (prompt lookup, speculative/methods/ngram.py) through the public surface: ``LLM`` output identical to
plain decoding (greedy at batch, the same distribution when sampling), what it proposes, the state it keeps per
request, and the keys it refuses."""

from __future__ import annotations

import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.engine.sequence import Sequence
from leapdecode.speculative.methods.ngram import NgramProposer
from leapdecode.speculative.registry import parse_config

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks, assert_same_distribution


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_tiny(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


def test_proposes_what_followed_the_latest_match():
    prop = NgramProposer(min_n=1, max_n=3)
    params = SamplingParams(max_tokens=8)
    seq = Sequence("a", [7, 8, 9, 4, 7, 8, 9, 5, 6, 7, 8], params)  # (7, 8) last seen before 9, 5, 6
    assert prop.propose([seq], [3])[0].tokens == [9, 5, 6]
    assert prop.propose([seq], [0])[0].tokens == []
    fresh = Sequence("b", [1, 2, 3], params)
    assert not prop.has_draft(fresh) and prop.propose([fresh], [4])[0].tokens == []
    assert set(prop.indexes) == {"a", "b"}  # its own state, by request id
    prop.release(seq)
    assert set(prop.indexes) == {"b"}


def test_greedy_is_token_identical_at_batch_and_frees_its_state(tiny_model_dir, plain_tiny):
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "use_cost_model": False,
                                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                              block_size=4)
    # mixed opt-outs in one batch
    params = [SamplingParams(temperature=0, max_tokens=40, speculative=(i % 2 == 0), ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _tokens(plain_tiny, PROMPTS, params)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert all(o.metrics.num_draft_tokens == 0 for o in outs[1::2])  # opted out
    assert not spec.engine.speculator.proposer.indexes  # every request's index freed when it finished
    assert_no_leaks(spec)


def test_sampling_keeps_plain_decodings_distribution(plain_tiny):
    """Two-sample chi-square over one sampled position, many seeds, in a context prompt lookup drafts from."""
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "use_cost_model": False,
                                                              "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                                              "num_speculative_tokens": 3}, kv_cache_blocks=1024)
    assert_same_distribution(plain_tiny, spec)


def test_seeded_sampling_is_plain_samplings_own_tokens_at_any_batch(plain_tiny):
    """A chain of deterministic drafts is verified by drawing the target's token at each position (plain
    sampling's draws, in order), so a seeded request gets plain sampling's tokens whatever its drafts were, batched
    or alone (rejection sampling's uniform draws made them depend on how many drafts each step carried)."""
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "use_cost_model": False,
                                                              "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    # prompts of what the model tends to sample, so prompt lookup's drafts are accepted now and then
    own = _tokens(plain_tiny, ["a b c a b c a b"] * 12,
                  [SamplingParams(temperature=1.0, top_k=2, max_tokens=6, seed=i, ignore_eos=True) for i in range(12)])
    prompts = [{"prompt_token_ids": [t for w in own[i:] + own[:i] for t in w]} for i in range(8)]
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=24, seed=11 + i, ignore_eos=True)
              for i in range(len(prompts))]
    want = _tokens(plain_tiny, prompts, params)
    batched = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == want
    assert sum(o.metrics.num_accepted_tokens for o in batched) > 0
    assert [_tokens(spec, [p], [sp])[0] for p, sp in zip(prompts[:3], params)] == want[:3]
    assert_no_leaks(spec)


@pytest.mark.parametrize("key,value", [("draft_linear_kernel", "packed-int8act"), ("model", "x"),
                                       ("min_draft_prob", 0.1), ("tree_nodes", 4)])
def test_refuses_the_keys_it_does_not_read(key, value):
    with pytest.raises(ValueError, match=f"unknown speculative option '{key}' for method 'ngram'"):
        parse_config({"method": "ngram", key: value})


def test_half_precision_model_on_a_cpu_warns_that_rounding_can_change_tokens(tiny_model_dir, recwarn):
    """A bfloat16 model on a CPU runs torch's matmuls, whose bits depend on the rows of a step: speculation says
    so when it starts (at load and when switched on); the float32 default does not warn."""
    with pytest.warns(UserWarning, match="rounding"):
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_blocks=32,
                  speculative_config={"method": "ngram"})
    with pytest.warns(UserWarning, match="rounding"):
        llm.engine.set_speculative_config({"method": "ngram"})
    recwarn.clear()
    LLM(model=str(tiny_model_dir), kv_cache_blocks=32, speculative_config={"method": "ngram"})
    assert not [w for w in recwarn if "rounding" in str(w.message)]
