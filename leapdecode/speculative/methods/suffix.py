"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024): draft trees from what followed the sequence's latest
tokens elsewhere in its own prompt and output, or in recent requests' outputs. No trained artefact: any model.

The index is a suffix trie cut at ``max_depth`` tokens: every substring of at most that length of the indexed
text is a path from the root, and each node counts the occurrences of its substring. Two of them:

- per request, over its prompt and output, extended by each committed token (``max_depth`` nodes touched per
  token, through the list of nodes that end at the newest token);
- one per engine (one served model) over the outputs of recent finished requests, bounded in memory: whole
  requests leave least recently used first (their substrings' counts taken back, empty nodes freed) while the
  trie's measured size is above ``global_cache_mb``. A request is used when it joins and whenever a draft from
  the global trie is accepted: each node remembers the latest request that went through it, and the deepest
  accepted node's request moves to the back of the queue. The trie can be saved to and loaded from
  ``suffix_cache_path``. A request's output joins only if ``global_tree`` is on (the engine's setting) and the
  request's ``SamplingParams.share_output`` is true (the default of the Python API; ``leapdecode serve
  --no-share-output`` makes it false for requests that do not say): a server for several users keeps each
  user's text out of the others' drafts that way.

Drafting matches the longest suffix of the sequence (at most ``max_match`` tokens) that occurred before with a
continuation, then grows a tree best-first from that node by the empirical probability of each continuation
(a child's count over its siblings' total, multiplied along the path), keeping nodes above ``min_token_prob``,
at most ``max_spec_factor`` nodes per matched token (a longer match is a more reliable one) and at most what the
step-cost model finds pays. The per-request and the global tree each propose; the one with the larger expected
accepted length drafts. Verification is the engine's tree verifier (lossless).
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.sequence import Sequence
from leapdecode.kernels import extension
from leapdecode.speculative.method import AutoUse, Method
from leapdecode.speculative.methods.recycling import Node, best_size
from leapdecode.speculative.options import check, is_int, is_prob
from leapdecode.speculative.policy import TreeRealism
from leapdecode.speculative.proposer import Proposal, Proposer, StepCost, Verification, tree_proposal

NODE_BYTES = 260  # Python bytes per trie node, measured with tracemalloc (object, child dict, parent entry)
TEXT_BYTES = 150  # a kept text's array and its entry in the cache's order
MAX_NODES = 32  # the largest tree ever sized
DEFAULT_NODES = 8  # tree size without a step-cost model
SAVE_EVERY = 64  # finished requests between writes of the global trie to suffix_cache_path


@dataclass(frozen=True)
class SuffixOptions:
    """Tries cut at ``max_depth`` tokens; a match of at most ``max_match`` tokens; at most ``max_spec_factor`` tree
    nodes per matched token, none below ``min_token_prob``; ``tree_nodes`` fixes the size cap (None: the step-cost
    model); ``global_tree``: finished requests' outputs join the engine's trie that every request drafts from
    (off: each request drafts from its own text only; a request's ``SamplingParams.share_output=False`` keeps its
    own output out); ``global_cache_mb`` bounds that trie (least recently used requests leave first);
    ``suffix_cache_path`` saves and loads it."""

    max_depth: int = 24
    max_match: int = 16
    max_spec_factor: float = 2.0
    min_token_prob: float = 0.1
    tree_nodes: int | None = None
    global_tree: bool = True
    global_cache_mb: float = 64.0
    suffix_cache_path: str | None = None

    def __post_init__(self) -> None:
        check(is_int(self.max_depth, 2), f"max_depth must be an integer >= 2, got {self.max_depth!r}")
        check(is_int(self.max_match, 1), f"max_match must be an integer >= 1, got {self.max_match!r}")
        for key in ("max_spec_factor", "global_cache_mb"):
            v = getattr(self, key)
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                  f"{key} must be a positive number, got {v!r}")
        check(is_prob(self.min_token_prob), f"min_token_prob must be a number in [0, 1], got {self.min_token_prob!r}")
        check(self.tree_nodes is None or is_int(self.tree_nodes, 0),
              f"tree_nodes must be an integer >= 0, got {self.tree_nodes!r}")
        check(isinstance(self.global_tree, bool), f"global_tree must be true or false, got {self.global_tree!r}")
        check(self.suffix_cache_path is None or isinstance(self.suffix_cache_path, str),
              f"suffix_cache_path must be a file path, got {self.suffix_cache_path!r}")


class TrieNode:
    """A substring's occurrence count, its continuations and the latest text (``owner``, a serial number; 0: a
    per-request trie's) that went through it."""

    __slots__ = ("count", "children", "owner")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, TrieNode] | None = None
        self.owner = 0


class SuffixTrie:
    """Occurrence counts of every substring of at most ``max_depth`` tokens of the inserted texts."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = TrieNode()
        self.num_nodes = 0

    def _child(self, node: TrieNode, token: int) -> TrieNode:
        if node.children is None:
            node.children = {}
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = TrieNode()
            self.num_nodes += 1
        return child

    def extend(self, active: list[TrieNode], token: int, owner: int = 0) -> list[TrieNode]:
        """Append ``token`` to a text (serial number ``owner``) whose suffixes (lengths 1.., shorter first, below
        ``max_depth``) end at the nodes ``active``; returns the new text's suffix nodes."""
        new = [self._child(self.root, token)]
        for node in active[: self.max_depth - 1]:
            new.append(self._child(node, token))
        for node in new:
            node.count += 1
            node.owner = owner
        return new[: self.max_depth - 1]

    def add(self, tokens: list[int], owner: int = 0) -> None:
        active: list[TrieNode] = []
        for t in tokens:
            active = self.extend(active, t, owner)

    def remove(self, tokens: list[int]) -> None:
        """Take back a text ``add`` inserted: every substring's count drops by one; nodes at zero are freed."""
        d = self.max_depth
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i : i + d]:
                assert node.children is not None and t in node.children, "removing a text that was not added"
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    self.num_nodes -= self._size(child)
                    del node.children[t]
                    break
                node = child

    def _size(self, node: TrieNode) -> int:
        n, stack = 0, [node]
        while stack:
            x = stack.pop()
            n += 1
            if x.children:
                stack.extend(x.children.values())
        return n

    def match(self, context: list[int], max_match: int) -> tuple[TrieNode | None, int]:
        """The node of the longest suffix of ``context`` (at most ``max_match`` tokens) that occurred with a
        continuation, and its length (0: none). Such suffixes are nested (a suffix of one that occurred with a
        continuation did too), so the search stops at the first length that fails."""
        best: TrieNode | None = None
        length = 0
        for m in range(1, min(max_match, len(context), self.max_depth - 1) + 1):
            node: TrieNode | None = self.root
            for t in context[len(context) - m :]:
                node = node.children.get(t) if node is not None and node.children else None
                if node is None:
                    break
            if node is None or not node.children:
                break
            best, length = node, m
        return best, length

    def draft(self, node: TrieNode, max_nodes: int, min_prob: float, max_depth: int) -> list[Node]:
        """Best-first continuations of ``node`` by path probability (children counts over their total), parents
        first; no node below ``min_prob`` or deeper than ``max_depth``."""
        return self.draft_nodes(node, max_nodes, min_prob, max_depth)[0]

    def draft_nodes(self, node: TrieNode, max_nodes: int, min_prob: float,
                    max_depth: int) -> tuple[list[Node], list[TrieNode]]:
        """:meth:`draft`, with the trie node of each tree node."""
        out: list[Node] = []
        where: list[TrieNode] = []
        heap: list[tuple[float, int, int, int, TrieNode, int]] = []
        seq = 0

        def push(parent_node: TrieNode, parent: int, score: float, depth: int) -> None:
            nonlocal seq
            kids = parent_node.children
            if not kids or depth > max_depth:
                return
            total = sum(c.count for c in kids.values())
            for t, c in kids.items():
                s = score * c.count / total
                if s >= min_prob:
                    heapq.heappush(heap, (-s, seq, t, parent, c, depth))
                    seq += 1

        push(node, -1, 1.0, 1)
        while heap and len(out) < max_nodes:
            neg, _, t, parent, c, depth = heapq.heappop(heap)
            out.append(Node(t, parent, -neg))
            where.append(c)
            push(c, len(out) - 1, -neg, depth + 1)
        return out, where

    @staticmethod
    def owner_of(node: TrieNode) -> int:
        return node.owner

    def memory_bytes(self) -> int:
        return self.num_nodes * NODE_BYTES

    live_bytes = memory_bytes  # freed nodes go back to Python's allocator


class GlobalSuffixCache:
    """The engine's trie over recent requests' outputs, bounded by ``cap_mb``: the least recently used requests
    leave first (a request is used when it joins and when :meth:`touch` finds a draft from its text accepted).
    The trie is C++ where the CPU kernels are loaded (``native`` None, as for a request's own trie), else
    Python's."""

    def __init__(self, max_depth: int, cap_mb: float, path: str | None = None, native: bool | None = None) -> None:
        native = extension.ext is not None if native is None else native
        self.trie: SuffixTrie | NativeSuffixTrie = NativeSuffixTrie(max_depth) if native else SuffixTrie(max_depth)
        self.cap_bytes = int(cap_mb * 2**20)
        self.texts: OrderedDict[str, array] = OrderedDict()  # request -> its output (int32s), least recent first
        self.serials: dict[str, int] = {}  # request -> the serial number its trie nodes name as their owner
        self.keys: dict[int, str] = {}  # and back
        self._next_serial = 1  # 0 is no owner
        self.num_tokens = 0
        self.path = path
        self.num_evicted = 0
        self.num_touched = 0
        if path is not None and Path(path).exists():
            for key, tokens in torch.load(path, weights_only=True).items():
                self.add(key, list(tokens))

    def add(self, key: str, tokens: list[int]) -> None:
        if not tokens:
            return
        if key in self.texts:
            self._drop(key)
        serial, self._next_serial = self._next_serial, self._next_serial + 1
        self.texts[key] = array("i", tokens)
        self.serials[key], self.keys[serial] = serial, key
        self.num_tokens += len(tokens)
        self.trie.add(tokens, serial)
        while self.live_bytes() > self.cap_bytes and self.texts:
            self._drop(next(iter(self.texts)))
            self.num_evicted += 1

    def touch(self, node: TrieNode | int) -> None:
        """A draft through ``node`` was accepted: the latest request whose text went through it becomes the most
        recently used (nothing when that request has left; in the C++ trie a node freed since may name the text
        that reused it: the order is a hint, drafts stay verified)."""
        key = self.keys.get(self.trie.owner_of(node))
        if key is not None:
            self.texts.move_to_end(key)
            self.num_touched += 1

    def clear(self) -> None:
        """Every request leaves (``path``'s file stays as it is)."""
        while self.texts:
            self._drop(next(iter(self.texts)))

    def _drop(self, key: str) -> None:
        old = self.texts.pop(key)
        del self.keys[self.serials.pop(key)]
        self.num_tokens -= len(old)
        self.trie.remove(old.tolist())

    def save(self) -> None:
        if self.path is None:
            return
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save({k: v.tolist() for k, v in self.texts.items()}, tmp)
        tmp.replace(path)

    def memory_bytes(self) -> int:
        """The trie's bytes plus the kept texts (int32 arrays, ~TEXT_BYTES of bookkeeping each: the order, the
        serial numbers)."""
        return self.trie.memory_bytes() + self._texts_bytes()

    def live_bytes(self) -> int:
        """What ``cap_mb`` bounds: the trie's live nodes and the kept texts. The C++ trie keeps freed nodes' slots
        for reuse, so its allocation stays at its high-water mark: the cap plus one text's nodes, and up to about
        twice that where its arrays and table last doubled (1.64x a 2 MB cap after 1,000 requests, measured)."""
        return self.trie.live_bytes() + self._texts_bytes()

    def _texts_bytes(self) -> int:
        return 4 * self.num_tokens + TEXT_BYTES * len(self.texts)


class RequestTrie(SuffixTrie):
    """One request's trie over its prompt and output, extended as its tokens arrive (``active``: the text's suffix
    nodes)."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self.active: list[TrieNode] = []

    def append(self, tokens: list[int]) -> None:
        for t in tokens:
            self.active = self.extend(self.active, t)


class NativeTrie:
    """A trie of kernels/suffix_index.cpp: the same counts, matches and trees as :class:`SuffixTrie`, node for node
    (tests/test_suffix.py), at ~2 us an indexed token where Python's objects cost ~40 us, and ~50 bytes a node
    where Python's take ~260 in objects the garbage collector walks. Nodes are ints here (None: no match)."""

    def __init__(self, max_depth: int) -> None:
        self._index = extension.ext.SuffixIndex(max_depth)

    def match(self, context: list[int], max_match: int) -> tuple[int | None, int]:
        node, length = self._index.match(context, max_match)
        return (node if node >= 0 else None), length

    def draft_nodes(self, node: int, max_nodes: int, min_prob: float, max_depth: int) -> tuple[list[Node], list[int]]:
        tokens, parents, scores, where = self._index.draft(node, max_nodes, min_prob, max_depth)
        return [Node(t, p, sc) for t, p, sc in zip(tokens, parents, scores)], where

    @property
    def num_nodes(self) -> int:
        return self._index.num_nodes

    def memory_bytes(self) -> int:
        """Bytes allocated: a freed node's slot stays allocated for reuse, so this is the high-water mark."""
        return self._index.memory_bytes()

    def live_bytes(self) -> int:
        """Bytes the live nodes need (what a cap bounds)."""
        return self._index.live_bytes()


class NativeRequestTrie(NativeTrie):
    """:class:`RequestTrie` in C++: one request's text, extended as its tokens arrive."""

    def append(self, tokens: list[int]) -> None:
        self._index.append(tokens)


class NativeSuffixTrie(NativeTrie):
    """The global cache's :class:`SuffixTrie` in C++: whole texts join (naming their owner) and leave."""

    def add(self, tokens: list[int], owner: int = 0) -> None:
        self._index.add(tokens, owner)

    def remove(self, tokens: list[int]) -> None:
        self._index.remove(tokens)

    def owner_of(self, node: int) -> int:
        return self._index.owner(node)


def request_trie(max_depth: int) -> RequestTrie | NativeRequestTrie:
    """A request's own trie: in C++ where the kernels are built, else in Python."""
    return NativeRequestTrie(max_depth) if extension.ext is not None else RequestTrie(max_depth)


@dataclass
class RequestIndex:
    """A request's own trie over its prompt and output, and what it drafted last."""

    trie: RequestTrie | NativeRequestTrie
    done: int = 0  # tokens indexed
    grown: tuple[int, list[Node]] = (-1, [])  # (sequence length, the tree) of the last sizing
    grown_from: list[TrieNode] | list[int] | None = None  # the global trie's node of each tree node (None: own)
    drafted: list[Node] = field(default_factory=list)
    drafted_from: list[TrieNode] | list[int] | None = None


def _proposal(nodes: list[Node]) -> Proposal:
    """The draft tree of these nodes (each parent before its children), or no draft."""
    return tree_proposal([n.token for n in nodes], [n.parent for n in nodes])


class SuffixProposer(Proposer):
    """Trees from the request's own trie and the engine's global one. Per request (keyed by request id) it keeps
    its trie and last tree; the global cache is the engine's."""

    name = "suffix"

    def __init__(self, opts: SuffixOptions | None = None) -> None:
        self.opts = opts = opts or SuffixOptions()
        self.cache = GlobalSuffixCache(opts.max_depth, opts.global_cache_mb, opts.suffix_cache_path) \
            if opts.global_tree or opts.suffix_cache_path is not None else None
        self._requests: dict[str, RequestIndex] = {}
        # accepted nodes over the path probabilities' sum, over recent verifications (calibrates expectations; it
        # drifts back while no tree is sized, so a few early failed trees cannot keep suffix out for good)
        self.calib = TreeRealism()
        self.num_released = 0

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig) -> SuffixProposer:
        return cls(cfg.options(SuffixOptions))

    # ------------------------------------------------------------------------------------------ indexing
    def _index(self, seq: Sequence) -> RequestIndex:
        idx = self._requests.get(seq.request_id)
        if idx is None:
            idx = self._requests[seq.request_id] = RequestIndex(request_trie(self.opts.max_depth))
        toks = seq.token_ids
        if idx.done < len(toks):
            idx.trie.append(toks[idx.done :])
            idx.done = len(toks)
        return idx

    def grow(self, seq: Sequence) -> list[Node]:
        """``seq``'s best tree this step (cached per sequence length): from its own trie and the global one, the
        one with the larger expected accepted length."""
        idx = self._index(seq)
        if idx.grown[0] == seq.num_tokens:
            return idx.grown[1]
        o = self.opts
        ctx = seq.token_ids[-o.max_match :]
        best: list[Node] = []
        idx.grown_from = None
        tries = [idx.trie] + ([self.cache.trie] if self.cache is not None else [])
        for trie in tries:
            node, length = trie.match(ctx, o.max_match)
            if node is None:
                continue
            limit = min(MAX_NODES, max(1, int(o.max_spec_factor * length)))
            if o.tree_nodes is not None:
                limit = min(limit, o.tree_nodes)
            nodes, where = trie.draft_nodes(node, limit, o.min_token_prob, o.max_depth - length)
            if sum(n.score for n in nodes) > sum(n.score for n in best):
                best = nodes
                idx.grown_from = where if trie is not idx.trie else None
        idx.grown = (seq.num_tokens, best)
        return best

    # ------------------------------------------------------------------------------------------ sizing
    def has_draft(self, seq: Sequence) -> bool:
        return bool(self.grow(seq))

    def calibration(self) -> float:
        return min(1.0, self.calib.ratio(self.name))

    def tree_budget(self, seq: Sequence, room: int, cost: StepCost | None, batch: int) -> tuple[int, float]:
        nodes = self.grow(seq)
        c = self.calibration()
        curve = [1.0]
        for n in nodes:
            curve.append(curve[-1] + c * n.score)
        if self.opts.tree_nodes is not None:
            k = self.opts.tree_nodes
        elif cost is None:
            k = DEFAULT_NODES
        else:
            k = best_size(curve, cost, batch, MAX_NODES)
        k = max(0, min(k, room, len(nodes)))
        if k == 0 and nodes:
            self.calib.fade(self.name)
        return k, curve[k]

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, budgets):
            nodes = self.grow(seq)[:k] if k > 0 else []
            idx = self._index(seq)
            idx.drafted = nodes
            idx.drafted_from = idx.grown_from[:k] if nodes and idx.grown_from is not None else None
            out.append(_proposal(nodes))
        return out

    def peek(self, seq: Sequence, budget: int) -> Proposal:
        return _proposal(self.grow(seq)[:budget] if budget > 0 else [])

    # ------------------------------------------------------------------------------------------ learning
    def on_verified(self, seq: Sequence, result: Verification) -> None:
        idx = self._requests.get(seq.request_id)
        if idx is None or not idx.drafted:
            return
        self.calib.record(self.name, sum(n.score for n in idx.drafted), result.num_accepted)
        if idx.drafted_from is not None and result.accepted and self.cache is not None \
                and result.accepted[-1] < len(idx.drafted_from):
            self.cache.touch(idx.drafted_from[result.accepted[-1]])  # the text that drafted it stays longer
        idx.drafted, idx.drafted_from = [], None

    def release(self, seq: Sequence) -> None:
        """The request is done: its trie is freed; its output joins the global trie (``global_tree``, unless the
        request's ``share_output`` is false)."""
        self._requests.pop(seq.request_id, None)
        if self.cache is None or not self.opts.global_tree or not seq.params.share_output:
            return
        self.cache.add(seq.request_id, list(seq.token_ids[seq.num_prompt_tokens :]))
        self.num_released += 1
        if self.opts.suffix_cache_path is not None and self.num_released % SAVE_EVERY == 0:
            self.cache.save()

    def save(self) -> None:
        if self.cache is not None:
            self.cache.save()

    def forget_requests(self) -> None:
        """The global trie forgets every earlier request's output."""
        if self.cache is not None:
            self.cache.clear()

    def memory_bytes(self) -> int:
        own = sum(idx.trie.memory_bytes() for idx in self._requests.values())
        return own + (self.cache.memory_bytes() if self.cache is not None else 0)


METHOD = Method(
    name="suffix",
    options=(SuffixOptions,),
    shared=frozenset({"use_cost_model"}),
    build=lambda cfg, view, auto: SuffixProposer.from_config(cfg),
    # training-free: usable on any model; under auto with its default options
    auto=AutoUse("separate", rank=2, usable=lambda cfg, target: True),
)

__all__ = ["METHOD", "GlobalSuffixCache", "NativeRequestTrie", "NativeSuffixTrie", "NativeTrie", "RequestTrie",
           "SuffixOptions", "SuffixProposer", "SuffixTrie", "TrieNode", "request_trie"]
