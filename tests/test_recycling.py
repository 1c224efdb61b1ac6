"""Token Recycling (speculative/methods/recycling.py): the successor matrix, its trees, and losslessness."""

from __future__ import annotations

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.speculative.methods.recycling import (
    RankStats,
    RecyclingOptions,
    RecyclingProposer,
    SuccessorMatrix,
    best_size,
    grow_dynamic,
    grow_static,
)
from leapdecode.speculative.registry import parse_config
from leapdecode.speculative.tree import depths_of

from .conftest import SPEC_PROMPTS, assert_no_leaks, assert_same_distribution


def _logits(vocab: int, ranked: list[int]) -> torch.Tensor:
    """Logits whose ranking starts with ``ranked`` (decreasing), the rest far below."""
    row = torch.full((vocab,), -10.0)
    for i, t in enumerate(ranked):
        row[t] = 5.0 - i
    return row


def test_matrix_records_each_rows_top_k_and_round_trips(tmp_path):
    m = SuccessorMatrix(50, 3)
    assert not m.has(7) and m.successors(7) == [-1, -1, -1]
    m.update([7, 9, 7], torch.stack([_logits(50, [1, 2, 3]), _logits(50, [4, 5, 6]), _logits(50, [8, 1, 2])]))
    assert m.successors(7) == [8, 1, 2]  # a token given twice keeps its last row
    assert m.successors(9) == [4, 5, 6] and m.has(9)
    p = m.probs[9].float()
    assert p[0] > p[1] > p[2] and float(p.sum()) < 1.0
    assert m.memory_bytes() == 50 * 3 * (4 + 2)
    m.save(tmp_path / "succ.pt")
    other = SuccessorMatrix(50, 3)
    assert other.load(tmp_path / "succ.pt") and other.successors(9) == [4, 5, 6]
    assert not other.load(tmp_path / "absent.pt")
    with pytest.raises(ValueError, match="vocab 50 x top_k 3"):
        SuccessorMatrix(60, 3).load(tmp_path / "succ.pt")


def test_static_template_is_prefix_closed_and_learns_from_verifications():
    stats = RankStats(top_k=3, max_depth=4)
    paths, scores = stats.template(12)
    assert paths[0] == (0,) and all(len(p) == 1 or p[:-1] in paths[:i] for i, p in enumerate(paths))
    assert scores == sorted(scores, reverse=True)
    # rank 1 at depth 1 always accepted, rank 0 never: the template puts (1,) first and grows under it
    for _ in range(50):
        stats.record([(0,), (1,), (1, 0)], accepted=[1, 2])
    paths, scores = stats.template(4)
    assert paths[0] == (1,) and paths[1] == (1, 0)
    assert scores[0] > 0.9
    # a node whose parent was rejected was not tried
    before = stats.tries.clone()
    stats.record([(2,), (2, 0)], accepted=[])
    assert stats.tries[1, 0] == before[1, 0] and stats.tries[0, 2] == before[0, 2] + 1


def test_trees_follow_the_matrix_and_drop_unknown_tokens():
    m = SuccessorMatrix(20, 2)
    m.update([1, 2, 3], torch.stack([_logits(20, [2, 3]), _logits(20, [4, 5]), _logits(20, [6, 7])]))
    tokens, parents, used = grow_static(m, 1, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    # (0, 0, 0) would follow token 4, never recorded: dropped
    assert tokens == [2, 3, 4, 5, 6] and parents == [-1, -1, 0, 0, 1] and used == [0, 1, 2, 3, 4]
    nodes = grow_dynamic(m, 1, max_nodes=10, max_depth=3)
    # p(2) ~ 0.73 and p(4 | 2) ~ 0.73: the path 1-2-4 (~0.53) beats the sibling 3 (~0.27)
    assert [n.token for n in nodes[:3]] == [2, 4, 3]
    assert {n.token for n in nodes} == {2, 3, 4, 5, 6, 7}
    par = [n.parent for n in nodes]
    depths_of(par)  # parents first
    assert all(nodes[i].score <= (nodes[p].score if p >= 0 else 1.0) for i, p in enumerate(par))
    assert grow_dynamic(m, 9, 10, 3) == []


def test_best_size_weighs_expected_tokens_against_row_costs():
    curve = [1.0, 1.5, 1.8, 1.9, 1.95]
    flat = lambda n: 1.0  # noqa: E731  rows are free: the largest tree
    assert best_size(curve, flat, 1, 8) == 4
    steep = lambda n: float(n)  # noqa: E731  a row costs a step: plain decoding
    assert best_size(curve, steep, 1, 8) == 0
    mid = lambda n: 1.0 + 0.3 * (n - 1)  # noqa: E731
    assert best_size(curve, mid, 1, 8) == 1  # 1.5 / 1.3 beats 1.8 / 1.6


# ---------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=512, max_num_seqs=16)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_greedy_recycling_is_token_identical_at_batch(plain, tree):
    cfg = {"method": "recycling", "tree": tree, "tree_nodes": 6, "use_cost_model": False}
    spec = LLM.from_engine_of(plain, speculative_config=cfg, block_size=4)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.3 if i == 2 else 1.0) for i in range(len(SPEC_PROMPTS))]
    want = _ids(plain.generate(SPEC_PROMPTS, params, use_tqdm=False))
    outs = spec.generate(SPEC_PROMPTS, params, use_tqdm=False)
    assert _ids(outs) == want
    # a second pass: the matrix holds what the first one saw, the tiny model's greedy text repeats itself
    outs = spec.generate(SPEC_PROMPTS, params, use_tqdm=False)
    assert _ids(outs) == want
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    prop = spec.engine.speculator.proposer
    assert isinstance(prop, RecyclingProposer) and prop.matrix.num_updates > 0
    assert_no_leaks(spec)


def test_options_are_typed_and_unknown_keys_refused():
    cfg = parse_config({"method": "recycling", "top_k": 4, "tree": "dynamic"})
    opts = cfg.options(RecyclingOptions)
    assert opts.top_k == 4 and opts.tree == "dynamic"
    with pytest.raises(ValueError, match="recycling tree"):
        parse_config({"method": "recycling", "tree": "bushy"})
    with pytest.raises(ValueError, match="unknown speculative option 'prompt_lookup'"):
        parse_config({"method": "recycling", "prompt_lookup": 3})


def test_matrix_is_saved_and_a_new_engine_starts_warm(plain, tmp_path):
    path = tmp_path / "successors.pt"
    cfg = {"method": "recycling", "tree_nodes": 4, "use_cost_model": False, "matrix_path": str(path)}
    spec = LLM.from_engine_of(plain, speculative_config=cfg)
    spec.generate(SPEC_PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    spec.engine.speculator.proposer.save()
    warm = LLM.from_engine_of(plain, speculative_config=cfg)
    assert torch.equal(warm.engine.speculator.proposer.matrix.tokens, spec.engine.speculator.proposer.matrix.tokens)


def test_sampled_recycling_matches_plain_sampling_distribution(plain):
    """A seeded request reproduces plain seeded sampling exactly (the tree walk draws each emitted token from the
    target with the request's generator); and a two-sample chi-square over many seeds."""
    spec = LLM.from_engine_of(plain, speculative_config={"method": "recycling", "tree_nodes": 6,
                                                         "use_cost_model": False})
    prompt = "a b c a b c a b"
    seeded = [SamplingParams(temperature=1.0, top_k=8, max_tokens=12, seed=40 + i, ignore_eos=True)
              for i in range(4)]
    assert _ids(spec.generate([prompt] * 4, seeded, use_tqdm=False)) == \
        _ids(plain.generate([prompt] * 4, seeded, use_tqdm=False))
    assert_same_distribution(plain, spec)
