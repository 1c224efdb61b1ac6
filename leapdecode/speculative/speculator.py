"""Glue between the engine and the drafters: how many drafts per sequence, proposing, verifying, bookkeeping.

The engine calls, per step: ``budget_for`` (through the scheduler, which reserves room), ``propose`` for the
sequences given a budget, ``shape_item`` for tree layouts, then per sequence ``verify`` and ``observe``. The
speculator owns which proposer drafts for which sequence (``DraftState.method``); the proposers come from the
registry, the sizing rules from policy.py, the acceptance rules from acceptance.py.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.model_runner import ForwardItem, ForwardResult
from leapdecode.engine.scheduler import ScheduledSeq
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.sampler import RowContext, apply_processors, processed_probs
from leapdecode.speculative.acceptance import (
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
    verify_tree_typical,
)
from leapdecode.speculative.policy import (
    DynamicGamma,
    GammaState,
    StepCostModel,
    auto_methods,
    calibrate_target,
    expected_tokens,
)
from leapdecode.speculative.proposer import EngineView, Proposer
from leapdecode.speculative.registry import make_proposer
from leapdecode.speculative.tree import compaction_moves, depths_of, path_to, tree_attention_mask

OVERHEAD_EMA = 0.2  # weight of the newest measurement in the speculation-overhead averages


class Speculator:
    """Owns one proposer per usable method (one, or several for ``auto``) and decides per sequence and per step
    which method drafts and how many tokens, from each method's measured acceptance on that sequence and the
    measured cost of target (and drafter) steps. Invariant: a sequence's drafts always come from one proposer
    per step, recorded in ``seq.draft_state.method``, and only that proposer is told the verification result.
    """

    def __init__(self, engine: Any, cfg: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.view = view = EngineView.of(engine)
        self.cfg = cfg
        if proposer is not None:
            self.proposers = {cfg.method: proposer}
        else:
            names = auto_methods(cfg, view.model) if cfg.method == "auto" else [cfg.method]
            self.proposers = {name: make_proposer(cfg, view, name) for name in names}
        self.proposer = next(iter(self.proposers.values()))  # the proposer of single-method configs
        self.dropped: dict[str, float] = {}  # auto: drafters left out as unprofitable here -> their prior
        self.gamma = DynamicGamma(cfg)
        self.cost: StepCostModel | None = None
        # measured Python-side cost of speculating, per drafting sequence and step (EMA, seconds): proposing
        # (per method) and verifying. The step-cost model only times target forwards; at ~10 ms per step these
        # ~0.5-1 ms decide whether 1.15 tokens per step pay, so they enter every rate below.
        self.propose_s: dict[str, float] = {}
        self.verify_s = 0.0
        # fixed-budget drafters (blockwise) never consult the cost model: no start-up calibration for them
        sized_by_cost = any(not p.fixed_budget for p in self.proposers.values())
        if (cfg.use_cost_model or cfg.method == "auto") and sized_by_cost:
            self.cost = calibrate_target(view.runner, view.block_manager)
            for prop in self.proposers.values():
                prop.calibrate_cost()  # drafters that run a model time their own steps
        if cfg.method == "auto" and self.cost is not None:
            self._drop_unprofitable()

    def _drop_unprofitable(self) -> None:
        """``auto``: leave out chain drafters whose measured acceptance (``prior_acceptance``) cannot pay for
        their measured step cost at batch 1 here: trying them would cost steps on every sequence until its
        estimate fell, and again each time it drifted back. A drafter with no measurement stays."""
        assert self.cost is not None
        for name, prop in list(self.proposers.items()):
            prior = prop.prior_acceptance
            if prior is None or len(self.proposers) == 1:
                continue
            draft = lambda g, p=prop: p.step_cost(1, g)  # noqa: E731
            if self.cost.best_gamma(prior, self.cfg.max_draft_tokens, 1, 1, draft) == 0:
                del self.proposers[name]
                self.dropped[name] = prior
                prop.detach()  # e.g. self_spec stops capturing the target's hidden states
        self.proposer = next(iter(self.proposers.values()))

    # -------------------------------------------------------------------------------------------- policy
    def state(self, seq: Sequence, method: str) -> GammaState:
        states = seq.draft_state.gamma
        st = states.get(method)
        if st is None:
            st = states[method] = self.gamma.new_state()
            st.acceptance_ema = self.proposers[method].acceptance_prior()
        return st

    def budget_for(self, seq: Sequence) -> int:
        """Draft tokens this decoding sequence may verify this step (0 = plain decoding); picks the method."""
        seq.draft_state.method = None
        if not seq.params.speculative:
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.view.max_model_len - seq.num_tokens - 1)
        if room <= 0:
            return 0
        batch = max(1, len(self.view.running()))
        # every method must beat plain decoding's rate to be chosen
        best_name, best_k, best_rate = None, 0, (batch / self.cost(batch) if self.cost is not None else 0.0)
        for name, prop in self.proposers.items():
            tree = prop.tree_budget(seq, room, self.cost, batch)
            if tree is not None and prop.fixed_budget:  # the method's own block size, not the cost model's call
                if tree[0] > 0:
                    best_name, best_k = name, tree[0]
                    break
                continue
            k, rate = self._tree_rate(name, prop, tree, batch) if tree is not None else \
                self._chain_rate(seq, name, prop, room, batch)
            if k > 0 and rate > best_rate:
                best_name, best_k, best_rate = name, k, rate
        seq.draft_state.method = best_name
        return best_k

    def _tree_rate(self, name: str, prop: Proposer, tree: tuple[int, float], batch: int) -> tuple[int, float]:
        """A tree drafter's own size (Proposer.tree_budget) and the tokens per second it promises."""
        k, exp_tokens = tree
        if k <= 0 or self.cost is None:
            return k, exp_tokens
        t = self.cost(batch + k) + prop.step_cost(batch, k) + self.overhead(name, prop, batch)
        return k, (batch - 1 + exp_tokens) / t

    def _chain_rate(self, seq: Sequence, name: str, prop: Proposer, room: int, batch: int) -> tuple[int, float]:
        """A chain drafter's dynamic γ for ``seq``, cut to what pays under the cost model, and its rate."""
        st = self.state(seq, name)
        k = min(st.gamma, room)
        if self.cost is None:
            return k, float(k)
        k = self.cost.best_gamma(st.acceptance_ema, k, batch, batch, lambda g: prop.step_cost(batch, g))
        if k == 0:
            # drift back toward the prior while not drafting, so a sequence whose text turns repetitive (or
            # copies from its input) gets to try again
            st.acceptance_ema += 0.05 * (prop.acceptance_prior() - st.acceptance_ema)
            return 0, 0.0
        t = self.cost(batch + k) + prop.step_cost(batch, k) + self.overhead(name, prop, batch)
        return k, (batch - 1 + expected_tokens(st.acceptance_ema, k)) / t

    def overhead(self, name: str, prop: Proposer, batch: int) -> float:
        """Measured seconds a drafting sequence adds to a step beyond the target forward: verification, plus
        proposing where the drafter has no modelled step cost of its own (prompt lookup)."""
        own = prop.step_cost(batch, 1) > 0  # draft models, heads: already in the rate through step_cost
        return self.verify_s + (0.0 if own else self.propose_s.get(name, 0.0))

    @staticmethod
    def _ema(old: float, new: float) -> float:
        return new if old == 0.0 else old + OVERHEAD_EMA * (new - old)

    # ------------------------------------------------------------------------------------------- actions
    def propose(self, scheduled: list[ScheduledSeq]) -> None:
        by_method: dict[str, list[ScheduledSeq]] = {}
        for s in scheduled:
            by_method.setdefault(s.seq.draft_state.method or "", []).append(s)
        for name, group in by_method.items():
            if name not in self.proposers:
                continue
            seqs = [s.seq for s in group]
            t0 = time.perf_counter()
            props = self.proposers[name].propose(seqs, [s.spec_budget for s in group])
            self.propose_s[name] = self._ema(self.propose_s.get(name, 0.0), (time.perf_counter() - t0) / len(seqs))
            for seq, prop in zip(seqs, props):
                seq.draft_token_ids = list(prop.tokens)
                seq.draft_probs = prop.probs
                seq.draft_state.tree_parents = list(prop.parents) if prop.parents and prop.tokens else None

    def shape_item(self, seq: Sequence, item: ForwardItem, num_prefix: int) -> None:
        """A candidate tree runs as ``num_prefix`` ordinary tokens (the last is the root) plus its nodes at
        RoPE positions by depth under the ancestor mask; chains keep the plain causal layout."""
        parents = seq.draft_state.tree_parents
        if parents is None:
            return
        item.depths = list(range(num_prefix)) + [num_prefix - 1 + d for d in depths_of(parents)]
        item.tree_mask = tree_attention_mask(parents, num_prefix)

    def observe(self, seq: Sequence, res: ForwardResult) -> None:
        """Hand the drafters the hidden state behind the last emitted token (row recorded by ``verify``; the
        last row after plain sampling)."""
        row, seq.draft_state.hidden_row = seq.draft_state.hidden_row, -1
        if not seq.is_finished and res.hidden.numel():
            for prop in self.proposers.values():
                prop.observe(seq, res.hidden[row])

    def verify(self, seq: Sequence, res: ForwardResult) -> tuple[list[int], int, torch.Tensor]:
        """Emitted tokens, the number of drafts accepted and the processed logits of the rows the emitted tokens
        were drawn at (for log-probabilities), from the target logits at the drafts' positions with the request's
        processors applied at each (the tokens before a position include the drafts before it); then the one
        bookkeeping path for chains and trees: metrics, the drafter's γ (chains), the drafter's own roll-back
        (``on_verified``) and the row whose hidden state the drafters observe next."""
        t0 = time.perf_counter()
        st = seq.draft_state
        assert st.method is not None, "verify() of a sequence that did not draft"
        prop = self.proposers[st.method]
        drafted = len(seq.draft_token_ids)
        if st.tree_parents is not None:
            tokens, path, logits = self._walk_tree(seq, res, prop, st.tree_parents)
            self._compact(seq, path)
            accepted, hidden_row = len(path), (path[-1] + 1 if path else 0)
            drawn = logits[[0] + [i + 1 for i in path]]
        else:
            tokens, accepted, logits = self._walk_chain(seq, res, prop)
            path, hidden_row = list(range(accepted)), accepted
            drawn = logits[: len(tokens)]
            self.gamma.update(self.state(seq, st.method), drafted, accepted)
        m = seq.metrics
        m.num_draft_tokens += drafted
        m.num_accepted_tokens += accepted
        st.accepted_path = path  # which nodes: a hybrid tells its trunk drafter how much was its own
        prop.on_verified(seq, seq.num_tokens, accepted)
        st.hidden_row = hidden_row
        self.verify_s = self._ema(self.verify_s, time.perf_counter() - t0)
        return tokens, accepted, drawn

    def _generator(self, seq: Sequence) -> torch.Generator:
        return seq.generator or self.view.generator

    def _walk_chain(
        self, seq: Sequence, res: ForwardResult, prop: Proposer
    ) -> tuple[list[int], int, torch.Tensor]:
        """A chain: the drafter's own acceptance rule where it has one (blockwise), else greedy match or
        rejection sampling (acceptance.py). Also returns the processed logits of every row."""
        drafts = seq.draft_token_ids
        k = len(drafts)
        logits = res.logits
        if seq.params.has_processors:
            masks = seq.grammar.masks_along(drafts) if seq.grammar is not None else [None] * (k + 1)
            rows = [RowContext(seq.params, seq.token_ids + drafts[:j], seq.num_prompt_tokens, seq.stop_ids, masks[j])
                    for j in range(k + 1)]
            logits = apply_processors(logits, rows)
        own = prop.verify_chain(seq, logits, self._generator(seq))
        if own is not None:
            return own[0], own[1], logits
        if seq.params.greedy:
            return (*verify_greedy(logits.argmax(dim=-1).tolist(), drafts), logits)
        p = processed_probs(logits, [seq.params] * (k + 1))
        return (*verify_sampling(p, drafts, seq.draft_probs, self._generator(seq)), logits)

    def _walk_tree(self, seq: Sequence, res: ForwardResult, prop: Proposer,
                   parents: list[int]) -> tuple[list[int], list[int], torch.Tensor]:
        """A tree: (emitted tokens, accepted node indices along the path, processed logits of every row) by the
        tree walk (acceptance.py)."""
        drafts = seq.draft_token_ids
        n = len(drafts)
        logits = res.logits
        if seq.params.has_processors:
            paths = [[drafts[j] for j in path_to(i, parents)] for i in range(n)]
            masks: list[torch.Tensor | None] = [None] * (n + 1)
            if seq.grammar is not None:
                masks[0] = seq.grammar.allowed_tokens()
                for i in range(n):  # parents come before their children: a node unreachable under the grammar
                    mask = seq.grammar.mask_after(paths[i])  # keeps its parent's mask (never used)
                    masks[i + 1] = mask if mask is not None else masks[parents[i] + 1]
            rows = [RowContext(seq.params, seq.token_ids, seq.num_prompt_tokens, seq.stop_ids, masks[0])]
            rows += [RowContext(seq.params, seq.token_ids + paths[i], seq.num_prompt_tokens, seq.stop_ids,
                                masks[i + 1]) for i in range(n)]
            logits = apply_processors(logits, rows)
        if seq.params.greedy:
            return (*verify_tree_greedy(logits.argmax(dim=-1).tolist(), drafts, parents), logits)
        p = processed_probs(logits, [seq.params] * (n + 1))
        typical = prop.tree_acceptance()
        if typical is not None:  # lossy opt-in
            return (*verify_tree_typical(p, drafts, parents, self._generator(seq), *typical), logits)
        return (*verify_tree_sampling(p, drafts, parents, self._generator(seq)), logits)

    def _compact(self, seq: Sequence, path: list[int]) -> None:
        """Move the accepted nodes' K/V into the sequential slots of their positions; the engine then advances
        ``num_computed_tokens`` by the path length and trims the rest."""
        moves = compaction_moves(path)
        if not moves:
            return
        base = seq.num_computed_tokens  # position of the first node's slot (right after the root)
        bm = self.view.block_manager
        dev = self.view.kv_cache.pool.device
        src = torch.tensor([bm.slot(seq, base + a) for a, _ in moves], dtype=torch.long, device=dev)
        dst = torch.tensor([bm.slot(seq, base + b) for _, b in moves], dtype=torch.long, device=dev)
        self.view.runner.copy_slots(src, dst)  # every tier, int8 scales, and captured hidden states

    def release(self, seq: Sequence) -> None:
        for prop in self.proposers.values():
            prop.release(seq)


__all__ = ["Speculator"]
