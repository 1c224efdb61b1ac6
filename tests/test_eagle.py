"""The feature-conditioned (EAGLE-style) draft: lossless, conditioned on the target's own features for every
committed token (never its own), never recomputes the target, consistent between training and inference, and
`leapdecode train eagle` lowers its loss and writes an artifact the `eagle` method runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.cli import main
from leapdecode.layers import int8_gemm
from leapdecode.models.loader import load_model
from leapdecode.speculative.artifacts import load_adapter, save_adapter
from leapdecode.speculative.exit_adapter import ExitAdapter
from leapdecode.speculative.heads import PYRAMID
from leapdecode.speculative.methods.eagle import EagleProposer
from leapdecode.speculative.tree import depths_of
from leapdecode.train.adapter import dense_passes
from leapdecode.train.data import Batch

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks, distill_tiny, layer_row_counters, save_random_heads

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def want(plain4) -> list[list[int]]:
    return _tokens(plain4, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def tiny1(make_tiny_model) -> Path:
    return make_tiny_model(num_hidden_layers=1)


@pytest.fixture(scope="module")
def plain1(tiny1) -> LLM:
    return LLM(model=str(tiny1), kv_cache_blocks=256)


@pytest.fixture(scope="module")
def near_exact(tiny1, tmp_path_factory) -> dict[str, Path]:
    """Feature drafts of a one-layer target built from the target itself: ``exact`` (fc = [0 | I] and the
    target's layer and norm: the draft *is* the target, every draft is accepted) and ``rough`` (a little of the
    feature half switched on: on these chaotic random models drafts are then accepted about a quarter of the
    time, so both the accepted and the rollback paths run)."""
    model, _ = load_model(tiny1)
    out = {}
    for name, scale in [("exact", 0.0), ("rough", 0.01)]:
        torch.manual_seed(0)
        adapter = ExitAdapter.from_target(model, 0, "next", 1, feature_input=True)
        with torch.no_grad():
            h = model.config.hidden_size
            adapter.fc.weight[:, :h].normal_(0, scale / h**0.5)
        out[name] = tmp_path_factory.mktemp(f"feature_{name}")
        save_adapter(adapter, out[name], model, {})
    return out


@pytest.fixture(scope="module")
def trained(tiny4, tmp_path_factory) -> Path:
    """A one-layer feature draft trained for a few seconds on the tiny model's own answers."""
    tmp = tmp_path_factory.mktemp("feature_draft")
    data = distill_tiny(tiny4, tmp, ["cats", "rivers", "clocks", "bread", "snow", "maps"])
    out = tmp / "draft"
    assert main(["train", "eagle", "--data", str(data), "--layers", "1", "--model", str(tiny4),
                 "--out", str(out), "--batch-tokens", "256", "--vocab-subset", "4096", "--val-fraction", "0.25",
                 "--lr", "3e-3", "--warmup", "2", "--epochs", "3", "--no-estimate"]) == 0
    return out


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _spec(plain: LLM, folder: Path, **kw) -> LLM:
    # float32 drafting: the exact draft must reproduce the target (int8 drafting: test_int8_drafting_...)
    cfg = {"method": "eagle", "model": str(folder), "use_cost_model": False, "min_draft_prob": 0.0,
           "draft_precision": "float32", **kw}
    return LLM.from_engine_of(plain, speculative_config=cfg, kv_cache_blocks=256, block_size=4)


def test_artifact_roundtrip_and_fuse_starts_as_the_plain_draft(tiny4, trained):
    model, _ = load_model(tiny4)
    loaded, cfg, _ = load_adapter(trained, model)
    assert cfg["input"] == "features" and loaded.feature_input and loaded.fc is not None
    fresh = ExitAdapter.from_target(model, 0, "next", 1, feature_input=True)
    e, f = torch.randn(3, model.config.hidden_size), torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(fresh.fuse(f, e), e)  # [0 | I]: the features start switched off
    with pytest.raises(ValueError, match="shares no target layers"):
        ExitAdapter(model.config, 2, 1, feature_input=True)


def test_training_passes_match_the_paged_inference_forward(tiny4):
    """dense_passes (training) feeds position p the target feature of p-1 (zeros at 0) with embed(x_p), exactly
    what the drafter's paged forward computes over fuse(f_{p-1}, embed(x_p)); its 2nd pass feeds the 1st's
    outputs instead of the target's features."""
    from dataclasses import replace

    from leapdecode.engine.block_manager import BlockManager
    from leapdecode.engine.kv_cache import KVCache
    from leapdecode.engine.model_runner import ForwardItem, ModelRunner
    from leapdecode.speculative.shadow_cache import Shadow

    model, cfg = load_model(tiny4)
    torch.manual_seed(1)
    adapter = ExitAdapter.from_target(model, 0, "last", 1, feature_input=True)
    with torch.no_grad():
        adapter.fc.weight.normal_(0, 0.05)
    t = 6
    x = torch.randn(1, t, cfg.hidden_size) * 4  # stands for the target's pre-norm top-layer states
    tokens = torch.randint(0, cfg.vocab_size, (1, t))
    batch = Batch(x, tokens, torch.ones(1, t, dtype=torch.bool), torch.ones(1, t, dtype=torch.bool),
                  torch.zeros(t, 2), torch.zeros(t, 2, dtype=torch.long))
    with torch.no_grad():
        outs, feats = dense_passes(adapter, model, batch, chain_steps=2)
        f = model.norm(x[0])
        torch.testing.assert_close(feats[0], f)
        kv = KVCache(replace(cfg, num_hidden_layers=1), 8, 4, torch.float32, torch.device("cpu"))
        bm = BlockManager(8, 4, enable_prefix_caching=False)
        runner = ModelRunner(model, kv, 4, torch.device("cpu"))
        emb = model.embed_tokens(tokens[0])
        for k, prev in enumerate([f, outs[0][0]]):
            sh = Shadow()
            bm.allocate(sh, t)
            _, pos, meta, _ = runner.prepare([ForwardItem(sh.block_table, 0, [0] * t, list(range(t)))])
            shifted = torch.cat([torch.zeros(1, cfg.hidden_size), prev[:-1]])
            paged = adapter(adapter.fuse(shifted, emb), model.rope.table(pos, x.dtype), kv.layers, meta)
            torch.testing.assert_close(paged, outs[k][0], atol=1e-4, rtol=1e-4)
            bm.free(sh)


@pytest.mark.parametrize("name", ["exact", "rough"])
def test_feature_draft_is_lossless_and_reads_the_targets_own_features(name, plain1, tiny1, near_exact):
    """Token-identical to plain decoding; the feature fed for every committed position is the target's final
    normed hidden state one position back (checked against HF transformers), each committed position is fed on
    target features exactly once (accepted drafts are recomputed from the target's), and the target's layers
    run only for its own prefill and verification rows."""
    from transformers import AutoModelForCausalLM

    want = _tokens(plain1, PROMPTS, GREEDY)
    spec = _spec(plain1, near_exact[name])
    prop = spec.engine.speculator.proposer
    assert isinstance(prop, EagleProposer)
    model = spec.engine.model
    assert list(spec.engine.runner.captures) == [model.config.num_hidden_layers]
    seen: list[tuple[str, int, torch.Tensor]] = []
    orig = prop._catchup_for

    def spy(seq, start):
        feats = orig(seq, start)
        seen.append((seq.request_id, start, feats.clone()))
        return feats

    prop._catchup_for = spy
    counts, handles = layer_row_counters(model)
    try:
        outs = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        for hd in handles:
            hd.remove()
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and (accepted == drafted if name == "exact" else 0 < accepted < drafted)
    assert counts == [spec.engine.runner.num_forward_tokens] * len(model.layers) and prop.num_fallback_tokens == 0
    hf = AutoModelForCausalLM.from_pretrained(tiny1, torch_dtype=torch.float32).eval()
    by_id = {o.request_id: o for o in outs}
    fed: dict[str, set[int]] = {}
    for rid, start, feats in seen:
        o = by_id[rid]
        ids = torch.tensor([o.prompt_token_ids + o.outputs[0].token_ids])
        with torch.no_grad():
            ref = hf(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm
        ref = torch.cat([torch.zeros(1, ref.shape[1]), ref])  # ref[p] = f_{p-1}
        torch.testing.assert_close(feats, ref[start : start + feats.shape[0]], atol=1e-4, rtol=1e-4)
        span = set(range(start, start + feats.shape[0]))
        assert not span & fed.setdefault(rid, set())  # each committed position fed on target features once
        fed[rid] |= span
    assert_no_leaks(spec)
    assert not prop.shadows and prop.adapter_bm.num_free_blocks == prop.adapter_bm.num_blocks


def test_sampling_batching_and_preemption(plain1, near_exact):
    """Seeded sampling matches itself across runs and drafts; mixed opt-outs and a pool small enough to preempt
    stay token-identical to plain decoding."""
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, speculative=(i % 3 != 1))
              for i in range(6)]
    prompts = PROMPTS + PROMPTS[:2]
    want = _tokens(plain1, prompts, params)
    spec = LLM.from_engine_of(plain1, speculative_config={"method": "eagle", "model": str(near_exact["rough"]),
                                                          "use_cost_model": False, "min_draft_prob": 0.0},
                              kv_cache_blocks=60, block_size=4)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert spec.engine.speculator.proposer.num_fallback_tokens == 0
    assert_no_leaks(spec)
    sampled = SamplingParams(temperature=0.8, max_tokens=24, seed=3, ignore_eos=True)
    spec2 = _spec(plain1, near_exact["rough"])
    a, b = _tokens(spec2, PROMPTS, sampled), _tokens(spec2, PROMPTS, sampled)
    assert a == b and spec2.engine.stats.num_draft_tokens > 0


def test_train_draft_features_lowers_its_loss_and_runs_in_eagle_and_hybrid(trained, plain4, want, tmp_path):
    out = trained
    rec = json.loads((out / "record.json").read_text())
    assert rec["command"].startswith("leapdecode train eagle --layers 1 ") and "--features" not in rec["command"]
    assert "--chain-steps 2" in rec["command"]
    hist = rec["history"]
    assert hist[-1]["train_loss"] < hist[1]["train_loss"] and min(h["val_loss"] for h in hist[1:]) < hist[0]["val_loss"]
    assert "agree_own_features" in hist[-1]
    assert json.loads((out / "config.json").read_text())["input"] == "features"
    spec = _spec(plain4, out)
    assert isinstance(spec.engine.speculator.proposer, EagleProposer)
    assert _tokens(spec, PROMPTS, GREEDY) == want
    assert spec.engine.stats.num_draft_tokens > 0
    # one name per technique: draft_model never runs the EAGLE drafter, it says which method does
    with pytest.raises(ValueError, match='run it with the "eagle" method'):
        LLM.from_engine_of(plain4, speculative_config={"method": "draft_model", "model": str(out)})
    # the trunk of a hybrid: branches that win are compacted into the sequential slots, and the captured
    # features follow them there (no fallback pass)
    heads = _heads(tmp_path)
    hyb = LLM.from_engine_of(plain4, speculative_config={
        "method": "hybrid", "model": str(out), "heads": str(heads), "use_cost_model": False,
        "num_speculative_tokens": 3, "min_draft_prob": 0.0, "branches": 2}, kv_cache_blocks=256, block_size=4)
    outs = hyb.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    prop = hyb.engine.speculator.proposer
    assert isinstance(prop.chain, EagleProposer) and prop.chain.num_fallback_tokens == 0
    assert_no_leaks(hyb)
    chain = prop.chain  # compaction moves the stored features and tags with the K/V
    src, dst = torch.tensor([5, 9]), torch.tensor([1, 2])
    before = chain.h_pool[src].clone(), chain.pos_tag[src].clone(), chain.tok_tag[src].clone()
    hyb.engine.runner.copy_slots(src, dst)
    assert torch.equal(chain.h_pool[dst], before[0]) and torch.equal(chain.pos_tag[dst], before[1])
    assert torch.equal(chain.tok_tag[dst], before[2])


def test_eagle_method_shipped_default_auto_and_errors(plain1, near_exact, tiny1, monkeypatch, tmp_path):
    """``{"method": "eagle"}`` runs a feature draft (by path, or the shipped one), ``auto`` offers the shipped one
    for its own target, a hybrid takes it as its trunk, and a folder that is not a feature draft is a clear
    error."""
    from leapdecode.speculative import artifacts
    from leapdecode.speculative.registry import auto_methods

    want = _tokens(plain1, PROMPTS, GREEDY)
    spec = LLM.from_engine_of(plain1, speculative_config={"method": "eagle", "model": str(near_exact["rough"]),
                                                          "use_cost_model": False, "min_draft_prob": 0.0},
                              kv_cache_blocks=256)
    assert isinstance(spec.engine.speculator.proposer, EagleProposer)
    assert _tokens(spec, PROMPTS, GREEDY) == want
    monkeypatch.setattr(artifacts, "EAGLE_DIR", near_exact["exact"])  # "ship" it
    shipped = LLM.from_engine_of(plain1, speculative_config={"method": "eagle", "use_cost_model": False,
                                                             "min_draft_prob": 0.0, "draft_precision": "float32"},
                                 kv_cache_blocks=256)
    assert _tokens(shipped, PROMPTS, GREEDY) == want
    assert shipped.engine.stats.num_accepted_tokens == shipped.engine.stats.num_draft_tokens > 0  # the exact one
    assert "eagle" in auto_methods(shipped.engine.config.speculative_config, shipped.engine.model)
    hyb = LLM.from_engine_of(plain1, speculative_config={
        "method": "hybrid", "trunk": "eagle", "heads": str(_heads(tmp_path)), "use_cost_model": False,
        "num_speculative_tokens": 3, "min_draft_prob": 0.0}, kv_cache_blocks=256, block_size=4)
    assert isinstance(hyb.engine.speculator.proposer.chain, EagleProposer)
    assert _tokens(hyb, PROMPTS, GREEDY) == want
    assert_no_leaks(hyb)
    model, _ = load_model(tiny1)
    plain_draft = tmp_path / "plain_draft"
    save_adapter(ExitAdapter.from_target(model, 0, "next", 1), plain_draft, model, {})
    with pytest.raises(ValueError, match="feature-conditioned"):
        LLM.from_engine_of(plain1, speculative_config={"method": "eagle", "model": str(plain_draft)})
    monkeypatch.setattr(artifacts, "EAGLE_DIR", tmp_path / "none")
    with pytest.raises(ValueError, match="train eagle"):
        LLM.from_engine_of(plain1, speculative_config={"method": "eagle"})


def _default_precision_spec(plain: LLM, folder: Path) -> LLM:
    """eagle with ``folder``'s draft at the default draft precision, drafting every step."""
    return LLM.from_engine_of(plain, speculative_config={"method": "eagle", "model": str(folder),
                                                         "use_cost_model": False, "min_draft_prob": 0.0},
                              kv_cache_blocks=256)


def test_int8_drafting_is_the_default_and_stays_lossless(plain1, near_exact):
    """By default a drafter's own projections (fc, its layer, the subset head) run as Q8_0 weights with int8
    activations: every packed record is the int8-activation layout and each weight equals its Q8_0
    dequantization. The exact draft is then only nearly exact (acceptance drops a little), and the output is
    still plain decoding's; "float32" keeps float panels; anything else is an error."""
    if int8_gemm.int8_activation_isa() in (None, "portable"):
        pytest.skip("no fast int8 kernel on this CPU (AVX2 or AVX-512 VNNI): drafting stays float32 (next test)")
    want = _tokens(plain1, PROMPTS, GREEDY)
    spec = _default_precision_spec(plain1, near_exact["exact"])
    prop = spec.engine.speculator.proposer
    assert prop.draft_precision == "int8"
    linears = [m for m in prop.adapter.modules() if hasattr(m, "packed")]
    assert len(linears) == 5 and all(m.packed.dim() == 4 for m in linears)  # fc, qkv, o, gate_up, down
    for m in linears:
        assert torch.equal(m.weight, int8_gemm.BlockQuantized.quantize_q8(m.weight).dequantize())
    assert _tokens(spec, PROMPTS, GREEDY) == want
    st = spec.engine.stats
    assert 0.5 * st.num_draft_tokens < st.num_accepted_tokens <= st.num_draft_tokens
    f32 = _spec(plain1, near_exact["exact"])
    assert f32.engine.speculator.proposer.draft_precision == "float32"
    assert all(m.packed.dtype == torch.float32 for m in f32.engine.speculator.proposer.adapter.modules()
               if getattr(m, "packed", None) is not None)
    with pytest.raises(ValueError, match="draft_precision must be one of"):
        _spec(plain1, near_exact["exact"], draft_precision="int4")


def test_int8_drafting_falls_back_to_float32_without_a_fast_int8_kernel(plain1, near_exact, monkeypatch):
    """Without AVX2 the int8 kernel is a scalar reference loop, slower than float32: the default then drafts
    with float32 panels and says so, and the output is plain decoding's."""
    monkeypatch.setattr(int8_gemm, "int8_activation_isa", lambda: "portable")
    spec = _default_precision_spec(plain1, near_exact["exact"])
    prop = spec.engine.speculator.proposer
    assert prop.draft_precision == "float32"
    linears = [m for m in prop.adapter.modules() if hasattr(m, "packed")]
    assert len(linears) == 5 and all(m.packed.dtype == torch.float32 and m.packed.dim() == 3 for m in linears)
    assert _tokens(spec, PROMPTS, GREEDY) == _tokens(plain1, PROMPTS, GREEDY)


# beam 4 = 2 x 2: every node of the first two depths is expanded, so the tree holds all top-2 paths of depth 3
TREE = {"tree_nodes": 64, "tree_top_k": 2, "tree_beam": 4, "tree_depth": 3, "tree_min_prob": 0.0,
        "draft_precision": "float32"}


def test_dynamic_tree_grows_through_its_own_nodes_and_is_lossless(plain1, near_exact):
    """``"tree_nodes"`` makes eagle grow a tree (EAGLE-2). With the exact draft every node's children are the
    target's own top-k after that node's path, so the target's greedy path is always in the tree (the beam here
    expands every node; a narrower one may drop it) and each step accepts its full depth; a node that saw a
    sibling or missed an ancestor would be wrong by depth 2 on these chaotic random models. The rough draft is
    token-identical to plain decoding, greedy and seeded sampling."""
    want = _tokens(plain1, PROMPTS, GREEDY)
    spec = LLM.from_engine_of(plain1, speculative_config={"method": "eagle", "model": str(near_exact["exact"]),
                                                          "use_cost_model": False, **TREE}, kv_cache_blocks=256,
                              block_size=4)
    prop = spec.engine.speculator.proposer
    assert isinstance(prop, EagleProposer) and prop.tree_nodes == 64
    depths: dict[str, int] = {}
    accepted: list[tuple[int, int]] = []
    orig_propose, orig_verified = prop.propose, prop.on_verified

    def propose(seqs, budgets):
        props = orig_propose(seqs, budgets)
        for seq, pr in zip(seqs, props):
            depths[seq.request_id] = max(depths_of(pr.parents), default=0) if pr.tokens else 0
        return props

    def on_verified(seq, result):
        accepted.append((depths[seq.request_id], result.num_accepted))
        orig_verified(seq, result)

    prop.propose, prop.on_verified = propose, on_verified
    assert _tokens(spec, PROMPTS, GREEDY) == want
    assert len(accepted) > 10 and all(a == d for d, a in accepted) and max(d for d, _ in accepted) == 3
    assert spec.engine.stats.num_draft_tokens > 2 * spec.engine.stats.num_accepted_tokens  # a tree, not a chain
    assert_no_leaks(spec)
    assert not prop.shadows and prop.adapter_bm.num_free_blocks == prop.adapter_bm.num_blocks

    rough = LLM.from_engine_of(plain1, speculative_config={"method": "eagle", "model": str(near_exact["rough"]),
                                                           "use_cost_model": False, **TREE, "tree_nodes": 5},
                               kv_cache_blocks=256, block_size=4)
    assert _tokens(rough, PROMPTS, GREEDY) == want
    st = rough.engine.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    sampled = SamplingParams(temperature=0.8, max_tokens=24, seed=3, ignore_eos=True)
    assert _tokens(rough, PROMPTS, sampled) == _tokens(plain1, PROMPTS, sampled)
    assert rough.engine.speculator.proposer.num_fallback_tokens == 0
    assert_no_leaks(rough)


def test_dynamic_tree_config_errors_and_hybrid_trunk(plain1, near_exact, tmp_path):
    """Bad tree keys are errors, tree keys on a drafter without trees too, and on a hybrid (its eagle trunk stays a
    chain: the hybrid builds its own tree)."""
    base = {"model": str(near_exact["rough"])}
    hybrid = {"method": "hybrid", "trunk": "eagle", **base, "heads": str(_heads(tmp_path))}
    with pytest.raises(ValueError, match="unknown speculative option 'tree_nodes' for method 'hybrid'"):
        LLM.from_engine_of(plain1, speculative_config={**hybrid, "tree_nodes": 4})
    hyb = LLM.from_engine_of(plain1, speculative_config=hybrid)
    assert isinstance(hyb.engine.speculator.proposer.chain, EagleProposer)
    assert hyb.engine.speculator.proposer.chain.tree_nodes == 0
    with pytest.raises(ValueError, match="tree_beam must be an integer >= 1"):
        LLM.from_engine_of(plain1, speculative_config={"method": "eagle", **base, "tree_nodes": 4, "tree_beam": 0})
    with pytest.raises(ValueError, match="tree_min_prob"):
        LLM.from_engine_of(plain1, speculative_config={"method": "eagle", **base, "tree_min_prob": 1.5})
    with pytest.raises(ValueError, match="option 'tree_nodes' for method 'draft_model' \\(tree_nodes is read by eagle"):
        LLM.from_engine_of(plain1, speculative_config={"method": "draft_model", **base, "tree_nodes": 4})


def _heads(tmp_path: Path) -> Path:
    """Random pyramid heads for the tiny models (the hybrid's branches)."""
    return save_random_heads(tmp_path / "heads", PYRAMID, seed=5, first_head_seed=11)
