"""Candidate trees: shapes, the tree attention mask over the paged KV cache, and verification, each checked
against a brute-force per-path computation on a tiny model."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from leapdecode import LLM
from leapdecode.engine.model_runner import ForwardItem
from leapdecode.speculative import acceptance as A
from leapdecode.speculative import tree as T
from leapdecode.speculative.shadow_cache import Shadow

# a tree with decoys: 3 children of the root, branches of different depth (parents before children)
PARENTS = [-1, -1, -1, 0, 0, 2, 3, 3, 5, 6]


# ------------------------------------------------------------------------------------------ pure functions
def test_depths_children_and_paths():
    assert T.depths_of(PARENTS) == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    ch = T.children_of(PARENTS)
    assert ch[0] == [0, 1, 2] and ch[1] == [3, 4] and ch[4] == [6, 7]
    assert T.path_to(9, PARENTS) == [0, 3, 6, 9]
    assert T.path_to(-1, PARENTS) == []
    with pytest.raises(ValueError, match="topological"):
        T.depths_of([1, -1])


def test_tree_attention_mask_is_ancestor_or_self():
    for num_prefix in (1, 3):
        m = T.tree_attention_mask(PARENTS, num_prefix)
        n = len(PARENTS)
        assert m.shape == (num_prefix + n, num_prefix + n)
        assert torch.equal(m[:num_prefix, :num_prefix], torch.ones(num_prefix, num_prefix).tril().bool())
        assert not m[:num_prefix, num_prefix:].any()
        for i in range(n):
            anc = set(T.path_to(i, PARENTS))
            assert m[num_prefix + i, :num_prefix].all()
            for j in range(n):
                assert bool(m[num_prefix + i, num_prefix + j]) == (j in anc), (i, j)


def test_top_paths_are_prefix_closed_and_count_accepted_tokens():
    """The tree from rank statistics: every prefix of the path list is a valid tree, and the counts add up to
    the accepted lengths a brute-force walk over the recorded ranks gives."""
    g = random.Random(0)
    ranks = torch.tensor([[min(int(g.expovariate(1.2)), 5) if g.random() < 0.8 else -1 for _ in range(4)]
                          for _ in range(400)])
    counts = T.rank_path_counts(ranks)
    paths = T.top_paths(counts, 24)
    assert len(paths) == 24
    for n in range(1, len(paths) + 1):
        have = set(paths[:n])
        assert all(len(p) == 1 or p[:-1] in have for p in paths[:n])
    curve = T.expected_tokens_curve(paths, counts, len(ranks))
    have = set(paths)
    brute = 0
    for row in ranks.tolist():
        depth = 0
        while depth < len(row) and row[depth] >= 0 and tuple(row[: depth + 1]) in have:
            depth += 1
        brute += depth
    assert abs(curve[-1] - (1 + brute / len(ranks))) < 1e-9
    assert all(a <= b for a, b in zip(curve, curve[1:]))
    # counts shrink along a path, so the 24 most frequent paths are the best 24-node tree
    assert sum(counts[p] for p in paths) == sum(sorted(counts.values(), reverse=True)[:24])


def test_materialize_drops_missing_ranks_and_orphans():
    cands = [[10, 11, 12], [20, 21]]  # depth 1 has 3 candidates, depth 2 has 2, no depth 3
    paths = [(0,), (1,), (0, 0), (0, 2), (0, 1), (0, 0, 0), (3,), (3, 0)]
    tokens, parents = T.materialize(paths, cands)
    assert tokens == [10, 11, 20, 21]
    assert parents == [-1, -1, 0, 0]


def test_verify_tree_greedy_walks_to_the_deepest_match():
    tokens = [5, 6, 7, 8, 9, 1, 2, 3, 4, 0]
    # rows: root, then nodes; root argmax 5 -> node 0; node 0 argmax 9 -> node 4; node 4 has no children
    argmax = [5, 9, 0, 0, 0, 9, 0, 0, 0, 0, 0]
    emitted, path = A.verify_tree_greedy(argmax, tokens, PARENTS)
    assert path == [0, 4] and emitted == [5, 9, 9]
    emitted, path = A.verify_tree_greedy([4] + [0] * 10, tokens, PARENTS)
    assert path == [] and emitted == [4]
    assert T.compaction_moves([0, 4]) == [(4, 1)]
    assert T.compaction_moves([2, 5, 8]) == [(2, 0), (5, 1), (8, 2)]
    assert T.compaction_moves([0, 3]) == [(3, 1)]


def test_tree_sampling_is_distributed_as_the_target():
    """The first emitted token follows p[root]; after descending into child c the next follows p[c]."""
    g = torch.Generator().manual_seed(0)
    vocab = 5
    parents = [-1, -1, 0]
    tokens = [1, 3, 2]
    p = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15], [0.3, 0.1, 0.2, 0.2, 0.2], [0.2] * 5, [0.5, 0.1, 0.1, 0.2, 0.1]])
    n = 6000
    first = torch.zeros(vocab)
    second_after_1 = torch.zeros(vocab)
    for _ in range(n):
        out, path = A.verify_tree_sampling(p, tokens, parents, g)
        first[out[0]] += 1
        if out[0] == 1:
            second_after_1[out[1]] += 1
            assert path[0] == 0
        assert len(out) == len(path) + 1
    assert chisquare(first.numpy(), (p[0] * n).numpy()).pvalue > 1e-3
    m = second_after_1.sum()
    assert chisquare(second_after_1.numpy(), (p[1] * m).numpy()).pvalue > 1e-3


def test_typical_acceptance_rule():
    flat = torch.full((8,), 1 / 8)
    peaked = torch.tensor([0.93] + [0.01] * 7)
    h_flat = float(-(flat * flat.log()).sum())
    assert abs(A.typical_threshold(flat, 0.5, 0.3) - 0.3 * torch.exp(torch.tensor(-h_flat)).item()) < 1e-9
    assert A.typical_threshold(peaked, 0.09, 0.3) == 0.09
    # root is flat (low bar): both children pass; the deeper branch wins
    parents, tokens = [-1, -1, 1], [2, 3, 0]
    probs = torch.stack([flat, flat, peaked, peaked])
    out, path = A.verify_tree_typical(probs, tokens, parents, torch.Generator().manual_seed(0), 0.09, 0.3)
    assert path == [1, 2] and out[:2] == [3, 0]
    # a token below the bar is not accepted
    probs = torch.stack([peaked, flat, flat, flat])
    out, path = A.verify_tree_typical(probs, [5, 0, 1], [-1, -1, 0], torch.Generator().manual_seed(0), 0.09, 0.3)
    assert path == [1]


# ---------------------------------------------------------------------------------------- on a tiny model
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256, block_size=4).engine


def _logits(engine, tokens: list[int]) -> torch.Tensor:
    """Brute force: a fresh causal forward over ``tokens``; logits of every position."""
    sh = Shadow()
    engine.block_manager.allocate(sh, len(tokens))
    try:
        return engine.runner.execute([ForwardItem(sh.block_table, 0, tokens, list(range(len(tokens))))])[0].logits
    finally:
        engine.block_manager.free(sh)


def _tree_forward(engine, prompts, trees):
    """Prefill each prompt but its last token, then verify all trees in ONE forward (root = last prompt
    token). Returns per-sequence (shadow, logits rows, hidden rows)."""
    bm, runner = engine.block_manager, engine.runner
    shadows, items = [], []
    for prompt, (tokens, parents) in zip(prompts, trees):
        sh = Shadow()
        bm.allocate(sh, len(prompt) + len(tokens))
        runner.execute([ForwardItem(sh.block_table, 0, prompt[:-1], [])])
        n = len(tokens)
        items.append(ForwardItem(sh.block_table, len(prompt) - 1, [prompt[-1]] + tokens, list(range(n + 1)),
                                 depths=[0] + T.depths_of(parents), tree_mask=T.tree_attention_mask(parents, 1)))
        shadows.append(sh)
    results = runner.execute(items)
    return shadows, results


def test_tree_mask_forward_matches_each_path_brute_force(engine):
    """Every node's logits (two trees batched in one forward, paged cache with 4-slot blocks) equal a plain
    forward over prompt + that node's path."""
    g = random.Random(1)
    prompts = [[g.randrange(100, 5000) for _ in range(9)], [g.randrange(100, 5000) for _ in range(14)]]
    parents2 = [-1, -1, 0, 1, 2, 2]
    trees = [([g.randrange(100, 5000) for _ in PARENTS], PARENTS),
             ([g.randrange(100, 5000) for _ in parents2], parents2)]
    shadows, results = _tree_forward(engine, prompts, trees)
    try:
        for prompt, (tokens, parents), res in zip(prompts, trees, results):
            assert torch.allclose(res.logits[0], _logits(engine, prompt)[-1], atol=1e-4, rtol=1e-4)
            for i in range(len(tokens)):
                path = [tokens[j] for j in T.path_to(i, parents)]
                want = _logits(engine, prompt + path)[-1]
                assert torch.allclose(res.logits[i + 1], want, atol=1e-4, rtol=1e-4), i
    finally:
        for sh in shadows:
            engine.block_manager.free(sh)


def test_tree_grown_over_passes_matches_each_path_brute_force(engine):
    """A tree grown depth by depth (the feature draft's dynamic tree): each pass caches its nodes after the
    earlier ones, and its mask covers them ([q, cached + q]), so a node sees exactly its ancestors from earlier
    passes. Every node's logits equal a plain forward over prompt + its path."""
    g = random.Random(2)
    prompt = [g.randrange(100, 5000) for _ in range(11)]
    parents = [-1, -1, 0, 0, 1, 2, 4]  # depths 1 1 2 2 2 3 3, grown in three passes
    tokens = [g.randrange(100, 5000) for _ in parents]
    depths = T.depths_of(parents)
    bm, runner = engine.block_manager, engine.runner
    sh = Shadow()
    bm.allocate(sh, len(prompt) + len(tokens))
    got: dict[int, torch.Tensor] = {}
    try:
        runner.execute([ForwardItem(sh.block_table, 0, prompt, [])])
        n = len(prompt)
        cached: list[int] = []
        for depth in (1, 2, 3):
            new = [i for i, d in enumerate(depths) if d == depth]
            mask = torch.zeros(len(new), len(cached) + len(new), dtype=torch.bool)
            for j, i in enumerate(new):
                anc = set(T.path_to(i, parents))
                mask[j, : len(cached)] = torch.tensor([c in anc for c in cached], dtype=torch.bool)
                mask[j, len(cached) + j] = True
            start = n + len(cached)
            item = ForwardItem(sh.block_table, start, [tokens[i] for i in new], list(range(len(new))),
                               depths=[n - 1 + depth - start] * len(new), tree_mask=mask)
            res = runner.execute([item])[0]
            got.update({i: res.logits[j] for j, i in enumerate(new)})
            cached += new
    finally:
        bm.free(sh)
    for i in range(len(tokens)):
        want = _logits(engine, prompt + [tokens[j] for j in T.path_to(i, parents)])[-1]
        assert torch.allclose(got[i], want, atol=1e-4, rtol=1e-4), i


def test_select_by_score_keeps_the_best_prefix_closed_subtree():
    """The dynamic tree's cut: the N highest cumulative scores, parents first, parents re-indexed; a child that
    ties its parent (probability 1) comes after it; a score that grows along a path is refused."""
    parents = [-1, -1, 0, 0, 1, 2, 5]
    scores = [0.6, 0.3, 0.3, 0.2, 0.25, 0.3, 0.05]
    kept, new_parents = T.select_by_score(scores, parents, 4)
    assert kept == [0, 1, 2, 5] and new_parents == [-1, -1, 0, 2]
    kept, new_parents = T.select_by_score(scores, parents, 100)
    assert sorted(kept) == list(range(7)) and all(p < j for j, p in enumerate(new_parents))
    assert [parents[k] for k in kept] == [-1 if p < 0 else kept[p] for p in new_parents]
    assert T.select_by_score(scores, parents, 0) == ([], [])
    with pytest.raises(ValueError, match="without its parent"):
        T.select_by_score([0.2, 0.5], [-1, 0], 1)


def test_tree_verification_and_kv_compaction_match_brute_force(engine):
    """Trees built around the true greedy continuation (decoys first, so accepted nodes sit in non-sequential
    slots): the greedy walk equals a brute-force per-path check, and after moving the accepted nodes' K/V into
    sequential slots the next decode step's logits equal a plain forward over prompt + emitted tokens."""
    g = random.Random(2)
    for trial in range(3):
        prompt = [g.randrange(100, 5000) for _ in range(7 + trial * 3)]
        cont = []
        for _ in range(3):
            cont.append(int(_logits(engine, prompt + cont)[-1].argmax()))
        # depth 1: decoy, decoy, true; depth 2 under the true one: decoy, true; depth 3: true (if trial != 1)
        def alt(t: int, k: int) -> int:
            return (t + k) % 49152

        tokens = [alt(cont[0], 1), alt(cont[0], 2), cont[0], alt(cont[1], 7), cont[1],
                  cont[2] if trial != 1 else alt(cont[2], 3)]
        parents = [-1, -1, -1, 2, 2, 4]
        shadows, results = _tree_forward(engine, [prompt], [(tokens, parents)])
        sh, res = shadows[0], results[0]
        try:
            emitted, path = A.verify_tree_greedy(res.logits.argmax(-1).tolist(), tokens, parents)
            # brute force: the deepest node whose whole path agrees with plain greedy decoding
            best = -1
            for i in range(len(tokens)):
                p = T.path_to(i, parents)
                ok = all(int(_logits(engine, prompt + [tokens[j] for j in p[:d]])[-1].argmax()) == tokens[p[d]]
                         for d in range(len(p)))
                if ok and len(p) > len(T.path_to(best, parents)):
                    best = i
            assert path == T.path_to(best, parents)
            want_emitted = [tokens[j] for j in path]
            want_emitted.append(int(_logits(engine, prompt + want_emitted)[-1].argmax()))
            assert emitted == want_emitted
            assert len(path) == (3 if trial != 1 else 2)
            # compaction: accepted node offsets -> sequential offsets after the root
            base = len(prompt)
            bm, kv = engine.block_manager, engine.kv_cache
            moves = T.compaction_moves(path)
            assert moves
            src = torch.tensor([bm.blocks_at(sh.block_table, base + a) for a, _ in moves])
            dst = torch.tensor([bm.blocks_at(sh.block_table, base + b) for _, b in moves])
            kv.pool.index_copy_(2, dst, kv.pool.index_select(2, src))
            ctx = prompt + emitted
            nxt = engine.runner.execute([ForwardItem(sh.block_table, len(ctx) - 1, [ctx[-1]], [0])])[0].logits[0]
            assert torch.allclose(nxt, _logits(engine, ctx)[-1], atol=1e-4, rtol=1e-4)
        finally:
            engine.block_manager.free(sh)
