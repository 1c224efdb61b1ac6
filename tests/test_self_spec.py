"""Self-speculation (target layers [0, L) + exit adapter + shared LM head): lossless, shares the target's KV and
hidden states instead of recomputing the shared layers, no leaks, and its training command lowers its loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.cli import main
from leapdecode.models.loader import load_model
from leapdecode.speculative import artifacts
from leapdecode.speculative.artifacts import load_adapter, save_adapter
from leapdecode.speculative.exit_adapter import ExitAdapter
from leapdecode.speculative.methods.self_spec import SelfSpecProposer

from .conftest import assert_no_leaks, distill_tiny, layer_row_counters

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3",
    "Summarize: Paris is the capital of France. Paris is known for the Eiffel Tower.",
    "a b c a b c a b",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny4, tmp_path_factory) -> dict[str, Path]:
    """``exact``: L=3 with the adapter a copy of the last layer (the draft *is* the target: every draft is
    accepted, which exercises the fully-accepted catch-up); ``rough``: L=2 from layer 2, untrained (mixed
    acceptance, which exercises rollback)."""
    model, _ = load_model(tiny4)
    out = {}
    for name, layer, init in [("exact", 3, "last"), ("rough", 2, "next")]:
        d = tmp_path_factory.mktemp(f"adapter_{name}")
        save_adapter(ExitAdapter.from_target(model, layer, init), d, model, {})
        out[name] = d
    return out


@pytest.fixture(scope="module")
def want(plain4) -> list[list[int]]:
    return _tokens(plain4, PROMPTS, GREEDY)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _spec_llm(plain: LLM, adapter: Path, **kw) -> LLM:
    # float32 drafting: the exact adapter must reproduce the target (int8 drafting is tested in test_feature_draft)
    cfg = {"method": "self_spec", "model": str(adapter), "use_cost_model": False, "min_draft_prob": 0.0,
           "draft_precision": "float32"}
    overrides = {k: kw.pop(k) for k in ("kv_cache_blocks", "block_size", "max_num_seqs") if k in kw}
    return LLM.from_engine_of(plain, speculative_config={**cfg, **kw}, **{"kv_cache_blocks": 256, **overrides})


# ------------------------------------------------------------------------------------------------ the adapter
@pytest.mark.parametrize("num_layers", [1, 2])
def test_dense_training_forward_matches_the_paged_inference_forward(tiny4, num_layers: int):
    """The training forward (dense causal attention) and the engine's (paged cache, flat batch) agree."""
    from leapdecode.engine.block_manager import BlockManager
    from leapdecode.engine.kv_cache import KVCache
    from leapdecode.engine.model_runner import ForwardItem, ModelRunner
    from leapdecode.speculative.shadow_cache import Shadow

    model, cfg = load_model(tiny4)
    adapter = ExitAdapter.from_target(model, 2, "next", num_layers)
    lens = [7, 3]
    h = torch.randn(2, 7, cfg.hidden_size) * 3
    dense = adapter.forward_dense(h, model.rope.table(torch.arange(7), h.dtype))
    from dataclasses import replace

    kv = KVCache(replace(cfg, num_hidden_layers=num_layers), 8, 4, torch.float32, torch.device("cpu"))
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    runner = ModelRunner(model, kv, 4, torch.device("cpu"))
    shadows = [Shadow(), Shadow()]
    for sh, n in zip(shadows, lens):
        bm.allocate(sh, n)
    items = [ForwardItem(sh.block_table, 0, [0] * n, list(range(n))) for sh, n in zip(shadows, lens)]
    _, pos, meta, _ = runner.prepare(items)
    flat = torch.cat([h[0, :7], h[1, :3]])
    with torch.no_grad():
        paged = adapter(flat, model.rope.table(pos, flat.dtype), kv.layers, meta)
    torch.testing.assert_close(paged[:7], dense[0, :7], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(paged[7:], dense[1, :3], atol=1e-4, rtol=1e-4)


def test_adapter_roundtrip_and_compatibility_checks(tiny4, adapters, make_tiny_model):
    model, _ = load_model(tiny4)
    loaded, cfg, ranked = load_adapter(adapters["exact"], model)
    assert cfg["layer"] == 3 and ranked is None
    torch.testing.assert_close(loaded.layers[0].mlp.down_proj.weight, model.layers[3].mlp.down_proj.weight)
    other, _ = load_model(make_tiny_model(num_hidden_layers=4, hidden_size=32, intermediate_size=64))
    with pytest.raises(ValueError, match="another model architecture"):
        load_adapter(adapters["exact"], other)
    with pytest.raises(ValueError, match="exit layer"):
        ExitAdapter.from_target(model, 4)


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("name", ["exact", "rough"])
def test_self_spec_is_token_identical_and_never_recomputes_shared_layers(name, adapters, plain4, want):
    spec = _spec_llm(plain4, adapters[name], block_size=4)
    prop: SelfSpecProposer = spec.engine.speculator.proposer
    L = prop.num_shared_layers
    model = spec.engine.model
    counts, handles = layer_row_counters(model)
    try:
        outs = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        for hd in handles:
            hd.remove()
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted > 0
    if name == "exact":
        assert accepted == drafted  # the draft is the target: every draft accepted (the catch-up path)
        assert max(o.metrics.mean_accepted_tokens for o in outs) > 2.0
    else:
        assert accepted < drafted  # some rejected: the rollback path
    target_rows = spec.engine.runner.num_forward_tokens
    # per chain of k drafts the drafter feeds exactly k tokens (the last committed one and k-1 drafts) through
    # layers [0, L): prompts and accepted tokens are never run through them again
    for i in range(L):
        assert counts[i] - target_rows == drafted, (i, counts[i], target_rows, drafted)
    for i in range(L, len(model.layers)):
        assert counts[i] == target_rows  # the drafter never touches the target's own layers
    assert prop.num_shared_tokens == drafted
    assert prop.num_fallback_tokens == 0
    # everything the adapter saw came from drafting or from the target's captured hidden states
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert prop.num_catchup_tokens >= prompt_tokens
    assert prop.num_adapter_tokens == prop.num_catchup_tokens + drafted
    assert_no_leaks(spec)
    assert not prop.shadows
    assert prop.adapter_bm.num_free_blocks == prop.adapter_bm.num_blocks


def test_batch_mixing_opt_outs_and_preemption(adapters, plain4):
    """Mixed speculative opt-outs in one batch and a KV pool small enough to preempt: still token-identical
    (after a preemption the drafter rebuilds from the target's recomputed hidden states), nothing leaks."""
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, speculative=(i % 3 != 1))
              for i in range(6)]
    prompts = PROMPTS + PROMPTS[:2]
    want = _tokens(plain4, prompts, params)
    spec = _spec_llm(plain4, adapters["exact"], block_size=4, kv_cache_blocks=60)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for i, o in enumerate(outs):
        assert (o.metrics.num_draft_tokens == 0) == (i % 3 == 1)
    prop = spec.engine.speculator.proposer
    assert prop.num_fallback_tokens == 0
    assert_no_leaks(spec)
    assert prop.adapter_bm.num_free_blocks == prop.adapter_bm.num_blocks


def test_min_draft_prob_stops_drafting_early(adapters, plain4, want):
    never = _spec_llm(plain4, adapters["rough"], min_draft_prob=1.0)
    assert _tokens(never, PROMPTS, GREEDY) == want
    assert never.engine.stats.num_draft_tokens == 0
    assert_no_leaks(never)
    # the tiny random model is nearly uniform over 49k tokens: take the threshold from the draft's own top
    # probabilities (their median), so about half the draft steps fall below it
    probe = _spec_llm(plain4, adapters["rough"])
    prop = probe.engine.speculator.proposer
    tops: list[float] = []
    logits_fn = prop._subset_logits

    def recording(h):
        out = logits_fn(h)
        tops.extend(torch.softmax(out[0], dim=-1).max(dim=-1).values.tolist())
        return out

    prop._subset_logits = recording
    probe.generate(PROMPTS, GREEDY, use_tqdm=False)
    some = _spec_llm(plain4, adapters["rough"], min_draft_prob=sorted(tops)[len(tops) // 2])
    outs = some.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    prop = some.engine.speculator.proposer
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    # a chain cut short fed one row (the unconfident step) that yielded no draft
    assert 0 < drafted < prop.num_shared_tokens
    assert_no_leaks(some)


def test_sampling_with_self_spec_runs_and_accepts(adapters, plain4):
    spec = _spec_llm(plain4, adapters["exact"])
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=i, ignore_eos=True) for i in range(4)]
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert_no_leaks(spec)


def test_config_errors_and_auto_uses_a_shipped_adapter_only_for_its_target(adapters, plain4, tiny4, want,
                                                                            monkeypatch, tmp_path):
    monkeypatch.setattr(artifacts, "SELF_SPEC_DIR", tmp_path / "none")
    with pytest.raises(ValueError, match="needs a trained drafter"):
        LLM.from_engine_of(plain4, speculative_config={"method": "self_spec"})
    with pytest.raises(ValueError, match="min_draft_prob"):
        _spec_llm(plain4, adapters["exact"], min_draft_prob=2)
    auto = LLM.from_engine_of(plain4, speculative_config={"method": "auto"}, kv_cache_blocks=256)
    assert "self_spec" not in auto.engine.speculator.proposers
    monkeypatch.setattr(artifacts, "SELF_SPEC_DIR", adapters["exact"])  # "ship" an adapter for this target
    auto = LLM.from_engine_of(plain4, speculative_config={"method": "auto"}, kv_cache_blocks=256)
    assert set(auto.engine.speculator.proposers) == {"ngram", "suffix", "recycling", "self_spec"}
    assert _tokens(auto, PROMPTS, GREEDY) == want
    assert_no_leaks(auto)
    default = LLM.from_engine_of(plain4, speculative_config={"method": "self_spec", "use_cost_model": False},
                                 kv_cache_blocks=256)
    assert default.engine.speculator.proposer.num_shared_layers == 3
    # an adapter whose measured agreement cannot pay for its step cost: auto leaves it out and stops the capture
    poor = tmp_path / "poor"
    poor.mkdir()
    for f in adapters["exact"].iterdir():
        if f.name != "checksums.json":  # edited by hand below: a folder without a manifest loads as before
            (poor / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((poor / "config.json").read_text())
    cfg["validation"] = {"agree": 0.02, "agree_confident": 0.02}
    (poor / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(artifacts, "SELF_SPEC_DIR", poor)
    auto = LLM.from_engine_of(plain4, speculative_config={"method": "auto"}, kv_cache_blocks=256)
    assert set(auto.engine.speculator.proposers) == {"ngram", "suffix", "recycling"}
    assert auto.engine.speculator.dropped == {"self_spec": 0.02}
    assert not auto.engine.runner.captures
    assert _tokens(auto, PROMPTS, GREEDY) == want


# ------------------------------------------------------------------------------------------------- training
def test_train_self_spec_lowers_its_loss_resumes_and_loads(tiny4, plain4, want, tmp_path, capsys):
    topics = ["the sea", "cats", "numbers", "gravity", "colors", "the sky", "bread", "Hamlet"]
    data = distill_tiny(tiny4, tmp_path, topics)
    out = tmp_path / "adapter"
    args = ["train", "self-spec", "--data", str(data), "--layer", "2", "--model", str(tiny4), "--out", str(out),
            "--batch-tokens", "256", "--vocab-subset", "4096", "--val-fraction", "0.25", "--lr", "3e-3",
            "--warmup", "2", "--hard-weight", "0.5"]
    assert main([*args, "--epochs", "2"]) == 0
    rec = json.loads((out / "record.json").read_text())
    assert rec["command"].startswith("leapdecode train self-spec --layer 2 --adapter-layers 1 ")
    assert rec["data"]["manifest"]["num_prompts"] == len(topics) and rec["seed"] == 0
    assert main([*args, "--epochs", "4"]) == 0  # resumes from the checkpoint: two more epochs
    assert "resuming from" in capsys.readouterr().out
    rec = json.loads((out / "record.json").read_text())
    hist = rec["history"]
    assert rec["resumed"] and [h["epoch"] for h in hist] == [0, 1, 2, 3, 4]
    assert hist[-1]["train_loss"] < hist[1]["train_loss"]
    assert min(h["val_loss"] for h in hist[1:]) < hist[0]["val_loss"]
    assert 0.0 <= hist[-1]["agree"] <= 1.0 and "agree_subset_head" in hist[-1]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer"] == 2 and cfg["loss_vocab"] == 4096
    # the artifact drives self-speculation, also with the ranked-vocabulary head
    for extra in ({}, {"draft_vocab": 4096}):
        spec = _spec_llm(plain4, out, **extra)
        assert _tokens(spec, PROMPTS, GREEDY) == want
        assert spec.engine.stats.num_draft_tokens > 0
        assert_no_leaks(spec)


def test_train_draft_distils_a_small_draft_that_draft_model_runs_losslessly(tiny4, plain4, want, tmp_path,
                                                                             monkeypatch):
    """`leapdecode train draft-model`: N layers over the target's own embedding with its norm and LM head (an adapter
    with no shared layers) lowers its loss and writes an artifact that `draft_model` drafts with -- by path, and
    without one when it is the shipped draft -- token-identical to plain decoding, capturing nothing but the
    embeddings from the target's passes."""
    data = distill_tiny(tiny4, tmp_path, ["cats", "rivers", "clocks", "bread", "snow", "maps"])
    out = tmp_path / "draft"
    assert main(["train", "draft-model", "--data", str(data), "--layers", "2", "--model", str(tiny4), "--out", str(out),
                 "--batch-tokens", "256", "--vocab-subset", "4096", "--val-fraction", "0.25", "--lr", "3e-3",
                 "--warmup", "2", "--epochs", "3", "--no-estimate"]) == 0
    rec = json.loads((out / "record.json").read_text())
    assert rec["command"].startswith("leapdecode train draft-model --layers 2 ")
    hist = rec["history"]
    assert hist[-1]["train_loss"] < hist[1]["train_loss"] and min(h["val_loss"] for h in hist[1:]) < hist[0]["val_loss"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer"] == 0 and cfg["num_layers"] == 2
    spec = LLM.from_engine_of(plain4, speculative_config={"method": "draft_model", "model": str(out),
                                                          "use_cost_model": False, "min_draft_prob": 0.0},
                              kv_cache_blocks=256)
    prop = spec.engine.speculator.proposer
    assert isinstance(prop, SelfSpecProposer) and prop.num_shared_layers == 0 and prop.adapter.num_layers == 2
    assert list(spec.engine.runner.captures) == [0]
    assert _tokens(spec, PROMPTS, GREEDY) == want
    assert spec.engine.stats.num_draft_tokens > 0 and prop.num_fallback_tokens == 0
    assert_no_leaks(spec)
    monkeypatch.setattr(artifacts, "DRAFT_DIR", out)  # "ship" it: draft_model with no path uses it
    shipped = LLM.from_engine_of(plain4, speculative_config={"method": "draft_model", "use_cost_model": False},
                                 kv_cache_blocks=256)
    assert shipped.engine.speculator.proposer.adapter.num_layers == 2
    monkeypatch.setattr(artifacts, "DRAFT_DIR", tmp_path / "none")
    with pytest.raises(ValueError, match="train draft-model"):
        LLM.from_engine_of(plain4, speculative_config={"method": "draft_model"})
