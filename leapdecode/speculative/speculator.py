"""Glue between the engine and the drafters: how many drafts per sequence, proposing, verifying, bookkeeping.

The engine calls, per step and in this order (engine/drafting.py): ``draft_limits`` for the decoding sequences
before it schedules (plain data the scheduler reserves room from), ``propose`` with a snapshot of the scheduled
slots (drafts come back as ``Draft`` values), ``shape_item`` for tree layouts, then per sequence ``verify`` (a
``Verdict``) and ``observe``; ``release`` when a request finishes or is aborted, ``preempt`` when the scheduler
preempts it. The speculator owns which proposer drafts for which sequence (``DraftState.method``, one record per
request id in ``states``); the proposers come from the registry, the sizing rules from policy.py, the acceptance
rules from acceptance.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.drafting import Draft, StepSnapshot, Verdict
from leapdecode.engine.model_runner import ForwardItem, ForwardResult
from leapdecode.engine.sampling import stack_rows
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.layer_ops import row_argmax
from leapdecode.layers.sampler import RowContext, apply_processors, processed_probs
from leapdecode.parallel import group_size, rank0_value
from leapdecode.speculative.acceptance import (
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
    verify_tree_typical,
)
from leapdecode.speculative.counterfactual import PendingDraft, decided, hold
from leapdecode.speculative.policy import (
    DynamicGamma,
    GammaState,
    StepCostModel,
    TreeRealism,
    calibrate_target,
    expected_tokens,
)
from leapdecode.speculative.proposer import EngineView, Proposer, Verification
from leapdecode.speculative.registry import METHODS, auto_methods, make_proposer, parse_config
from leapdecode.speculative.router import AUTO, KV_SHORT, AutoOptions, DrafterFacts, Router, pick
from leapdecode.speculative.state import DraftState
from leapdecode.speculative.tree import compaction_moves, depths_of, path_to, tree_attention_mask

MIN_HEADROOM = 1.2  # in a batch, drafting is considered only where perfect drafts could speed the step up 20%
LEARN_ROWS_WITHOUT_HEADROOM = 2  # rows the row observers learn from in a batched step where nobody may draft
LEARN_SHARE = 0.01  # in a batched step with headroom, the row observers learn from plain rows for about this share
# of the step's modelled time (at least LEARN_ROWS_WITHOUT_HEADROOM rows)
OVERHEAD_EMA = 0.2  # weight of the newest measurement in the speculation-overhead averages
UNMODELLED_FADE = 0.02  # per sequence and step a drafter sits out: its unmodelled drafting time fades this share


@dataclass
class StepLoad:
    """The step as ``draft_limits`` has sized it so far: ``batch`` sequences, ``rows`` rows (each sequence's token
    plus the drafts granted so far) and the tokens it is expected to emit. Each sequence's drafts are weighed
    against the step as the earlier grants left it, so a batch in which every sequence would draft if it were the
    only one does not grow into a step whose rows cost more than they emit."""

    batch: int
    rows: int
    tokens: float

    def grant(self, k: int, gain: float) -> None:
        self.rows += k
        self.tokens += gain


def _draft_depth(num_drafts: int, parents: list[int] | None) -> int:
    """How many draft positions a proposal spans: a chain's length, a tree's depth."""
    return num_drafts if parents is None else max(depths_of(parents), default=0)


class Speculator:
    """Owns one proposer per usable method (one, or several for ``auto``) and decides per sequence and per step
    which method drafts and how many tokens, from each method's measured acceptance on that sequence and the
    measured cost of target (and drafter) steps. Invariant: a sequence's drafts always come from one proposer
    per step, recorded in its ``DraftState.method``, and only that proposer is told the verification result.
    """

    parse = staticmethod(parse_config)  # what the engine checks a new speculative_config dict with

    def __init__(self, view: EngineView, cfg: SpeculativeConfig | dict[str, Any],
                 proposer: Proposer | None = None) -> None:
        self.view = view
        self.cfg = cfg = parse_config(cfg)  # type: ignore[assignment]
        assert cfg is not None
        self.states: dict[str, DraftState] = {}  # request id -> what the speculator keeps for it
        if proposer is not None:
            self.proposers = {cfg.method: proposer}
        else:
            names = auto_methods(cfg, view.model) if cfg.method == AUTO else [cfg.method]
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
        self.realism = TreeRealism()  # tree drafters: accepted nodes against what their own estimates promised
        # drafts verified, per draft position j (a tree's depth j): [drafted at j, of them accepted] (acceptance by
        # draft position; a tree counts as accepted at depth j when its accepted path reached it)
        self.position_counts: list[list[int]] = []
        # fixed-budget drafters (blockwise top-k) never consult the cost model: no start-up calibration for them
        sized_by_cost = any(not p.fixed_budget for p in self.proposers.values())
        if (cfg.use_cost_model or cfg.method == AUTO) and sized_by_cost:
            self.cost = calibrate_target(view.runner, view.block_manager)
            for prop in self.proposers.values():
                prop.calibrate_cost()  # drafters that run a model time their own steps
        if cfg.method == AUTO and self.cost is not None:
            self._drop_unprofitable()
        # the drafters called after every committed step (declared: proposer.py), listed once
        self.watchers = [p for p in self.proposers.values() if p.observes]
        self.row_observers = [p for p in self.proposers.values() if p.observes_rows]
        # rows the row observers learn from this step (None: all); in a batched step (draft_limits) a few, in turn
        # (learn_turn): 2 without headroom, else as many as fit LEARN_SHARE of the step (_learn_budget), so a large
        # vocabulary's top-k over a whole batch does not cost a step
        self.learn_rows: int | None = None
        self.learn_turn = 0
        self.learn_row_s = 0.0  # measured seconds the row observers take per plain row (EMA)
        self.router: Router | None = None  # auto: the strategy router (router.py) picks per request and step
        if cfg.method == AUTO:
            facts = []
            for n, p in self.proposers.items():
                use = METHODS[n].auto
                assert use is not None
                facts.append(DrafterFacts(n, p.memory_bytes() / 2**20, use.branch, use.rank, use.self_draft))
            tok = view.tokenizer
            text: Callable[[list[int]], str] = (lambda ids: "") if tok is None else \
                (lambda ids: tok.decode(ids, skip_special_tokens=True))
            self.router = Router(cfg.options(AutoOptions), facts, text, self.dropped)

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
    def draft_state(self, seq: Sequence) -> DraftState:
        """What the speculator keeps for ``seq`` (made on first use, dropped by ``release``)."""
        st = self.states.get(seq.request_id)
        if st is None:
            st = self.states[seq.request_id] = DraftState()
        return st

    def state(self, seq: Sequence, method: str) -> GammaState:
        states = self.draft_state(seq).gamma
        st = states.get(method)
        if st is None:
            st = states[method] = self.gamma.new_state()
            st.acceptance_ema = self.start_acceptance(seq, method)
        return st

    def start_acceptance(self, seq: Sequence, method: str) -> float:
        """Where ``seq``'s acceptance estimate for ``method`` starts: under ``auto`` what the router measured for
        the request's task, else the drafter's prior."""
        prior = self.proposers[method].acceptance_prior()
        return prior if self.router is None else self.router.prior(seq, self.draft_state(seq), method, prior)

    def _room(self, seq: Sequence) -> int:
        """The most drafts ``seq`` can verify: one emitted token is the target's own, within max_tokens and the
        model's context."""
        return min(seq.params.max_tokens - seq.num_output_tokens - 1, self.view.max_model_len - seq.num_tokens - 1)

    def draft_limits(self, decoding: list[Sequence], num_running: int) -> dict[str, int]:
        """The most draft tokens each decoding sequence may verify this step, by request id (absent: plain
        decoding), with ``num_running`` sequences in the batch; picks each one's method."""
        batch = max(1, num_running)
        limits: dict[str, int] = {}
        self.learn_rows = None
        if batch > 1 and self.cost is not None and \
                self.cost.headroom(batch, self.cfg.max_draft_tokens) < MIN_HEADROOM:
            # rows cost about their count at this batch (measured): even drafts that were all accepted would gain
            # less than asking the drafters (indexing prompts, matching, sizing) costs a batched step; and the
            # drafters that learn from the target's rows learn from a few of them (on a 262k vocabulary, the
            # top-k of 16 rows took ~4-8 ms of a 37 ms step)
            self.learn_rows = LEARN_ROWS_WITHOUT_HEADROOM
            for seq in decoding:
                self.draft_state(seq).begin_step()
            return limits
        if batch > 1:
            self.learn_rows = self._learn_budget(batch)
        load = StepLoad(batch, batch, float(batch))
        for seq in decoding:
            k = self._limit(seq, load)
            if k > 0:
                limits[seq.request_id] = k
        return limits

    def _learn_budget(self, batch: int) -> int | None:
        """How many plain rows the row observers learn from in a batched step that may draft (None: all): as many as
        their measured time per row fits in LEARN_SHARE of the step, at least LEARN_ROWS_WITHOUT_HEADROOM. On Gemma 3
        270M's 262,144-token vocabulary a row's top-k takes ~140 us, and learning from all 16 rows of a batch-16 step
        cost recycling ~4% of the step with nothing drafted (Zen 3, int8 activations); a drafting sequence's verified
        rows are learnt from in full all the same."""
        if self.cost is None or self.learn_row_s <= 0.0:
            return None
        rows = max(LEARN_ROWS_WITHOUT_HEADROOM, int(LEARN_SHARE * self.cost(batch) / self.learn_row_s))
        return None if rows >= batch else rows

    def _limit(self, seq: Sequence, load: StepLoad) -> int:
        self.draft_state(seq).begin_step()
        if not seq.params.speculative:
            return 0
        room = self._room(seq)
        if room <= 0:
            return 0
        return self._choose(seq, room, load)

    def _choose(self, seq: Sequence, room: int, load: StepLoad) -> int:
        """The method and draft length ``seq`` takes in the step as sized so far (``load``, which the choice
        joins)."""
        batch = load.batch
        names = list(self.proposers)
        st = self.draft_state(seq)
        pause_alone = self.router is not None  # auto: at batch 1 too, a drafter with nothing to draft pauses
        if self.router is not None:
            names = [n for n in self.router.route(seq, st).candidates if n in self.proposers]
            if self.router.kv_short(self.view.block_manager):
                self.router.depart(seq, st, f"KV short: under {KV_SHORT:.0%} of the KV pool free, no drafting")
                return 0
            names = self.router.compute_path(seq, st, names, lambda n: self.proposers[n].has_draft(seq))
        # every method must beat plain decoding's rate to be chosen
        plain = load.tokens / self.cost(load.rows) if self.cost is not None else 0.0
        rates: dict[str, tuple[int, float]] = {}
        gains: dict[str, float] = {}  # the tokens each candidate's drafts are expected to add
        # every candidate that sized a draft: (tokens, the accepted nodes a tree drafter's own estimate promises;
        # 0 for chains)
        sized: dict[str, tuple[int, float]] = {}
        for name in names:
            prop = self.proposers[name]
            # (no cost model: asked every step)
            if self.cost is not None and st.paused(name, batch, pause_alone):
                continue
            if not prop.has_draft(seq):  # e.g. prompt lookup without a match: not a candidate this step
                st.said_no(name, batch, pause_alone)
                continue
            tree = prop.tree_budget(seq, room, self.cost, batch)
            if tree is not None and prop.fixed_budget:  # the method's own block size, not the cost model's call
                if tree[0] > 0:
                    st.method = name
                    load.grant(tree[0], tree[1] - 1.0)
                    return tree[0]
                continue
            k, rate, gain = self._tree_rate(name, prop, tree, load) if tree is not None else \
                self._chain_rate(seq, name, prop, room, load)
            if k > 0:
                sized[name] = (k, tree[1] - 1.0 if tree is not None else 0.0)
            if k > 0 and rate > plain:
                rates[name] = (k, rate)
                gains[name] = gain
                st.idle.pop(name, None)
            else:
                st.said_no(name, batch, pause_alone)
                if tree is not None:
                    self.realism.fade(name)
        if self.router is None:  # the fastest (the first of equals)
            best = max(rates, key=lambda n: rates[n][1]) if rates else None
            best_k = rates[best][0] if best is not None else 0
        else:
            best, best_k, note = pick(self.router.route(seq, st), rates)
            if note is not None:
                self.router.depart(seq, st, note)
        st.method = best
        st.tree_promise = sized[best][1] if best is not None else 0.0  # the chosen one is among the sized
        if best is not None and best_k > 0:
            load.grant(best_k, gains.get(best, 0.0))
        for name, (k, promise) in sized.items():  # the others' drafts, scored later (counterfactual.py)
            other = self.proposers[name].peek(seq, k) if name != best else None
            if other is not None and other.tokens:
                hold(st.pending, PendingDraft(name, seq.num_tokens, tuple(other.tokens),
                                              tuple(other.parents) if other.parents is not None else None, promise))
        return best_k

    def _tree_rate(self, name: str, prop: Proposer, tree: tuple[int, float],
                   load: StepLoad) -> tuple[int, float, float]:
        """A tree drafter's own size (Proposer.tree_budget), the step's tokens per second with it and the tokens
        it adds: its own estimate of the accepted nodes scaled by what its trees have delivered against such
        estimates (TreeRealism)."""
        k, exp_tokens = tree
        if k <= 0 or self.cost is None:
            return k, exp_tokens, 0.0
        gain = (exp_tokens - 1.0) * self.realism.ratio(name)
        t = self.cost(load.rows + k) + prop.step_cost(load.batch, k) + self.overhead(name, prop, load.batch)
        return k, (load.tokens + gain) / t, gain

    def _chain_rate(self, seq: Sequence, name: str, prop: Proposer, room: int,
                    load: StepLoad) -> tuple[int, float, float]:
        """A chain drafter's dynamic γ for ``seq``, cut to what pays under the cost model in the step as sized so
        far, the step's rate with it and the tokens it adds."""
        st = self.state(seq, name)
        k = min(st.gamma, room)
        if self.cost is None:
            return k, float(k), 0.0
        batch = load.batch
        over = self.overhead(name, prop, batch)
        k = self.cost.best_gamma(st.acceptance_ema, k, load.rows, load.tokens,
                                 lambda g: prop.step_cost(batch, g) + over)
        if k == 0:
            # drift back toward the prior while not drafting, so a sequence whose text turns repetitive (or
            # copies from its input) gets to try again; and let the measured unmodelled drafting time fade, so
            # one slow call (a long catch-up, a pause) does not keep a drafter out for good: if it was no outlier,
            # the next try measures it again
            st.acceptance_ema += 0.05 * (self.start_acceptance(seq, name) - st.acceptance_ema)
            if name in self.propose_s:
                self.propose_s[name] *= 1.0 - UNMODELLED_FADE
            return 0, 0.0, 0.0
        t = self.cost(load.rows + k) + prop.step_cost(batch, k) + over
        gain = expected_tokens(st.acceptance_ema, k) - 1.0
        return k, (load.tokens + gain) / t, gain

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
    def propose(self, snapshot: StepSnapshot) -> dict[str, Draft]:
        """Each chosen proposer drafts for its slots, in one call per proposer; the drafts come back as values, by
        request id (a sequence whose proposal is empty is absent)."""
        by_method: dict[str, list[tuple[Sequence, int]]] = {}
        for slot in snapshot.slots:
            by_method.setdefault(self.draft_state(slot.seq).method or "", []).append((slot.seq, slot.budget))
        drafts: dict[str, Draft] = {}
        for name, group in by_method.items():
            if name not in self.proposers:
                continue
            seqs, budgets = [seq for seq, _ in group], [k for _, k in group]
            t0 = time.perf_counter()
            props = self.proposers[name].propose(seqs, budgets)
            spent = rank0_value(time.perf_counter() - t0)  # rank 0's clock on every rank
            modelled = self.proposers[name].step_cost(len(seqs), max(budgets))
            self.propose_s[name] = self._ema(self.propose_s.get(name, 0.0), (spent - modelled) / len(seqs))
            for seq, prop in zip(seqs, props):
                st = self.draft_state(seq)
                if prop.tokens:
                    seq.metrics.draft_methods[name] = seq.metrics.draft_methods.get(name, 0) + 1
                    parents = tuple(prop.parents) if prop.parents else None
                    drafts[seq.request_id] = Draft(name, tuple(prop.tokens), prop.probs, parents)
                elif self.router is not None and name in st.gamma:
                    # it ran and stopped before its first draft (a draft model below its confidence floor): the
                    # step cost its time and gained nothing, as a verification that accepted nothing would
                    self.gamma.update(st.gamma[name], 1, 0)
        return drafts

    @staticmethod
    def shape_item(draft: Draft, item: ForwardItem, num_prefix: int) -> None:
        """A candidate tree runs as ``num_prefix`` ordinary tokens (the last is the root) plus its nodes at
        RoPE positions by depth under the ancestor mask; chains keep the plain causal layout."""
        if draft.parents is None:
            return
        parents = list(draft.parents)
        item.depths = list(range(num_prefix)) + [num_prefix - 1 + d for d in depths_of(parents)]
        item.tree_mask = tree_attention_mask(parents, num_prefix)

    def observe(self, seq: Sequence, res: ForwardResult, draft: Draft, verdict: Verdict) -> None:
        """After a verification committed tokens to ``seq``: acceptance by draft position (a chain's) or depth (a
        tree's), then what every committed step hands on (``_after_commit``) at the verdict's row."""
        # a chain counts by position, a tree by depth (its accepted path runs one node per depth)
        self._count_positions(_draft_depth(len(draft.tokens), draft.parents), verdict.num_accepted)
        self._after_commit(seq, res, verdict.hidden_row)

    def observe_sampled(self, seqs: list[Sequence], results: list[ForwardResult]) -> None:
        """After plain sampling committed one token to each of ``seqs`` (``results``: their forwards): drafters that
        learn from the target's logits get every sequence's row in one call (each row's input was the token before
        the new one; in a batched step ``learn_rows`` of them where that is set, in turn), then each sequence goes on
        as after a verification, at its last row."""
        if self.row_observers:
            alive = [i for i, seq in enumerate(seqs) if not seq.is_finished and seq.num_tokens >= 2]
            n = self.learn_rows
            if n is not None and len(alive) > n:
                alive = sorted(alive[(self.learn_turn + j) % len(alive)] for j in range(n))
                self.learn_turn += n
            if alive:
                t0 = time.perf_counter()
                tokens = [seqs[i].token_ids[-2] for i in alive]
                logits = stack_rows([results[i].logits[-1] for i in alive])  # a view where the rows are consecutive
                for prop in self.row_observers:
                    prop.observe_rows(tokens, logits)
                if len(seqs) > 1:  # the budget is for batched steps, where a call's fixed cost spreads over rows
                    spent = rank0_value(time.perf_counter() - t0)  # every rank learns from the same rows
                    self.learn_row_s = self._ema(self.learn_row_s, spent / len(alive))
        for seq, res in zip(seqs, results):
            self._after_commit(seq, res, -1)

    def _after_commit(self, seq: Sequence, res: ForwardResult, row: int) -> None:
        """Drafters that declare ``observes`` get the hidden state of ``row`` (the one behind the last emitted
        token); under auto the copy detector reads the new tokens."""
        if seq.is_finished:
            return
        # held drafts the committed tokens now decide enter the estimates a verification of them would have
        for d, accepted in decided(self.draft_state(seq).pending, seq.token_ids):
            if d.parents is None:
                self.gamma.update(self.state(seq, d.method), len(d.tokens), accepted)
            elif d.promise > 0:
                self.realism.record(d.method, d.promise, accepted)
        # only drafters that declare they observe (heads) are called: indexing the row costs ~5 us a call, paid
        # per sequence and drafter on every step, and most drafters ignore it
        if self.watchers and res.hidden.numel():
            hidden = res.hidden[row]
            for prop in self.watchers:
                prop.observe(seq, hidden)
        if self.router is not None and res.logits.numel():
            # the difficulty signal (compute_path "difficulty")
            self.router.observe_logits(self.draft_state(seq), res.logits[row])
        if self.router is not None and self.router.domain_switch(seq, self.draft_state(seq)) is not None:
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
        ds = self.draft_state(seq)
        for method, st in ds.gamma.items():
            st.acceptance_ema = self.start_acceptance(seq, method)
        for name in self.proposers:
            use = METHODS[name].auto
            if use is not None and use.tracks_copying:
                self.state(seq, name).acceptance_ema = ds.domain.hit_rate

    def verify(self, seq: Sequence, draft: Draft, res: ForwardResult) -> Verdict:
        """What the target's pass accepts of ``draft``, from the target logits at the drafts' positions with the
        request's processors applied at each (the tokens before a position include the drafts before it); then the
        one bookkeeping path for chains and trees: metrics, the drafter's γ (chains), the drafter's own roll-back
        (``on_verified``). The verdict's ``drawn`` rows are the processed logits the committed tokens were drawn
        at (for log-probabilities; None when the request asked for none)."""
        t0 = time.perf_counter()
        prop = self.proposers[draft.method]
        drafts = list(draft.tokens)
        drafted = len(drafts)
        for watcher in self.row_observers:  # rows: the root (the last committed token), then each draft
            watcher.observe_rows([seq.token_ids[-1], *drafts], res.logits)
        parents = list(draft.parents) if draft.parents is not None else None
        if parents is not None:
            tokens, path, logits = self._walk_tree(seq, drafts, parents, res, prop)
            promise = self.draft_state(seq).tree_promise
            if promise > 0:
                self.realism.record(draft.method, promise, len(path))
            self._compact(seq, path)
            hidden_row = path[-1] + 1 if path else 0
            # a gathered copy: made only for a request that reports log-probabilities
            drawn = logits[[0] + [i + 1 for i in path]] if seq.params.logprobs is not None else None
        else:
            tokens, accepted, logits = self._walk_chain(seq, drafts, draft.probs, res, prop)
            path, hidden_row = list(range(accepted)), accepted
            drawn = logits[: len(tokens)]
            self.gamma.update(self.state(seq, draft.method), drafted, accepted)
        m = seq.metrics
        m.num_draft_tokens += drafted
        m.num_accepted_tokens += len(path)
        m.num_drafts += drafted > 0
        m.accepted_per_pos.extend([0] * (len(path) - len(m.accepted_per_pos)))
        for i in range(len(path)):
            m.accepted_per_pos[i] += 1
        prop.on_verified(seq, Verification(seq.num_tokens, drafts, parents, list(path), list(tokens), logits))
        self.verify_s = self._ema(self.verify_s, rank0_value(time.perf_counter() - t0))
        return Verdict(tokens, path, drawn, hidden_row)

    def _generator(self, seq: Sequence) -> torch.Generator:
        return seq.generator or self.view.generator

    def _walk_chain(
        self, seq: Sequence, drafts: list[int], probs: torch.Tensor | None, res: ForwardResult, prop: Proposer
    ) -> tuple[list[int], int, torch.Tensor]:
        """A chain: the drafter's own acceptance rule where it has one (blockwise), else greedy match or
        rejection sampling (acceptance.py). Also returns the processed logits of every row."""
        k = len(drafts)
        logits = res.logits
        if seq.params.has_processors:
            masks = seq.grammar.masks_along(drafts) if seq.grammar is not None else [None] * (k + 1)
            rows = [RowContext(seq.params, seq.token_ids + drafts[:j], seq.num_prompt_tokens, seq.stop_ids, masks[j])
                    for j in range(k + 1)]
            logits = apply_processors(logits, rows)
        own = prop.verify_chain(seq, drafts, logits, self._generator(seq))
        if own is not None:
            return own[0], own[1], logits
        if seq.params.greedy:
            return (*verify_greedy(row_argmax(logits), drafts), logits)
        p = processed_probs(logits, [seq.params] * (k + 1))
        return (*verify_sampling(p, drafts, probs, self._generator(seq)), logits)

    def _walk_tree(self, seq: Sequence, drafts: list[int], parents: list[int], res: ForwardResult,
                   prop: Proposer) -> tuple[list[int], list[int], torch.Tensor]:
        """A tree: (emitted tokens, accepted node indices along the path, processed logits of every row) by the
        tree walk (acceptance.py)."""
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
            return (*verify_tree_greedy(row_argmax(logits), drafts, parents), logits)
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
        """``seq`` finished or was aborted: every proposer frees what it keeps for it, the router folds in what
        the request measured, and the speculator forgets it."""
        for prop in self.proposers.values():
            prop.release(seq)
        st = self.states.pop(seq.request_id, None)
        if self.router is not None and st is not None:
            self.router.finish(st)

    def preempt(self, seq: Sequence) -> None:
        """The scheduler preempted ``seq``: the proposers free what they keep for it (they rebuild it when it drafts
        again); the speculator keeps its estimates and route, which still hold for the request."""
        for prop in self.proposers.values():
            prop.release(seq)

    def close(self) -> None:
        """The engine stops using this speculator: every proposer stops whatever it does on the engine's passes."""
        for prop in self.proposers.values():
            prop.detach()


__all__ = ["Speculator"]
