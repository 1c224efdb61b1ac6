"""Glue between the engine and the drafters: how many drafts per sequence, proposing, verifying, bookkeeping.

The engine calls, per step: ``budget_for`` (through the scheduler, which reserves room), ``propose`` for the
sequences given a budget, ``shape_item`` for tree layouts, then per sequence ``verify`` and ``observe``. The
speculator owns which proposer drafts for which sequence (``DraftState.method``); the proposers come from the
registry, the sizing rules from policy.py, the acceptance rules from acceptance.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.model_runner import ForwardItem, ForwardResult
from leapdecode.engine.scheduler import ScheduledSeq
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.sampler import RowContext, apply_processors, processed_probs
from leapdecode.parallel import group_size, rank0_value
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
    chunk_size,
    expected_tokens,
    group_by_acceptance,
)
from leapdecode.speculative.proposer import EngineView, Proposal, Proposer
from leapdecode.speculative.registry import make_proposer
from leapdecode.speculative.router import KV_SHORT, DrafterFacts, Router, pick
from leapdecode.speculative.tree import compaction_moves, depths_of, path_to, tree_attention_mask

OVERHEAD_EMA = 0.2  # weight of the newest measurement in the speculation-overhead averages
UNMODELLED_FADE = 0.02  # per sequence and step a drafter sits out: its unmodelled drafting time fades this share


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
        # measured cost of speculating beyond the modelled forwards, per drafting sequence and step (EMA, seconds):
        # proposing, less what the drafter's own step-cost model predicts for the call (per method: a draft
        # model's fixed per-call work, catching up on tokens it did not draft, a proposal that stopped before its
        # first token; all of proposing for prompt lookup, which models none), and verifying. At ~5 ms per step
        # these ~0.1-1 ms decide whether 1.15 tokens per step pay, so they enter every rate below.
        self.propose_s: dict[str, float] = {}
        self.verify_s = 0.0
        # chunked verification: chains split (a tail kept back), and steps that verified a kept tail
        self.num_chunked = 0
        self.num_resumed = 0
        # acceptance-grouped sizing: request id -> (its length when planned, method, draft length)
        self._group: dict[str, tuple[int, str | None, int]] = {}
        self._group_running: list[str] = []
        # chains verified, per draft position j: [drafts at j, of them accepted] (acceptance by draft position)
        self.position_counts: list[list[int]] = []
        # fixed-budget drafters (blockwise) never consult the cost model: no start-up calibration for them
        sized_by_cost = any(not p.fixed_budget for p in self.proposers.values())
        if (cfg.use_cost_model or cfg.method == "auto") and sized_by_cost:
            self.cost = calibrate_target(view.runner, view.block_manager)
            for prop in self.proposers.values():
                prop.calibrate_cost()  # drafters that run a model time their own steps
        if cfg.method == "auto" and self.cost is not None:
            self._drop_unprofitable()
        self.router: Router | None = None  # auto: the strategy router (router.py) picks per request and step
        if cfg.method == "auto":
            facts = [DrafterFacts(n, p.memory_bytes() / 2**20) for n, p in self.proposers.items()]
            tok = view.tokenizer
            text: Callable[[list[int]], str] = (lambda ids: "") if tok is None else \
                (lambda ids: tok.decode(ids, skip_special_tokens=True))
            self.router = Router(cfg.auto, facts, text, self.dropped)

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
            st.acceptance_ema = self.start_acceptance(seq, method)
        return st

    def start_acceptance(self, seq: Sequence, method: str) -> float:
        """Where ``seq``'s acceptance estimate for ``method`` starts: under ``auto`` what the router measured for
        the request's task, else the drafter's prior."""
        prior = self.proposers[method].acceptance_prior()
        return prior if self.router is None else self.router.prior(seq, method, prior)

    def _room(self, seq: Sequence) -> int:
        """The most drafts ``seq`` can verify: one emitted token is the target's own, within max_tokens and the
        model's context."""
        return min(seq.params.max_tokens - seq.num_output_tokens - 1, self.view.max_model_len - seq.num_tokens - 1)

    def budget_for(self, seq: Sequence) -> int:
        """Draft tokens this decoding sequence may verify this step (0 = plain decoding); picks the method."""
        seq.draft_state.method = None
        if not seq.params.speculative:
            return 0
        room = self._room(seq)
        if room <= 0:
            return 0
        kept = self._pending_budget(seq, room)
        if kept:
            return kept
        batch = max(1, len(self.view.running()))
        if batch > 1 and self.cfg.group_by_acceptance and self.cost is not None:
            return self._grouped_budget(seq, room, batch)
        return self._choose(seq, room, batch)

    def _choose(self, seq: Sequence, room: int, batch: int) -> int:
        """The method and draft length ``seq`` would take alone (every other sequence verifying one token)."""
        names = list(self.proposers)
        if self.router is not None:
            names = [n for n in self.router.route(seq).candidates if n in self.proposers]
            if self.router.kv_short(self.view.block_manager):
                self.router.depart(seq, f"KV short: under {KV_SHORT:.0%} of the KV pool free, no drafting")
                return 0
        # every method must beat plain decoding's rate to be chosen
        plain = batch / self.cost(batch) if self.cost is not None else 0.0
        rates: dict[str, tuple[int, float]] = {}
        for name in names:
            prop = self.proposers[name]
            if not prop.has_draft(seq):  # e.g. prompt lookup without a match: not a candidate this step
                continue
            tree = prop.tree_budget(seq, room, self.cost, batch)
            if tree is not None and prop.fixed_budget:  # the method's own block size, not the cost model's call
                if tree[0] > 0:
                    seq.draft_state.method = name
                    return tree[0]
                continue
            k, rate = self._tree_rate(name, prop, tree, batch) if tree is not None else \
                self._chain_rate(seq, name, prop, room, batch)
            if k > 0 and rate > plain:
                rates[name] = (k, rate)
        if self.router is None:  # the fastest (the first of equals)
            best = max(rates, key=lambda n: rates[n][1]) if rates else None
            best_k = rates[best][0] if best is not None else 0
        else:
            best, best_k, note = pick(self.router.route(seq), rates)
            if note is not None:
                self.router.depart(seq, note)
        seq.draft_state.method = best
        return best_k

    def _grouped_budget(self, seq: Sequence, room: int, batch: int) -> int:
        """``seq``'s share of this step's drafts sized together (``policy.group_by_acceptance``); the plan is made
        for every running decoding sequence at the first call of a step and holds while the running set and their
        lengths do."""
        entry = self._group.get(seq.request_id)
        running = [s.request_id for s in self.view.running()]
        if entry is None or entry[0] != seq.num_tokens or running != self._group_running:
            self._group_running = running
            self._plan_group(batch)
            entry = self._group.get(seq.request_id)
        if entry is None:  # not among the running sequences: alone
            return self._choose(seq, room, batch)
        seq.draft_state.method = entry[1] if entry[2] > 0 else None
        return entry[2]

    def _plan_group(self, batch: int) -> None:
        """Each running decoding sequence's method and length alone, then the chains' lengths sized together."""
        seqs, wants = [], []
        for s in self.view.running():
            room = self._room(s)
            if not s.params.speculative or room <= 0 or s.num_computed_tokens != s.num_tokens - 1:
                continue
            k = self._pending_budget(s, room) or self._choose(s, room, batch)
            name = s.draft_state.method
            chain = name is not None and name in s.draft_state.gamma and s.draft_state.pending_method != name
            prop = self.proposers[name] if name is not None else None
            draft = (lambda g, p=prop: p.step_cost(batch, g)) if prop is not None else (lambda g: 0.0)
            seqs.append(s)
            wants.append((self.state(s, name).acceptance_ema if chain and name else None, k, draft))
        assert self.cost is not None
        sizes = group_by_acceptance(wants, self.cost, batch)
        self._group = {s.request_id: (s.num_tokens, s.draft_state.method, k) for s, k in zip(seqs, sizes)}

    def _pending_budget(self, seq: Sequence, room: int) -> int:
        """Drafts kept back by chunked verification that still hold (the sequence committed every submitted draft
        and then exactly the next kept one): verify them this step, without drafting. Else they are dropped."""
        st = seq.draft_state
        if not st.pending:
            return 0
        if (seq.num_tokens != st.pending_at or seq.token_ids[-1] != st.pending[0] or len(st.pending) < 2
                or st.pending_method not in self.proposers):
            self._keep(seq, None, [], None, -1)
            return 0
        st.method = st.pending_method
        return min(len(st.pending) - 1, room)

    @staticmethod
    def _keep(seq: Sequence, method: str | None, tokens: list[int], probs: torch.Tensor | None, at: int) -> None:
        st = seq.draft_state
        st.pending, st.pending_probs, st.pending_at, st.pending_method = tokens, probs, at, method

    def _chunk(self, seq: Sequence, name: str, prop: Proposal, propose_s: float) -> Proposal:
        """The part of ``prop`` to verify this step; a long chain's tail is kept back when verifying it in chunks
        pays (``policy.chunk_size``) or the config fixes a chunk (``verify_chunk``)."""
        n = len(prop.tokens)
        forced = self.cfg.verify_chunk
        c = n
        if prop.parents is None and not self.proposers[name].fixed_budget and forced != 0:
            if forced is not None:
                c = min(n, forced)
            elif self.cost is not None:
                batch = max(1, len(self.view.running()))
                c = chunk_size(self.cost, self.state(seq, name).acceptance_ema, n, batch, propose_s)
        if c >= n:
            self._keep(seq, None, [], None, -1)
            return prop
        probs = prop.probs
        self.num_chunked += 1
        self._keep(seq, name, prop.tokens[c:], None if probs is None else probs[c:], seq.num_tokens + c + 1)
        return Proposal(prop.tokens[:c], None if probs is None else probs[:c])

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
        over = self.overhead(name, prop, batch)
        k = self.cost.best_gamma(st.acceptance_ema, k, batch, batch, lambda g: prop.step_cost(batch, g) + over)
        if k == 0:
            # drift back toward the prior while not drafting, so a sequence whose text turns repetitive (or
            # copies from its input) gets to try again; and let the measured unmodelled drafting time fade, so
            # one slow call (a long catch-up, a pause) does not keep a drafter out for good: if it was no outlier,
            # the next try measures it again
            st.acceptance_ema += 0.05 * (self.start_acceptance(seq, name) - st.acceptance_ema)
            if name in self.propose_s:
                self.propose_s[name] *= 1.0 - UNMODELLED_FADE
            return 0, 0.0
        t = self.cost(batch + k) + prop.step_cost(batch, k) + over
        return k, (batch - 1 + expected_tokens(st.acceptance_ema, k)) / t

    def overhead(self, name: str, prop: Proposer, batch: int) -> float:
        """Measured seconds a drafting sequence adds to a step beyond the target forward and the drafter's modelled
        step cost: verification, plus the proposing time its model does not predict (never below 0: a model that
        overestimates long chains does not make short ones look cheaper than they are)."""
        return self.verify_s + max(0.0, self.propose_s.get(name, 0.0))

    def _draft_seconds(self, name: str, n: int) -> float:
        """Measured seconds one sequence's chain of ``n`` drafts took to propose (modelled + unmodelled part)."""
        return self.proposers[name].step_cost(1, n) + max(0.0, self.propose_s.get(name, 0.0))

    @staticmethod
    def _ema(old: float, new: float) -> float:
        return new if old == 0.0 else old + OVERHEAD_EMA * (new - old)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A live target forward of ``rows`` tokens took ``seconds``: the step-cost model learns from it (one
        process only: under tensor parallelism every rank must size alike, so the start-up calibration, taken
        from rank 0, stands)."""
        if self.cost is not None and group_size() == 1:
            self.cost.observe(rows, seconds)

    # ------------------------------------------------------------------------------------------- actions
    def propose(self, scheduled: list[ScheduledSeq]) -> None:
        by_method: dict[str, list[ScheduledSeq]] = {}
        for s in scheduled:
            by_method.setdefault(s.seq.draft_state.method or "", []).append(s)
        for name, group in by_method.items():
            if name not in self.proposers:
                continue
            kept = [s for s in group if s.seq.draft_state.pending_method == name]
            fresh = [s for s in group if s.seq.draft_state.pending_method != name]
            seqs = [s.seq for s in fresh]
            t0 = time.perf_counter()
            props = self.proposers[name].propose(seqs, [s.spec_budget for s in fresh]) if fresh else []
            if fresh:
                spent = rank0_value(time.perf_counter() - t0)  # rank 0's clock on every rank
                modelled = self.proposers[name].step_cost(len(seqs), max(s.spec_budget for s in fresh))
                self.propose_s[name] = self._ema(self.propose_s.get(name, 0.0), (spent - modelled) / len(seqs))
            self.num_resumed += len(kept)
            for s in kept:  # the rest of a chain verified in chunks: no drafting this step
                st = s.seq.draft_state
                k = s.spec_budget
                probs = None if st.pending_probs is None else st.pending_probs[1 : 1 + k]
                seqs.append(s.seq)
                props.append(Proposal(st.pending[1 : 1 + k], probs))
            for seq, prop in zip(seqs, props):
                # the measured average, not this call's time: every decision reads the same smoothed clock
                prop = self._chunk(seq, name, prop, self._draft_seconds(name, len(prop.tokens)))
                if prop.tokens:
                    seq.metrics.draft_methods[name] = seq.metrics.draft_methods.get(name, 0) + 1
                elif self.router is not None and name in seq.draft_state.gamma:
                    # it ran and stopped before its first draft (a draft model below its confidence floor): the
                    # step cost its time and gained nothing, as a verification that accepted nothing would
                    self.gamma.update(seq.draft_state.gamma[name], 1, 0)
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
        if seq.draft_token_ids and seq.draft_state.tree_parents is None:  # a chain was verified this step
            self._count_positions(len(seq.draft_token_ids), len(seq.draft_state.accepted_path))
        # only drafters that keep the hidden state (heads) are called: indexing the row costs ~5 us a call, paid
        # per sequence and drafter on every step, and most drafters ignore it
        watchers = [p for p in self.proposers.values() if type(p).observe is not Proposer.observe]
        if watchers and not seq.is_finished and res.hidden.numel():
            hidden = res.hidden[row]
            for prop in watchers:
                prop.observe(seq, hidden)
        if self.router is not None and not seq.is_finished and self.router.domain_switch(seq) is not None:
            self._restart_estimates(seq)

    def _count_positions(self, drafted: int, accepted: int) -> None:
        counts = self.position_counts
        counts.extend([0, 0] for _ in range(drafted - len(counts)))
        for j in range(drafted):
            counts[j][0] += 1
            counts[j][1] += j < accepted

    def _restart_estimates(self, seq: Sequence) -> None:
        """The copy detector saw the text change domain: prompt lookup's acceptance estimate becomes the measured
        copy rate, every other drafter's restarts where a new request's would, so the next step weighs them
        afresh."""
        hit_rate = seq.draft_state.domain.hit_rate
        for method, st in seq.draft_state.gamma.items():
            st.acceptance_ema = self.start_acceptance(seq, method)
        if "ngram" in self.proposers:
            self.state(seq, "ngram").acceptance_ema = hit_rate

    def verify(self, seq: Sequence, res: ForwardResult) -> tuple[list[int], int, torch.Tensor | None]:
        """Emitted tokens, the number of drafts accepted and the processed logits of the rows the emitted tokens
        were drawn at (for log-probabilities; None when the request asked for none), from the target logits at
        the drafts' positions with the request's processors applied at each (the tokens before a position
        include the drafts before it); then the one bookkeeping path for chains and trees: metrics, the drafter's
        γ (chains), the drafter's own roll-back (``on_verified``) and the row whose hidden state the drafters
        observe next."""
        t0 = time.perf_counter()
        st = seq.draft_state
        assert st.method is not None, "verify() of a sequence that did not draft"
        prop = self.proposers[st.method]
        drafted = len(seq.draft_token_ids)
        if st.tree_parents is not None:
            tokens, path, logits = self._walk_tree(seq, res, prop, st.tree_parents)
            self._compact(seq, path)
            accepted, hidden_row = len(path), (path[-1] + 1 if path else 0)
            # a gathered copy: made only for a request that reports log-probabilities
            drawn = logits[[0] + [i + 1 for i in path]] if seq.params.logprobs is not None else None
        else:
            tokens, accepted, logits = self._walk_chain(seq, res, prop)
            path, hidden_row = list(range(accepted)), accepted
            drawn = logits[: len(tokens)]
            self.gamma.update(self.state(seq, st.method), drafted, accepted)
        m = seq.metrics
        m.num_draft_tokens += drafted
        m.num_accepted_tokens += accepted
        m.num_drafts += drafted > 0
        m.accepted_per_pos.extend([0] * (accepted - len(m.accepted_per_pos)))
        for i in range(accepted):
            m.accepted_per_pos[i] += 1
        st.accepted_path = path  # which nodes: a hybrid tells its trunk drafter how much was its own
        prop.on_verified(seq, seq.num_tokens, accepted)
        st.hidden_row = hidden_row
        self.verify_s = self._ema(self.verify_s, rank0_value(time.perf_counter() - t0))
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
        if self.router is not None:
            self.router.finish(seq)


__all__ = ["Speculator"]
