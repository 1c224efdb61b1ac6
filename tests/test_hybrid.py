"""Hybrid drafting (speculative/methods/hybrid.py): a chain drafter's trunk plus Medusa branches in one candidate
tree. The tree has the documented shape, decoding is token-identical to plain decoding (greedy, and seeded
sampling) with a self_spec or a draft-model trunk, the trunk drafter only keeps what was accepted of its own chain,
and nothing leaks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.models.loader import load_model
from leapdecode.speculative.artifacts import save_adapter
from leapdecode.speculative.exit_adapter import ExitAdapter
from leapdecode.speculative.heads import PYRAMID
from leapdecode.speculative.methods.hybrid import HybridProposer, hybrid_tree
from leapdecode.speculative.tree import depths_of, path_to

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks, save_random_heads
from .test_tree import _logits, _tree_forward

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def test_tree_shape_trunk_first_branches_beside_it_and_prefixes_stay_valid():
    trunk = [10, 11, 12]
    cand = [[10, 20, 21], [30, 11, 31], [12, 40, 41], [50, 51, 52]]  # depth 1..4, best first
    tokens, parents = hybrid_tree(trunk, cand, branches=2, budget=100)
    assert tokens[:3] == trunk and parents[:3] == [-1, 0, 1]
    # depth d branches: the best candidates other than t_d, children of t_{d-1}; one guess after the trunk
    assert list(zip(tokens[3:], parents[3:])) == [(20, -1), (21, -1), (30, 0), (31, 0), (40, 1), (41, 1), (50, 2)]
    depths = depths_of(parents)
    for i, tok in enumerate(tokens):
        d = depths[i]
        path = [tokens[j] for j in path_to(i, parents)]
        assert len(path) == d and path[:-1] == trunk[: d - 1]  # every node hangs off the trunk
        assert tok == path[-1]
    for budget in range(len(tokens) + 1):  # any budget is a prefix of the same tree
        t2, p2 = hybrid_tree(trunk, cand, branches=2, budget=budget)
        assert t2 == tokens[:budget] and p2 == parents[:budget]
        assert all(p < i for i, p in enumerate(p2))
    assert hybrid_tree([], cand, 1, 8) == ([10], [-1])  # no trunk: the heads' guess for the next token
    assert hybrid_tree(trunk, None, 1, 8) == (trunk, [-1, 0, 1])  # no fresh hidden state: the chain alone


@pytest.fixture(scope="module")
def parts(tiny4, make_tiny_model, tmp_path_factory) -> dict[str, Path]:
    """An untrained L=2 exit adapter (mixed acceptance), random pyramid heads, and another tiny model (a draft
    that never agrees, for the error checks; the draft-model trunk below is the target itself)."""
    model, _ = load_model(tiny4)
    adapter = tmp_path_factory.mktemp("adapter")
    save_adapter(ExitAdapter.from_target(model, 2, "next"), adapter, model, {})
    heads = save_random_heads(tmp_path_factory.mktemp("heads"), PYRAMID, seed=5, first_head_seed=11)
    return {"adapter": adapter, "heads": heads, "draft": make_tiny_model(seed=1, num_hidden_layers=2)}


def _hybrid(plain: LLM, parts, kind: str, **kw) -> LLM:
    cfg = {"method": "hybrid", "heads": str(parts["heads"]), "use_cost_model": False, "num_speculative_tokens": 3,
           "min_draft_prob": 0.0, **kw}
    cfg["model"] = str(parts["adapter"]) if kind == "self_spec" else "target"  # the target: every draft right
    if kind == "self_spec":  # "model" names the adapter for a self_spec trunk
        cfg["trunk"] = "self_spec"
    return LLM.from_engine_of(plain, speculative_config=cfg, kv_cache_blocks=256, block_size=4)


def test_hybrid_tree_logits_match_each_path_brute_force(plain4):
    """Hybrid trees (trunk + branches + the guess after the trunk) verified in one forward next to a second
    sequence: every node's logits equal a plain forward over prompt + that node's path."""
    eng = plain4.engine
    g = random.Random(4)
    prompts = [[g.randrange(100, 5000) for _ in range(11)], [g.randrange(100, 5000) for _ in range(6)]]
    trees = []
    for trunk_len in (3, 2):
        trunk = [g.randrange(100, 5000) for _ in range(trunk_len)]
        cand = [[g.randrange(100, 5000) for _ in range(3)] for _ in range(4)]
        cand[0][0] = trunk[0]  # a candidate equal to the trunk token is skipped, not duplicated
        trees.append(hybrid_tree(trunk, cand, branches=2, budget=16))
    shadows, results = _tree_forward(eng, prompts, trees)
    try:
        for prompt, (tokens, parents), res in zip(prompts, trees, results):
            assert len(set(zip(tokens, parents))) == len(tokens)  # no node twice under one parent
            for i in range(len(tokens)):
                path = [tokens[j] for j in path_to(i, parents)]
                assert torch.allclose(res.logits[i + 1], _logits(eng, prompt + path)[-1], atol=1e-4, rtol=1e-4), i
    finally:
        for sh in shadows:
            eng.block_manager.free(sh)


@pytest.mark.parametrize("trunk", ["self_spec", "draft_model"])
def test_hybrid_is_token_identical_to_plain_and_keeps_only_its_accepted_trunk(plain4, parts, trunk):
    spec = _hybrid(plain4, parts, trunk, branches=2)
    prop: HybridProposer = spec.engine.speculator.proposer
    assert type(prop.chain).__name__ == ("SelfSpecProposer" if trunk == "self_spec" else "DraftModelProposer")
    seen: list[tuple[int, list[int]]] = []
    whole_path: dict[str, list[int]] = {}  # request id -> the accepted path of its latest verification
    real, outer = prop.chain.on_verified, prop.on_verified

    def whole(seq, result):  # what the hybrid is told: the whole tree's accepted path
        whole_path[seq.request_id] = list(result.accepted)
        outer(seq, result)

    def spy(seq, result):  # what the trunk drafter is told vs the whole accepted path
        seen.append((result.num_accepted, whole_path[seq.request_id]))
        real(seq, result)
        sh = prop.chain.shadows.get(seq.request_id)
        assert sh is None or sh.num_computed_tokens <= result.num_prefix_tokens + result.num_accepted

    prop.on_verified, prop.chain.on_verified = whole, spy
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=(i != 1),
                             repetition_penalty=1.3 if i == 2 else 1.0) for i in range(len(PROMPTS))]
    want = [o.outputs[0].token_ids for o in plain4.generate(PROMPTS, params, use_tqdm=False)]
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[1].metrics.num_draft_tokens == 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    # the trunk drafter is told exactly the leading trunk nodes (node i = t_{i+1}) of the accepted path
    assert seen and all(path[:a] == list(range(a)) and (len(path) == a or path[a] != a) for a, path in seen)
    # a branch beside a rejected trunk node (a rescue), or the heads' guess after a fully accepted trunk
    assert prop.num_rescues <= sum(len(path) > a for a, path in seen)
    assert_no_leaks(spec)
    assert not prop.chain.shadows


def test_seeded_sampling_with_hybrid_reproduces_plain_sampling(plain4, parts):
    """Tree sampling draws from the target at each node and the trunk drafts argmax (no draws of its own), so a
    seeded request's tokens are exactly plain decoding's -- the strongest form of 'same distribution'."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=3 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want = [o.outputs[0].token_ids for o in plain4.generate(PROMPTS, params, use_tqdm=False)]
    spec = _hybrid(plain4, parts, "draft_model")
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert_no_leaks(spec)


def test_hybrid_config_errors(plain4, parts):
    with pytest.raises(ValueError, match="branches"):
        _hybrid(plain4, parts, "draft_model", branches=-1)
    with pytest.raises((ValueError, FileNotFoundError), match="hidden size|train medusa|Medusa"):
        LLM.from_engine_of(plain4, speculative_config={"method": "hybrid", "model": str(parts["draft"]),
                                                       "heads": str(parts["adapter"]), "use_cost_model": False})
    with pytest.raises(ValueError, match="trunk"):
        _hybrid(plain4, parts, "draft_model", trunk="medusa")
