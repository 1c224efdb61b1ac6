"""``draft_model`` (speculative/methods/draft_model.py) through the public surface: a separate checkpoint drafting
with its own paged cache, token-identical to plain decoding at batch and across stops, the same distribution when
sampling, a clear error for another tokenizer, and the keys it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.speculative.registry import parse_config

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks, assert_same_distribution


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_tiny(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


@pytest.mark.parametrize("draft", ["self", "other"])
def test_greedy_is_token_identical_at_batch(draft, tiny_model_dir, make_tiny_model, plain_tiny):
    model = tiny_model_dir if draft == "self" else make_tiny_model(seed=1, num_hidden_layers=1)
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=256, block_size=4,
               speculative_config={"method": "draft_model", "model": str(model), "use_cost_model": False})
    params = [SamplingParams(temperature=0, max_tokens=40, speculative=(i % 2 == 0), ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _tokens(plain_tiny, PROMPTS, params)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert all(o.metrics.num_draft_tokens == 0 for o in outs[1::2])  # opted out
    if draft == "self":  # the target drafting for itself: every draft accepted
        assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens for o in outs)
        assert max(o.metrics.mean_accepted_tokens for o in outs) > 2.0
    assert_no_leaks(spec)
    prop = spec.engine.speculator.proposer
    assert not prop.shadows and prop.bm.num_free_blocks == prop.bm.num_blocks  # its own cache freed too


def test_honours_a_stop_inside_an_accepted_run(tiny_model_dir, plain_tiny):
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=256,
               speculative_config={"method": "draft_model", "model": str(tiny_model_dir), "use_cost_model": False,
                                   "num_speculative_tokens": 6})
    base = plain_tiny.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[7]
    first = base.token_ids.index(stop_tok)
    p = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True)
    got = spec.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == base.token_ids[: first + 1] and got.finish_reason == "stop"
    for max_tokens in (1, 5, 11):
        got = spec.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        assert got.token_ids == base.token_ids[:max_tokens]
    assert_no_leaks(spec)


def _perturbed_copy(src, tmp_path):
    """The target with noisy weights: a draft that agrees often but not always (q close to, not equal to, p)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * prm.std() * 0.5)
    out = tmp_path / "draft"
    model.save_pretrained(str(out))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def test_sampling_keeps_plain_decodings_distribution(tiny_model_dir, plain_tiny, tmp_path):
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=1024, speculative_config={
        "method": "draft_model", "model": str(_perturbed_copy(tiny_model_dir, tmp_path)), "use_cost_model": False,
        "num_speculative_tokens": 3})
    assert_same_distribution(plain_tiny, spec)


def test_refuses_a_different_tokenizer(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_tokens([f"<extra_{i}>" for i in range(1000)])
    assert len(tok.get_vocab()) > 49152
    tj = json.loads((other / "tokenizer.json").read_text())
    v = tj["model"]["vocab"]
    keys = list(v)
    v[keys[100]], v[keys[101]] = v[keys[101]], v[keys[100]]  # two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model=str(tiny_model_dir), speculative_config={"method": "draft_model", "model": str(other)})


@pytest.mark.parametrize("key,value", [("prompt_lookup_max", 3), ("tree_nodes", 4), ("top_k", 2)])
def test_refuses_the_keys_it_does_not_read(key, value):
    with pytest.raises(ValueError, match=f"unknown speculative option '{key}' for method 'draft_model'"):
        parse_config({"method": "draft_model", key: value})
