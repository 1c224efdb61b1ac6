"""Token Recycling: draft trees from the candidates the target itself ranked at earlier verified rows (Luo et al.
2024). Needs no trained artefact, so it works on any model.

Every verified row already computes the target's logits over the whole vocabulary for the token at that row; the
verifier keeps the argmax (or one sample) and throws the rest away. This drafter keeps, for every token ``t``, the
``top_k`` tokens the target ranked highest the last time it ran a row whose input was ``t``: a ``vocab x top_k``
successor matrix, one per engine, shared by every request of the model and updated at every verified row,
accepted or rejected (and at plain decoding steps). A draft tree grows from the sequence's last token by
following the matrix: a child of node ``u`` is one of ``u``'s recorded successors.

Two tree shapes (``tree`` option):

- ``"static"``: one template of rank paths for every request (the paper's breadth-first template, learned here):
  path ``(r1, .., rd)`` means "successor rank r1 of the root, then rank r2 of that token, ...". The engine keeps,
  per depth and rank, how often a node of that depth and rank was accepted when its parent was; a path's
  acceptance estimate is the product along it, and the template is the best-first set of paths by that estimate,
  so any prefix of it is a tree (parents come first) and its expected accepted length is the sum of the estimates.
- ``"dynamic"``: the target's recorded probability of each successor instead of a per-rank average; the tree is
  the best-first expansion by the product of those probabilities along the path (calibrated by the measured
  ratio of accepted nodes to the probabilities' sum).

The tree size is the one that maximises expected tokens per second under the engine's measured step-cost model
(0: plain decoding pays better), or fixed by ``tree_nodes``. Verification is the engine's tree verifier (exact for
greedy decoding, the target's distribution for sampling: drafts are deterministic).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, get_args

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.layer_ops import record_successors
from leapdecode.speculative.method import AutoUse, Method
from leapdecode.speculative.options import check, is_int
from leapdecode.speculative.policy import TreeRealism
from leapdecode.speculative.proposer import EngineView, Proposal, Proposer, StepCost, Verification, tree_proposal

RecyclingTree = Literal["static", "dynamic"]
RECYCLING_TREES: tuple[str, ...] = get_args(RecyclingTree)

PRIOR_TOP1 = 0.45  # before any measurement: rank r accepted with PRIOR_TOP1 / (r + 1) when its parent was
PRIOR_WEIGHT = 4.0  # the prior's weight, in verifications
RESIZE_EVERY = 64  # verified trees between recomputations of the template and its best sizes
MAX_NODES = 32  # the largest tree ever sized (rows cost too much beyond it on any CPU measured)
SIZE_MARGIN = 1.02  # a larger tree must promise 2% more tokens per second than the next smaller one
DEFAULT_NODES = 8  # tree size without a step-cost model
SAVE_EVERY = 64  # finished requests between writes of the matrix to matrix_path


@dataclass(frozen=True)
class RecyclingOptions:
    """The successor matrix keeps ``top_k`` next tokens per token; the ``tree`` is the learned ``"static"`` rank
    template or ``"dynamic"`` (by the recorded probabilities), at most ``tree_depth`` deep; ``tree_nodes`` fixes its
    size (None: the step-cost model sizes it); ``matrix_path``: load the matrix from this file at start and save it
    there as requests finish (None: kept in memory only)."""

    top_k: int = 8
    tree: RecyclingTree = "static"
    tree_nodes: int | None = None
    tree_depth: int = 6
    matrix_path: str | None = None

    def __post_init__(self) -> None:
        check(is_int(self.top_k, 1), f"top_k must be an integer >= 1, got {self.top_k!r}")
        check(self.tree in RECYCLING_TREES, f"recycling tree must be one of {RECYCLING_TREES}, got {self.tree!r}")
        check(self.tree_nodes is None or is_int(self.tree_nodes, 0),
              f"tree_nodes must be an integer >= 0, got {self.tree_nodes!r}")
        check(is_int(self.tree_depth, 1), f"tree_depth must be an integer >= 1, got {self.tree_depth!r}")
        check(self.matrix_path is None or isinstance(self.matrix_path, str),
              f"matrix_path must be a file path, got {self.matrix_path!r}")


class Node(NamedTuple):
    """One grown tree node: its token, its parent's index (-1: the root) and its acceptance estimate. A named tuple:
    the suffix and recycling drafters build up to a tree's worth of them on every step (a frozen dataclass cost
    ~1 us each to make)."""

    token: int
    parent: int
    score: float


class SuccessorMatrix:
    """``vocab x top_k``: the target's top-ranked next tokens after each token, with their probabilities, as of
    the last verified row that had the token as input (-1: never seen)."""

    def __init__(self, vocab_size: int, top_k: int) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.vocab_size, self.top_k = vocab_size, top_k
        self.tokens = torch.full((vocab_size, top_k), -1, dtype=torch.int32)
        self.probs = torch.zeros(vocab_size, top_k, dtype=torch.float16)
        # the same memory as numpy arrays: the per-step lookups (has, successors, probabilities) read single
        # entries, which costs ~10 us through a tensor index and well under 1 us here
        self._ids = self.tokens.numpy()
        self._probs = self.probs.numpy()
        self.num_updates = 0

    def update(self, tokens: list[int], logits: torch.Tensor) -> None:
        """``logits[i]`` are the target's logits at a row whose input token is ``tokens[i]``. A token given twice
        keeps its last row."""
        if not tokens:
            return
        record_successors(logits.detach().float(), tokens, self.tokens, self.probs)
        self.num_updates += len(tokens)

    def successors(self, token: int) -> list[int]:
        """The recorded successors of ``token`` by rank (-1 where none was recorded)."""
        return self._ids[token].tolist() if 0 <= token < self.vocab_size else [-1] * self.top_k

    def probabilities(self, token: int) -> list[float]:
        """The probabilities recorded with ``token``'s successors, by rank (0 where none was recorded)."""
        return self._probs[token].tolist()

    def has(self, token: int) -> bool:
        return 0 <= token < self.vocab_size and bool(self._ids[token, 0] >= 0)

    def memory_bytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size() + self.probs.numel() * self.probs.element_size()

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save({"vocab_size": self.vocab_size, "top_k": self.top_k, "tokens": self.tokens,
                    "probs": self.probs}, tmp)
        tmp.replace(path)

    def load(self, path: str | Path) -> bool:
        """Fill from a saved matrix of the same shape; False (nothing changed) when the file is absent. A file of
        another vocabulary or width is refused."""
        path = Path(path)
        if not path.exists():
            return False
        data = torch.load(path, map_location="cpu", weights_only=True)
        if (data["vocab_size"], data["top_k"]) != (self.vocab_size, self.top_k):
            raise ValueError(f"{path}: a successor matrix of vocab {data['vocab_size']} x top_k {data['top_k']}, "
                             f"this model needs {self.vocab_size} x {self.top_k}")
        self.tokens.copy_(data["tokens"])
        self.probs.copy_(data["probs"])
        return True


class RankStats:
    """Per depth (1 = the root's children, the deepest shared by all deeper ones) and successor rank: how often
    such a node was accepted when its parent was (a Beta prior of ``PRIOR_WEIGHT`` verifications first)."""

    def __init__(self, top_k: int, max_depth: int) -> None:
        self.top_k, self.max_depth = top_k, max_depth
        prior = torch.tensor([PRIOR_TOP1 / (r + 1) for r in range(top_k)], dtype=torch.float64)
        self.hits = (prior * PRIOR_WEIGHT).repeat(max_depth, 1)
        self.tries = torch.full((max_depth, top_k), PRIOR_WEIGHT, dtype=torch.float64)

    def rate(self) -> list[list[float]]:
        return (self.hits / self.tries).tolist()

    def record(self, paths: list[tuple[int, ...]], accepted: list[int]) -> None:
        """A verified tree of rank ``paths`` (node i's path, parents first) and its accepted node indices: every
        node whose parent was accepted (or is the root) was tried; the accepted ones hit."""
        on_path = {tuple(paths[i]) for i in accepted}
        for i, p in enumerate(paths):
            if len(p) > 1 and p[:-1] not in on_path:
                continue
            d = min(len(p), self.max_depth) - 1
            self.tries[d, p[-1]] += 1
            if i in accepted:
                self.hits[d, p[-1]] += 1

    def template(self, max_nodes: int) -> tuple[list[tuple[int, ...]], list[float]]:
        """The best-first rank paths (at most ``max_nodes``, parents first) and their acceptance estimates."""
        q = self.rate()
        heap: list[tuple[float, tuple[int, ...]]] = [(-q[0][r], (r,)) for r in range(self.top_k)]
        heapq.heapify(heap)
        paths: list[tuple[int, ...]] = []
        scores: list[float] = []
        while heap and len(paths) < max_nodes:
            neg, p = heapq.heappop(heap)
            paths.append(p)
            scores.append(-neg)
            if len(p) < self.max_depth:
                d = len(p)
                for r in range(self.top_k):
                    heapq.heappush(heap, (neg * q[d][r], (*p, r)))
        return paths, scores


def grow_static(matrix: SuccessorMatrix, root: int, paths: list[tuple[int, ...]]) -> tuple[list[int], list[int],
                                                                                            list[int]]:
    """Tokens, parents and template indices of the rank ``paths`` grown from ``root`` through the matrix; a path
    whose token (or an ancestor's) was never recorded is dropped. Duplicate siblings cannot occur (a row's top-k are
    distinct)."""
    index: dict[tuple[int, ...], int] = {(): -1}
    token_of: dict[tuple[int, ...], int] = {(): root}
    rows: dict[int, list[int]] = {}
    tokens: list[int] = []
    parents: list[int] = []
    used: list[int] = []
    for j, p in enumerate(paths):
        parent = p[:-1]
        if parent not in index:
            continue
        u = token_of[parent]
        succ = rows.get(u)
        if succ is None:
            succ = rows[u] = matrix.successors(u)
        t = succ[p[-1]]
        if t < 0:
            continue
        index[p], token_of[p] = len(tokens), t
        tokens.append(t)
        parents.append(index[parent])
        used.append(j)
    return tokens, parents, used


def grow_dynamic(matrix: SuccessorMatrix, root: int, max_nodes: int, max_depth: int) -> list[Node]:
    """Best-first expansion from ``root`` by the product of recorded successor probabilities along the path: pop
    order is parents first, so any prefix of the result is a tree."""
    out: list[Node] = []
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, tiebreak, token, parent index, depth)
    count = 0

    def push(token: int, parent: int, score: float, depth: int) -> None:
        nonlocal count
        if depth > max_depth or not matrix.has(token):
            return
        toks = matrix.successors(token)
        probs = matrix.probabilities(token)
        for t, p in zip(toks, probs):
            if t >= 0:
                heapq.heappush(heap, (-score * p, count, t, parent, depth))
                count += 1

    push(root, -1, 1.0, 1)
    while heap and len(out) < max_nodes:
        neg, _, t, parent, depth = heapq.heappop(heap)
        out.append(Node(t, parent, -neg))
        push(t, len(out) - 1, -neg, depth + 1)
    return out


def best_size(curve: list[float], cost: StepCost, batch: int, limit: int) -> int:
    """argmax_n of (batch - 1 + curve[n]) / t(batch + n) for n <= limit, against plain ``batch / t(batch)``; a larger
    tree must beat the best smaller one by ``SIZE_MARGIN``."""
    best, best_rate = 0, batch / max(cost(batch), 1e-12)
    for n in range(1, min(limit, len(curve) - 1) + 1):
        rate = (batch - 1 + curve[n]) / max(cost(batch + n), 1e-12)
        if rate > best_rate * SIZE_MARGIN:
            best, best_rate = n, rate
    return best


@dataclass
class Drafted:
    """What a sequence's last proposal was, for the statistics its verification updates."""

    num_tokens: int  # the sequence's length when drafted
    paths: list[tuple[int, ...]]  # static: each node's rank path
    scores: list[float]  # each node's acceptance estimate


class RecyclingProposer(Proposer):
    """Trees from the engine's successor matrix. Per request it keeps only its last proposal (``Drafted``); the
    matrix and the rank statistics are the engine's."""

    name = "recycling"
    observes_rows = True  # the matrix learns from every verified row, whoever drafted, and from plain steps

    def __init__(self, vocab_size: int, top_k: int = 8, tree: str = "static", tree_nodes: int | None = None,
                 tree_depth: int = 6, matrix_path: str | None = None) -> None:
        if tree not in ("static", "dynamic"):
            raise ValueError(f'recycling tree must be "static" or "dynamic", got {tree!r}')
        self.matrix = SuccessorMatrix(vocab_size, top_k)
        self.stats = RankStats(top_k, tree_depth)
        self.tree, self.tree_nodes, self.tree_depth = tree, tree_nodes, tree_depth
        self.matrix_path = matrix_path
        if matrix_path is not None:
            self.matrix.load(matrix_path)
        self._drafted: dict[str, Drafted] = {}
        self._grown: dict[str, tuple[int, list[Node]]] = {}
        self._paths, self._scores = self.stats.template(MAX_NODES)
        self._best: dict[int, int] = {}
        self._since_resize = 0
        # dynamic trees: accepted nodes over the recorded probabilities' sum, over recent verifications (drifts
        # back while no tree is sized, so a few early failed trees cannot keep it out for good)
        self.calib = TreeRealism()
        self.num_released = 0

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, view: EngineView) -> RecyclingProposer:
        opts = cfg.options(RecyclingOptions)
        return cls(view.model.config.vocab_size, opts.top_k, opts.tree, opts.tree_nodes, opts.tree_depth,
                   opts.matrix_path)

    # ------------------------------------------------------------------------------------------ learning
    def observe_rows(self, tokens: list[int], logits: torch.Tensor) -> None:
        """The target's logits at verified rows (input tokens ``tokens``): the matrix learns each row's top-k."""
        self.matrix.update(tokens, logits)

    def on_verified(self, seq: Sequence, result: Verification) -> None:
        drafted = self._drafted.pop(seq.request_id, None)
        if drafted is None or not drafted.scores:
            return
        accepted = list(result.accepted)
        if self.tree == "static":
            self.stats.record(drafted.paths, accepted)
        else:
            self.calib.record(self.name, sum(drafted.scores), len(accepted))
        self._since_resize += 1
        if self._since_resize >= RESIZE_EVERY:
            self._since_resize = 0
            self._paths, self._scores = self.stats.template(MAX_NODES)
            self._best.clear()

    def release(self, seq: Sequence) -> None:
        self._drafted.pop(seq.request_id, None)
        self._grown.pop(seq.request_id, None)
        self.num_released += 1
        if self.matrix_path is not None and self.num_released % SAVE_EVERY == 0:
            self.matrix.save(self.matrix_path)

    def save(self) -> None:
        """Write the matrix to ``matrix_path`` (if one is set)."""
        if self.matrix_path is not None:
            self.matrix.save(self.matrix_path)

    # ------------------------------------------------------------------------------------------ sizing
    def has_draft(self, seq: Sequence) -> bool:
        return self.matrix.has(seq.token_ids[-1])

    def calibration(self) -> float:
        return min(1.0, self.calib.ratio(self.name))

    def _dynamic(self, seq: Sequence) -> list[Node]:
        grown = self._grown.get(seq.request_id)
        if grown is None or grown[0] != seq.num_tokens:
            limit = self.tree_nodes if self.tree_nodes is not None else MAX_NODES
            grown = (seq.num_tokens, grow_dynamic(self.matrix, seq.token_ids[-1], limit, self.tree_depth))
            self._grown[seq.request_id] = grown
        return grown[1]

    def curve(self, seq: Sequence) -> list[float]:
        """``curve[n]``: expected tokens per step with the first n nodes."""
        if self.tree == "static":
            scores = self._scores
        else:
            c = self.calibration()
            scores = [c * node.score for node in self._dynamic(seq)]
        out = [1.0]
        for s in scores:
            out.append(out[-1] + s)
        return out

    def tree_budget(self, seq: Sequence, room: int, cost: StepCost | None, batch: int) -> tuple[int, float]:
        curve = self.curve(seq)
        if self.tree_nodes is not None:
            n = self.tree_nodes
        elif cost is None:
            n = DEFAULT_NODES
        elif self.tree == "static":
            if batch not in self._best:
                self._best[batch] = best_size(curve, cost, batch, MAX_NODES)
            n = self._best[batch]
        else:
            n = best_size(curve, cost, batch, MAX_NODES)
            if n == 0 and len(curve) > 1:
                self.calib.fade(self.name)
        n = max(0, min(n, room, len(curve) - 1))
        return n, curve[n]

    # ------------------------------------------------------------------------------------------ proposing
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, budgets):
            if k <= 0:
                out.append(Proposal([]))
                continue
            tokens, parents, drafted = self._tree(seq, k)
            self._drafted[seq.request_id] = drafted
            out.append(tree_proposal(tokens, parents))
        return out

    def peek(self, seq: Sequence, budget: int) -> Proposal:
        if budget <= 0:
            return Proposal([])
        tokens, parents, _ = self._tree(seq, budget)
        return tree_proposal(tokens, parents)

    def _tree(self, seq: Sequence, k: int) -> tuple[list[int], list[int], Drafted]:
        """``seq``'s tree of at most ``k`` nodes from its last token, and what its verification will learn from."""
        if self.tree == "static":
            tokens, parents, used = grow_static(self.matrix, seq.token_ids[-1], self._paths[:k])
            return tokens, parents, Drafted(seq.num_tokens, [self._paths[j] for j in used],
                                            [self._scores[j] for j in used])
        nodes = self._dynamic(seq)[:k]
        scores = [n.score for n in nodes]
        return [n.token for n in nodes], [n.parent for n in nodes], Drafted(seq.num_tokens, [], scores)

    def memory_bytes(self) -> int:
        return self.matrix.memory_bytes()


METHOD = Method(
    name="recycling",
    options=(RecyclingOptions,),
    shared=frozenset({"use_cost_model"}),
    build=lambda cfg, view, auto: RecyclingProposer.from_config(cfg, view),
    # training-free: usable on any model; under auto with its default options
    auto=AutoUse("separate", rank=3, usable=lambda cfg, target: True),
    bench={"recycling_dynamic": {"method": "recycling", "tree": "dynamic"}},
)

__all__ = ["METHOD", "Node", "RankStats", "RecyclingOptions", "RecyclingProposer", "SuccessorMatrix", "best_size",
           "grow_dynamic", "grow_static"]
