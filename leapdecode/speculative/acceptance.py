"""Acceptance rules: which drafts the target keeps, for chains and trees, lossless and the opt-in lossy ones.

Chains are verified against the target's distributions at each draft position; trees by walking from the root
(tree.py describes the layout); blockwise's lossy top-k rule keeps a draft among the target's best k.

Per sequence, never across a flattened batch: each sequence's accepted length is its own first mismatch.

Greedy: accept drafts while they equal the target's argmax; the first mismatch is replaced by the target's token,
and if all drafts pass the target's next token is a free "bonus". The emitted tokens are exactly what plain greedy
decoding would produce.

Sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i));
on the first rejection sample from norm(max(p_i - q_i, 0)) and stop; if all pass, sample the bonus from p_{k}.
Each emitted token is then distributed exactly as under plain sampling from p. A deterministic drafter
(n-gram lookup) has q = one-hot, which makes the residual "p with the draft token removed": the same as drawing
from p and keeping the draft while the draw equals it, which is how such chains (and every tree) are verified, so
that a seeded request's tokens are plain sampling's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from leapdecode.layers.sampler import processed_probs, sample_from, uniform
from leapdecode.sampling_params import SamplingParams
from leapdecode.speculative.tree import children_of, depths_of, path_to


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """``target_argmax`` has len(drafts) + 1 entries. Returns (emitted tokens, number of drafts accepted)."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        if target_argmax[i] != d:
            out.append(target_argmax[i])
            return out, i
        out.append(d)
    out.append(target_argmax[len(drafts)])
    return out, len(drafts)


def verify_sampling(
    p: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """``p``: [k+1, V] target probabilities; ``q``: [k, V] draft probabilities or None (deterministic drafts)."""
    if q is None:
        # deterministic drafts: draw the target's token at each position and keep the draft while it is that token.
        # A draft survives with probability p(d), and a draw that differs is distributed as p without d,
        # renormalised (rejection sampling's residual for a one-hot q): the same distribution. The draws are plain
        # sampling's own (one per emitted token, in order, from the same distributions), so a seeded request emits
        # exactly plain sampling's tokens however many drafts each step carried. A chain is a tree of one branch.
        tokens, path = verify_tree_sampling(p, drafts, list(range(-1, len(drafts) - 1)), generator)
        return tokens, len(path)
    out: list[int] = []
    for i, d in enumerate(drafts):
        pd = float(p[i, d])
        qd = float(q[i, d])
        if qd > 0 and uniform(generator) < min(1.0, pd / qd):
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        # p == q exactly leaves no residual mass; then any draw from p is correct
        out.append(sample_from(residual / total if total > 0 else p[i], generator))
        return out, i
    out.append(sample_from(p[len(drafts)], generator))
    return out, len(drafts)


# ------------------------------------------------------------------------------------------------ trees
def verify_tree_greedy(
    target_argmax: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
) -> tuple[list[int], list[int]]:
    """``target_argmax`` has one entry per row (root, then the nodes). Returns (emitted tokens, accepted node
    indices along the path)."""
    children = children_of(parents)
    path: list[int] = []
    row = 0
    while True:
        want = int(target_argmax[row])
        nxt = next((c for c in children[row] if tokens[c] == want), None)
        if nxt is None:
            return [tokens[i] for i in path] + [want], path
        path.append(nxt)
        row = nxt + 1


def verify_tree_sampling(
    probs: torch.Tensor, tokens: Sequence[int], parents: Sequence[int], generator: torch.Generator | None
) -> tuple[list[int], list[int]]:
    """``probs``: [1 + n, V] target distributions (request temperature/top-k/top-p already applied)."""
    children = children_of(parents)
    path: list[int] = []
    row = 0
    while True:
        x = sample_from(probs[row], generator)
        nxt = next((c for c in children[row] if tokens[c] == x), None)
        if nxt is None:
            return [tokens[i] for i in path] + [x], path
        path.append(nxt)
        row = nxt + 1


def typical_threshold(p: torch.Tensor, eps: float, delta: float) -> float:
    """Medusa's typical-acceptance bar ``min(eps, delta * exp(-H(p)))`` for one distribution."""
    nz = p[p > 0]
    entropy = float(-(nz * nz.log()).sum())
    return min(eps, delta * math.exp(-entropy))


def verify_tree_typical(
    probs: torch.Tensor,
    tokens: Sequence[int],
    parents: Sequence[int],
    generator: torch.Generator | None,
    eps: float = 0.09,
    delta: float = 0.3,
) -> tuple[list[int], list[int]]:
    """Lossy: accept the deepest path whose every node passes the typical bar at its parent."""
    rows = probs.shape[0]
    bars = [typical_threshold(probs[r], eps, delta) for r in range(rows)]
    ok: list[bool] = []
    score: list[float] = []
    for t, p in zip(tokens, parents):
        pr = float(probs[p + 1, t])
        passed = pr > bars[p + 1] and (p < 0 or ok[p])
        ok.append(passed)
        score.append((score[p] if p >= 0 else 0.0) + math.log(max(pr, 1e-30)))
    best, best_key = -1, (0, 0.0)
    depths = depths_of(parents)
    for i in range(len(tokens)):
        if ok[i] and (depths[i], score[i]) > best_key:
            best, best_key = i, (depths[i], score[i])
    path = path_to(best, parents)
    bonus = sample_from(probs[best + 1], generator)
    return [tokens[i] for i in path] + [bonus], path



# ----------------------------------------------------------------------------------- blockwise top-k (lossy)
def topk_accepted(
    scores: torch.Tensor, drafts: list[int], top_k: int, min_block: int = 0, probs: bool = False
) -> tuple[int, int]:
    """(drafts kept, how many of them were not the top choice) under top-k acceptance.

    ``scores`` [>= len(drafts), V]: row i scores draft i's position -- logits, or with ``probs`` a sampled
    request's processed distribution, where a zero-probability token never passes (plain sampling could not
    produce it). Draft i passes if fewer than ``top_k`` tokens score strictly higher than it; the first
    ``min_block`` drafts pass regardless; acceptance stops at the first failure."""
    n = len(drafts)
    if n == 0:
        return 0, 0
    d = torch.tensor(drafts, dtype=torch.long, device=scores.device)
    rows = scores[:n].float()
    own = rows.gather(1, d.unsqueeze(1))
    higher = (rows > own).sum(dim=1)  # the draft's rank (0 = argmax, ties favour the draft)
    ok = higher < top_k
    if probs:
        ok &= own.squeeze(1) > 0
    ok[: min(min_block, n)] = True
    accepted = n if bool(ok.all()) else int((~ok).nonzero()[0, 0])
    return accepted, int((higher[:accepted] > 0).sum())


def verify_block_topk(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    top_k: int,
    min_block: int = 0,
) -> tuple[list[int], int, int]:
    """Top-k acceptance of a chain: (emitted tokens, drafts kept, kept drafts that were not the top choice).
    Greedy requests rank logits and emit the argmax after the last kept draft; sampled requests rank their
    processed distribution and draw the next token from it."""
    if params.greedy:
        accepted, lossy = topk_accepted(logits, drafts, top_k, min_block)
        nxt = int(logits[accepted].argmax())
    else:
        p = processed_probs(logits, [params] * logits.shape[0])
        accepted, lossy = topk_accepted(p, drafts, top_k, min_block, probs=True)
        nxt = sample_from(p[accepted], generator)
    return list(drafts[:accepted]) + [nxt], accepted, lossy


__all__ = [
    "topk_accepted",
    "typical_threshold",
    "verify_block_topk",
    "verify_greedy",
    "verify_sampling",
    "verify_tree_greedy",
    "verify_tree_sampling",
    "verify_tree_typical",
]
