"""Candidate trees: construction from per-depth ranked candidates, the tree attention mask, and verification.

A *tree* is described by rank paths. Medusa's heads all read the hidden state of the same position, so the
candidates for depth d (the token d steps after the one the target emits next) do not depend on the parent: a
node is a path ``(r1, .., rd)`` meaning "rank r1 at depth 1, then rank r2 at depth 2, ...", and its token is
``candidates[d-1][rd]``. The shipped tree is the N most frequent rank paths measured on held-out data (see
:func:`rank_path_counts`): a path is accepted only if all its prefixes are, so a prefix's count is at least each
extension's and the top-N paths form a prefix-closed tree that maximises the expected accepted length for N
nodes. Paths are kept in that order, parents before children, so *any prefix of the list is itself a valid tree*:
trimming to a smaller budget is slicing.

In the flat batch a tree occupies ``[root] + nodes`` where the root is the sequence's last committed token (not yet
in the KV cache). Node i sits at RoPE position ``start + depth(i)``, its K/V in the i-th slot after the root; the
ancestor mask lets it attend to exactly the tokens of its own path, so its logits equal those of a plain forward
over ``prefix + path`` (tested by brute force in tests/test_tree.py).

Verification (acceptance.py) walks from the root:

- greedy: descend to the child whose token equals the target's argmax at the current node; stop when none does
  and emit the argmax there (the "bonus"). Exactly plain greedy decoding (lossless).
- sampling: draw x ~ p at the current node; descend if x is a child, else emit x and stop. Each emitted token is a
  draw from the target distribution given the accepted prefix, so this is exactly plain sampling (lossless). It is
  the SpecInfer multi-draft rejection scheme for deterministic drafts (accept child c_i with the residual
  probability p(c_i) / (1 - sum of rejected siblings' p), else move on), collapsed into one draw; acceptance at a
  node is the children's total target mass, the best any verifier can do for these candidates.
- typical acceptance (lossy, opt-in, sampling requests only): a child x is acceptable if
  ``p(x) > min(eps, delta * exp(-H(p)))``; the deepest path of acceptable nodes wins (ties: higher sum of log p),
  then the bonus token is sampled from p at its end.

Accepted nodes whose slots are not the sequential ones get their K/V copied there (:func:`compaction_moves`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

Path = tuple[int, ...]


# ------------------------------------------------------------------------------------------ tree shapes
def rank_path_counts(ranks: torch.Tensor) -> Counter[Path]:
    """``ranks[n, d]``: rank of the true token at depth d+1 among the candidates at step n (-1 = not among them).

    Returns, for every rank path, the number of steps whose true ranks start with it — the number of times a
    tree containing that node would have accepted it (greedy verification)."""
    counts: Counter[Path] = Counter()
    for row in ranks.tolist():
        prefix: list[int] = []
        for r in row:
            if r < 0:
                break
            prefix.append(int(r))
            counts[tuple(prefix)] += 1
    return counts


def top_paths(counts: Counter[Path] | dict[Path, int], max_nodes: int, max_depth: int | None = None) -> list[Path]:
    """The ``max_nodes`` most frequent paths (ties: shallower, then lexicographic), parents before children.

    Frequencies are monotone along a path, and a parent wins ties with its children, so the result is
    prefix-closed; it is re-checked anyway (a path whose parent is missing is dropped) because counts supplied
    by hand need not be consistent."""
    items = [(p, c) for p, c in counts.items() if c > 0 and (max_depth is None or len(p) <= max_depth)]
    items.sort(key=lambda pc: (-pc[1], len(pc[0]), pc[0]))
    chosen: list[Path] = []
    have: set[Path] = set()
    for p, _ in items:
        if len(chosen) >= max_nodes:
            break
        if len(p) == 1 or p[:-1] in have:
            chosen.append(p)
            have.add(p)
    return chosen


def expected_tokens_curve(paths: Sequence[Path], counts: dict[Path, int], num_steps: int) -> list[float]:
    """``curve[n]`` = expected tokens per target step (accepted + bonus) with the first n paths as the tree."""
    curve = [1.0]
    acc = 0.0
    for p in paths:
        acc += counts.get(tuple(p), 0)
        curve.append(1.0 + acc / max(1, num_steps))
    return curve


def default_paths(topk: Sequence[int]) -> list[Path]:
    """A dense fallback tree when no statistics exist: all paths whose rank product is small, ordered by an
    assumed rank accuracy 1/(rank+1) per depth (shallow, low-rank first)."""
    paths: list[tuple[float, Path]] = []

    def grow(prefix: Path, score: float) -> None:
        d = len(prefix)
        if d == len(topk):
            return
        for r in range(topk[d]):
            s = score * (0.6**d) / (r + 1)
            p = prefix + (r,)
            paths.append((s, p))
            grow(p, s)

    grow((), 1.0)
    paths.sort(key=lambda sp: (-sp[0], len(sp[1]), sp[1]))
    return [p for _, p in paths]


def materialize(paths: Sequence[Path], candidates: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Token ids and parent indices for the rank paths, given ``candidates[d][r]`` (depth d+1, rank r).

    Paths that need a depth or rank the candidates do not have are dropped with their descendants; paths must
    come parents-first (as :func:`top_paths` returns them)."""
    index: dict[Path, int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for p in paths:
        p = tuple(p)
        d, r = len(p) - 1, p[-1]
        if d >= len(candidates) or r >= len(candidates[d]):
            continue
        parent = -1 if d == 0 else index.get(p[:-1])
        if parent is None:
            continue
        index[p] = len(tokens)
        tokens.append(int(candidates[d][r]))
        parents.append(parent)
    return tokens, parents


def _check_parent(i: int, p: int) -> None:
    if p >= i:
        raise ValueError(f"node {i} has parent {p}: nodes must be in topological order")


def depths_of(parents: Sequence[int]) -> list[int]:
    """Depth of each node (1 = child of the root); parents must precede children."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        _check_parent(i, p)
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def tree_attention_mask(parents: Sequence[int], num_prefix: int = 1) -> torch.Tensor:
    """Bool ``[num_prefix + n, num_prefix + n]`` among the step's new tokens: ``num_prefix`` ordinary tokens
    (causal among themselves; the last one is the tree's root) followed by the n nodes, each of which sees all
    prefix tokens, its ancestors and itself (parents must precede children). Built in numpy, a row copy per node:
    through torch's indexing, a few microseconds an op, an 8-node tree's mask took ~0.14 ms of a drafted step."""
    n = len(parents)
    size = num_prefix + n
    mask = np.zeros((size, size), dtype=np.bool_)
    mask[:num_prefix, :num_prefix] = np.tri(num_prefix, dtype=np.bool_)
    mask[num_prefix:, :num_prefix] = True
    for i, p in enumerate(parents):
        _check_parent(i, p)
        row = num_prefix + i
        if p >= 0:
            mask[row, num_prefix:] = mask[num_prefix + p, num_prefix:]
        mask[row, row] = True
    return torch.from_numpy(mask)


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """``children[0]`` are the root's children, ``children[i + 1]`` node i's."""
    ch: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        ch[p + 1].append(i)
    return ch


def path_to(node: int, parents: Sequence[int]) -> list[int]:
    """Node indices from the root's child down to ``node`` (empty for the root, node = -1)."""
    out: list[int] = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def select_by_score(scores: Sequence[float], parents: Sequence[int], max_nodes: int) -> tuple[list[int], list[int]]:
    """A dynamic tree's final cut (EAGLE-2): of grown nodes with cumulative draft probabilities ``scores`` (a
    node's score is its parent's times its own probability, so never above its parent's) and ``parents`` (-1 =
    the root; parents first), keep the ``max_nodes`` best. Ties go to the shallower, then earlier node, so a
    parent always beats its children and the cut is prefix-closed. Returns (kept node indices, parents-first by
    depth; their parents as indices into the kept list)."""
    depths = depths_of(parents)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[: max(0, max_nodes)]
    kept = sorted(order, key=lambda i: (depths[i], i))
    where = {node: j for j, node in enumerate(kept)}
    new_parents = []
    for i in kept:
        p = parents[i]
        if p >= 0 and p not in where:
            raise ValueError(f"node {i} kept without its parent {p}: scores must not grow along a path")
        new_parents.append(-1 if p < 0 else where[p])
    return kept, new_parents


def compaction_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    """(source, destination) node offsets to move the accepted nodes' K/V into sequential slots: accepted node
    ``path[j]`` lives in the slot of node offset ``path[j]`` after the root and belongs in offset ``j``. Sources
    never precede destinations (nodes are topological), so copying all at once after reading is safe."""
    return [(a, j) for j, a in enumerate(path) if a != j]


__all__ = [
    "children_of",
    "compaction_moves",
    "default_paths",
    "depths_of",
    "expected_tokens_curve",
    "materialize",
    "path_to",
    "rank_path_counts",
    "select_by_score",
    "top_paths",
    "tree_attention_mask",
]
