"""A feature-conditioned draft (EAGLE-style): one small decoder stack that reads the target's own last features.

A plain small draft sees only tokens, so it has to re-derive from scratch what the target "had in mind". This
drafter reads, at each position p, the target's final normed hidden state one position back together with the
token actually chosen there, ``fc([f_{p-1}, embed(x_p)])``, and is trained (``leapdecode train eagle``)
to output the target's next feature f_p, which the target's own LM head turns into the draft's next token. (The
same "next feature" idea as EAGLE, Li et al. 2024; here its name everywhere: method ``eagle``, class
``EagleProposer``, shipped in ``leapdecode/artifacts/eagle/``.)::

    committed (target features)                 drafting (the draft's own features)
    x_{n-2}   x_{n-1}                           d_1            d_2
      |         |                                |              |
    f_{n-3} -> [fc+layers] -> f^_{n-2}  ...    f^_{n-1} -> [fc+layers] -> f^_n -> LM head -> d_2 ...
    (f from the target's verification pass, tagged by KV slot)

- **Features of committed tokens** come from the target's passes: the runner hands the residual stream after its
  last layer, after the target's final norm (what its LM head reads), to ``_capture`` (``ModelRunner.add_capture``
  at L = num_layers), which files it by KV slot with the (position, token) it belongs to, exactly as
  self-speculation files h_L. Nothing of the target is ever recomputed for the draft, except the fallback below.
- **The draft's K/V** lives in its own paged cache (``adapter_bm``). After verification it is rolled back to
  the positions drafted from *target* features (the prefix before drafting), not to the accepted drafts: those
  were computed from the draft's own features, and the next step recomputes them from the target's (one
  cheap pass of the draft's layers over the accepted tokens) so the draft always conditions on the truth.
- **Fallback:** a committed position whose stored feature does not carry the expected tag gets its feature from
  a full target pass over those positions that writes its K/V to a scratch slot, never over committed K/V. (Tree
  compaction does not cause it: the stored features follow the K/V, ``ModelRunner.copy_slots``.)

**Dynamic tree** (EAGLE-2, opt-in with ``"tree_nodes": N``): instead of one chain, the draft grows a tree. Each
pass expands the ``tree_beam`` best nodes of the newest depth (best = highest cumulative draft probability, the
product along the path), each into its ``tree_top_k`` most likely children; after ``tree_depth`` depths the N
best nodes of the whole tree are verified in one target pass (tree.py's walk: lossless for greedy and sampling,
the candidates being deterministic). The passes write their nodes' draft K/V to scratch positions after the
committed prefix and attend through a tree mask that covers the nodes cached by earlier passes::

    draft cache:  committed 0 .. n-1 | depth-1 beam | depth-2 beam | ...     (rolled back after verification)
    node at depth d: RoPE position n-1+d, sees the committed prefix, its ancestors and itself

Nodes whose cumulative probability is below ``tree_min_prob`` are never added, so a confident draft makes a deep
narrow tree and an unsure one a small tree or none.

It shares everything else with self-speculation (SelfSpecProposer): artifact format and loading, the stop
threshold ``min_draft_prob``, the vocabulary-subset head, shadow caches, cost calibration. The draft is an
``ExitAdapter`` with ``feature_input`` (L = 0); only the ``eagle`` method runs one (``draft_model`` and
``self_spec`` refuse a feature draft).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.model_runner import ForwardItem
from leapdecode.engine.sequence import Sequence
from leapdecode.speculative.artifacts import shipped_adapter_for, shipped_dir
from leapdecode.speculative.exit_adapter import ExitAdapter
from leapdecode.speculative.method import AutoUse, Method
from leapdecode.speculative.methods.self_spec import DEFAULT_MIN_DRAFT_PROB, SelfSpecProposer
from leapdecode.speculative.options import CHAIN_KEYS, DrafterOptions, DraftPrecision, check, is_int, is_prob
from leapdecode.speculative.policy import expected_tokens
from leapdecode.speculative.proposer import EngineView, Proposal, StepCost, Verification
from leapdecode.speculative.shadow_cache import DraftLogits, Plan
from leapdecode.speculative.tree import select_by_score

# the tree defaults (EagleTreeOptions) were chosen on 6 MT-Bench development prompts at batch 1 on the 2-core
# CPU (README: the eagle tree table): wider or deeper trees accepted at most 0.03 more tokens per step and cost
# more to draft
TREE_EMA = 0.2  # per-sequence tokens-per-step estimate of the tree: weight of each new step
ARTIFACT = "eagle"  # the shipped feature draft: leapdecode/artifacts/eagle/


@dataclass(frozen=True)
class EagleTreeOptions:
    """EAGLE's dynamic draft tree (methods/eagle.py): ``tree_nodes`` > 0 grows a tree and verifies its N best
    nodes (0: a chain); each pass expands the ``tree_beam`` best nodes of the newest depth into their
    ``tree_top_k`` children, for ``tree_depth`` depths, never adding a node below ``tree_min_prob``. The defaults
    were chosen on MT-Bench development prompts at batch 1 on a 2-core CPU (README: the eagle tree table)."""

    tree_nodes: int = 0
    tree_top_k: int = 2
    tree_beam: int = 2
    tree_depth: int = 3
    tree_min_prob: float = 0.05

    def __post_init__(self) -> None:
        for key, low in (("tree_nodes", 0), ("tree_top_k", 1), ("tree_beam", 1), ("tree_depth", 1)):
            v = getattr(self, key)
            check(is_int(v, low), f"{key} must be an integer >= {low}, got {v!r}")
        check(is_prob(self.tree_min_prob, high_open=True),
               f"tree_min_prob must be a number in [0, 1), got {self.tree_min_prob!r}")


@dataclass
class _Tree:
    """One sequence's tree while it grows: nodes in creation order (parents first)."""

    plan: Plan
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # expanded nodes, in the order of their draft-cache rows
    feats: dict[int, torch.Tensor] = field(default_factory=dict)  # expanded node -> its output feature

    def add_children(self, node: int, probs: list[float], tokens: list[int], min_score: float) -> list[int]:
        """Children of ``node`` (-1: the root) from its draft's top-k, best first, while their cumulative score
        (the parent's times their probability) stays at least ``min_score``; returns their indices."""
        base, depth = (1.0, 1) if node < 0 else (self.scores[node], self.depths[node] + 1)
        new = []
        for pr, tok in zip(probs, tokens):
            if base * pr < min_score:
                break
            new.append(len(self.tokens))
            self.tokens.append(int(tok))
            self.parents.append(node)
            self.depths.append(depth)
            self.scores.append(base * pr)
        return new


class EagleProposer(SelfSpecProposer):
    """Drafts with a feature-conditioned ExitAdapter over the target's captured top-layer features (module
    docstring). Invariant: after ``on_verified`` the draft's cache holds only positions whose input feature was
    the target's."""

    name = "eagle"

    def __init__(self, view: EngineView, adapter: ExitAdapter, min_draft_prob: float = DEFAULT_MIN_DRAFT_PROB,
                 vocab_subset: torch.Tensor | None = None, draft_precision: DraftPrecision = "int8") -> None:
        super().__init__(view, adapter, min_draft_prob, vocab_subset, draft_precision)
        self.configure_tree(EagleTreeOptions())  # a chain until the config asks for a tree
        self.tree_tokens: dict[str, float] = {}  # request id -> its measured tokens per tree step

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, view: EngineView, kind: str = "eagle",
                    shipped_only: bool = False, tree: EagleTreeOptions | None = None) -> EagleProposer:
        """The feature draft ``load_drafter`` finds (``kind`` must be "eagle"), drafting a chain, or the dynamic
        tree of ``tree`` (``{"method": "eagle"}`` passes the config's; under ``auto`` and as a hybrid's trunk it
        drafts a chain)."""
        prop = super().from_config(cfg, view, kind, shipped_only)
        assert isinstance(prop, EagleProposer)
        if tree is not None:
            prop.configure_tree(tree)
        return prop

    def configure_tree(self, tree: EagleTreeOptions) -> None:
        """The dynamic-tree settings (module docstring); ``tree_nodes`` 0 drafts a chain."""
        self.tree_nodes = tree.tree_nodes
        self.tree_top_k = tree.tree_top_k
        self.tree_beam = tree.tree_beam
        self.tree_depth = tree.tree_depth
        self.tree_min_prob = float(tree.tree_min_prob)

    def capture_layer(self) -> int:
        return self.model.config.num_hidden_layers

    def _recompute_shared(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Fallback: the target's features for committed positions [start, end) from a full pass whose own K/V go
        to the not-yet-computed slot of position ``num_tokens - 1`` (rewritten by the verification)."""
        scratch = int(self._slots(seq.block_table, seq.num_tokens - 1, seq.num_tokens)[0])
        ids, pos, meta, _ = self.target_runner.prepare([ForwardItem(seq.block_table, start,
                                                                    seq.token_ids[start:end], [])])
        meta.slot_mapping = torch.full_like(meta.slot_mapping, scratch)
        self.num_fallback_tokens += end - start
        return self.model(ids, pos, self.target_kv.layers, meta)

    def _catchup_for(self, seq: Sequence, start: int) -> torch.Tensor:
        """f_{p-1} for positions p in [start, n): every position from the draft's cache end through the last
        committed token, each with the target's feature one position back (zeros before position 0)."""
        feats = self._catchup_rows(seq, max(start - 1, 0), seq.num_tokens - 1)
        if start == 0:
            feats = torch.cat([feats.new_zeros(1, feats.shape[1]), feats])
        return feats

    def _fused(self, feats: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.adapter.fuse(feats, self.model.embed_tokens(ids))

    def _catchup_items(self, plans: list[Plan]) -> tuple[list[ForwardItem], torch.Tensor]:
        """The first draft pass: every position from the draft's cache end through the last committed token, on
        target features (its one logit row per sequence: the newest position)."""
        items = []
        for p in plans:
            assert p.catchup is not None  # _catchup_for always gives features
            a, m = p.shadow.num_computed_tokens, p.catchup.shape[0]
            self.num_catchup_tokens += m - 1
            items.append(ForwardItem(p.shadow.block_table, a, [0] * m, [m - 1]))
        h_in = torch.cat([self._fused(p.catchup, p.seq.token_ids[p.shadow.num_computed_tokens :]) for p in plans])
        return items, h_in

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        """A dynamic tree when ``tree_nodes`` asks for one, else a chain through the shared drafting loop."""
        if self.tree_nodes:
            with torch.inference_mode():
                return self._propose_tree(seqs, budgets, [Proposal([]) for _ in seqs])
        return super().propose(seqs, budgets)

    def _draft_pass(self, active: list[Plan], fed: list[int] | None) -> tuple[list[ForwardItem], DraftLogits]:
        """The draft's layers over target features (the catch-up pass), then over each chain's own newest feature
        with the token it just drafted; each chain keeps its output feature for the next pass."""
        if fed is None:
            items, h_in = self._catchup_items(active)
        else:
            items = [ForwardItem(p.shadow.block_table, p.shadow.num_computed_tokens, [0], [0]) for p in active]
            feats_in = [p.feature for p in active]
            assert all(f is not None for f in feats_in)  # every pass leaves each chain its newest feature
            h_in = self._fused(torch.stack(feats_in), fed)  # type: ignore[arg-type]
        feats = self._adapter_pass(items, h_in)  # f^ at each chain's newest position
        for j, p in enumerate(active):
            p.feature = feats[j]
        return items, self._subset_logits(feats)

    # ---------------------------------------------------------------------------------------- dynamic tree
    def _propose_tree(self, seqs: list[Sequence], budgets: list[int], props: list[Proposal]) -> list[Proposal]:
        """Grow each sequence's tree depth by depth (module docstring), all sequences in one draft pass per
        depth, then keep its ``budgets[i]`` best nodes. Candidates are the draft's top-k, never samples, so the
        tree walk verifies sampled requests losslessly too."""
        # the draft cache takes each depth's expanded nodes after the committed prefix
        plans = self._plan(seqs, [self.tree_beam * (self.tree_depth - 1) + 1 if b > 0 else 0 for b in budgets])
        if not plans:
            return props
        items, h_in = self._catchup_items(plans)
        feats = self._adapter_pass(items, h_in)
        for p, it in zip(plans, items):
            p.shadow.num_computed_tokens = it.start + len(it.tokens)
        trees = [_Tree(p) for p in plans]
        growing: list[tuple[_Tree, list[int]]] = [(t, [-1]) for t in trees]  # (tree, nodes of feats' rows)
        depth = 1
        while growing:
            logits, ids = self._subset_logits(feats)
            top = torch.softmax(logits, dim=-1).topk(self.tree_top_k, dim=-1)
            top_p = top.values.tolist()
            top_t = (top.indices if ids is None else ids[top.indices]).tolist()
            row, nxt, parts, step_items = 0, [], [], []
            for t, nodes in growing:
                new = []
                for node in nodes:
                    t.feats[node] = feats[row]
                    new += t.add_children(node, top_p[row], top_t[row], self.tree_min_prob)
                    row += 1
                room = t.plan.budget - 1 - len(t.cached)  # draft-cache rows left for expanded nodes
                if not new or room <= 0 or depth >= min(self.tree_depth, budgets[t.plan.index]):
                    continue
                expand = sorted(new, key=lambda i: -t.scores[i])[: min(self.tree_beam, room)]
                step_items.append(self._expansion_item(t, expand, depth))
                parts.append(self._fused(torch.stack([t.feats[t.parents[i]] for i in expand]),
                                         [t.tokens[i] for i in expand]))
                t.cached += expand
                nxt.append((t, expand))
            growing = nxt
            depth += 1
            if growing:
                feats = self._adapter_pass(step_items, torch.cat(parts))
        for t in trees:
            i = t.plan.index
            kept, parents = select_by_score(t.scores, t.parents, budgets[i])
            if kept:
                props[i] = Proposal([t.tokens[k] for k in kept], None, parents)
        return props

    def _expansion_item(self, t: _Tree, expand: list[int], depth: int) -> ForwardItem:
        """Draft-cache rows for the nodes ``expand`` (at ``depth``) after the ones already cached: each at RoPE
        position n-1+depth, seeing the committed prefix, its cached ancestors and itself."""
        n = t.plan.seq.num_tokens
        start = n + len(t.cached)
        ancestors = [set() for _ in expand]
        for j, node in enumerate(expand):
            a = t.parents[node]
            while a >= 0:
                ancestors[j].add(a)
                a = t.parents[a]
        q, past = len(expand), len(t.cached)
        mask = torch.zeros(q, past + q, dtype=torch.bool)
        for j in range(q):
            mask[j, :past] = torch.tensor([c in ancestors[j] for c in t.cached], dtype=torch.bool)
            mask[j, past + j] = True
        return ForwardItem(t.plan.shadow.block_table, start, [0] * q, list(range(q)),
                           depths=[n - 1 + depth - start] * q, tree_mask=mask)

    def tree_budget(self, seq: Sequence, room: int, cost: StepCost | None, batch: int) -> tuple[int, float] | None:
        """Chains: None (dynamic gamma). Trees: ``tree_nodes`` nodes, with this sequence's measured tokens per
        tree step (an EMA from the artifact's acceptance as a chain of ``tree_depth``); under the engine's cost
        model 0 when that does not beat plain decoding, drifting back toward the prior so it is tried again."""
        if not self.tree_nodes:
            return None
        n = min(self.tree_nodes, room)
        prior = expected_tokens(self.acceptance_prior(), self.tree_depth)
        est = self.tree_tokens.setdefault(seq.request_id, prior)
        # the engine's rule for whether drafting pays, asked for one size: the whole n-node tree or nothing
        if cost is not None and n > 0 and cost.best_gamma(est, 1, batch, batch, lambda g: self.step_cost(batch, n),
                                                          rows=lambda g: n, expected=lambda a, g: a) == 0:
            self.tree_tokens[seq.request_id] = est + 0.05 * (prior - est)
            return 0, 1.0
        return n, est

    def step_cost(self, num_seqs: int, num_tokens: int) -> float:
        """A tree costs its catch-up pass plus one pass of ``tree_beam`` rows per sequence for each further
        depth, whatever its node count; a chain one pass per draft."""
        if not self.tree_nodes or self.step_cost_fn is None or num_tokens <= 0:
            return super().step_cost(num_seqs, num_tokens)
        fn = self.step_cost_fn
        return fn(num_seqs) + (self.tree_depth - 1) * fn(num_seqs * self.tree_beam)

    def on_verified(self, seq: Sequence, result: Verification) -> None:
        """Keep only positions drafted from target features: accepted drafts are recomputed from the target's.
        After a tree, its tokens per step enter the sequence's estimate (``tree_budget``)."""
        self.roll_back(seq, result.num_prefix_tokens)
        if result.parents is not None:
            tokens = 1.0 + result.num_accepted
            est = self.tree_tokens.get(seq.request_id, tokens)
            self.tree_tokens[seq.request_id] = est + TREE_EMA * (tokens - est)

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.tree_tokens.pop(seq.request_id, None)

    @torch.inference_mode()
    def timed_draft_step(self, n: int) -> None:
        """One draft step of ``n`` rows at a short context on borrowed draft blocks, for the cost model."""
        ctx = 64
        abm = self.adapter_bm
        if abm.blocks_needed(ctx + n) > abm.num_free_blocks:
            return
        count = self.num_adapter_tokens
        try:
            with abm.borrowed(ctx + n) as table:
                h = self._fused(self.h_pool.new_zeros(n, self.h_pool.shape[1]), [0] * n)
                out = self._adapter_pass([ForwardItem(table, ctx, [0] * n, list(range(n)))], h)
                torch.softmax(self._subset_logits(out)[0], dim=-1).max(dim=-1)
        finally:
            self.num_adapter_tokens = count
METHOD = Method(
    name="eagle",
    options=(EagleTreeOptions, DrafterOptions),
    shared=frozenset({"model"}) | CHAIN_KEYS,
    # under auto (and as a hybrid's trunk) a chain: the tree is this method's own opt-in
    build=lambda cfg, view, auto: EagleProposer.from_config(
        cfg, view, ARTIFACT, shipped_only=auto, tree=None if auto else cfg.options(EagleTreeOptions)),
    artifact=ARTIFACT,
    auto=AutoUse("hidden", rank=1, options=(DrafterOptions,),
                 usable=lambda cfg, target: target is not None and
                 shipped_adapter_for(target, shipped_dir(ARTIFACT)) is not None),
    bench={"eagle_tree": {"method": "eagle", "tree_nodes": 4}},
)

__all__ = ["METHOD", "EagleProposer", "EagleTreeOptions"]
