"""The shared base of drafters that keep a paged KV cache of their own beside the target's, and their one drafting
loop.

A draft model, an exit adapter or EAGLE's feature draft each run layers of their own over every sequence, so they
need K/V for those layers: their own ``BlockManager`` over their own pool, and per target sequence a ``Shadow``
(a block table and how many leading positions it holds). The invariant all of them keep: after verification a
shadow never claims more than the committed prefix (``on_verified`` trims it), and ``release`` frees it, so a
rejected draft never leaves K/V behind that a later step would read.

``ShadowCacheProposer.propose`` is the one chain-drafting loop of all of them: plan the decoding sequences that
can draft (``_plan``: blocks reserved, catch-up rows from ``_catchup_for``), then per draft position one batched
pass of the method's own (``_draft_pass``: the catch-up pass first, then one fed token per chain) and one draw
per chain (``_draft_step``). A chain stops at its budget, or where the draft's top probability falls below
``min_draft_prob``. What differs between methods is only the pass: which layers run on which inputs.

Draws go through :func:`draw_draft`, one rule for every drafter: greedy requests (and ``argmax_drafts`` drafters)
take the argmax; sampled ones draw from the request's processed distribution with its own generator, or the
engine's for an unseeded request, and keep the distribution for rejection sampling.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.model_runner import ForwardItem
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.sampler import processed_probs, sample_from
from leapdecode.speculative.policy import StepCostModel
from leapdecode.speculative.proposer import Proposal, Proposer, Verification


@dataclass
class Shadow:
    """A drafter's view of one target sequence in its own cache; duck-types the parts of Sequence that
    BlockManager uses."""

    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


@dataclass
class Plan:
    """One sequence's drafting this step."""

    index: int  # into the propose() arguments
    seq: Sequence
    shadow: Shadow  # the drafter's cache: block table and how many leading positions it holds
    budget: int
    catchup: torch.Tensor | None = None  # [m, H] inputs of committed positions the drafter has not seen, or None
    feature: torch.Tensor | None = None  # what a pass hands the next one for this chain (EAGLE: its newest feature)


# one draft pass's float logits [rows, columns] and the token id of each column (None: the whole vocabulary)
DraftLogits = tuple[torch.Tensor, torch.Tensor | None]


def draw_draft(seq: Sequence, logits: torch.Tensor, generator: torch.Generator,
               argmax: bool) -> tuple[int, torch.Tensor | None]:
    """One draft token from ``logits`` [1, V] for ``seq`` and, when sampled, the distribution it was drawn from
    (``generator``: the engine's, used when the request has none of its own)."""
    if seq.params.greedy or argmax:
        return int(logits.argmax(dim=-1)), None
    q = processed_probs(logits, [seq.params])[0]
    return sample_from(q, seq.generator or generator), q


def attach_probs(props: list[Proposal], probs_rows: dict[int, list[torch.Tensor]]) -> list[Proposal]:
    """Attach each sampled chain's draft distributions (rows in draft order) to its proposal."""
    for i, rows in probs_rows.items():
        if rows:
            props[i].probs = torch.stack(rows)
    return props


def full_width(sub: torch.Tensor, ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Logits over the columns ``ids`` scattered into the whole vocabulary (-inf elsewhere): a sampled draft's
    distribution, which rejection sampling compares with the target's over every token."""
    if ids is None:
        return sub
    out = sub.new_full((sub.shape[0], vocab_size), float("-inf"))
    out[:, ids] = sub
    return out


class ShadowCacheProposer(Proposer):
    """A drafter with its own paged KV cache that mirrors each target sequence with a ``Shadow``, drafting chains
    through the one loop of the module docstring. Subclasses set the attributes below and implement
    ``_draft_pass`` (and ``_catchup_for`` when their first pass reads more than tokens), and time their own draft
    steps (``timed_draft_step``) for the cost model."""

    shadows: dict[str, Shadow]
    shadow_bm: BlockManager
    generator: torch.Generator  # the engine's, for unseeded sampled requests
    max_model_len: int
    vocab_size: int  # the target's: a sampled draft's distribution spans it
    #: stop a chain where the draft's top probability falls below this (0: draft the whole budget)
    min_draft_prob: float = 0.0
    #: draft each sequence's argmax even when it samples: a tree verifier (hybrid) needs candidates, not draws,
    #: and drafting then consumes nothing of the sequence's random stream (seeded output stays reproducible)
    argmax_drafts: bool = False
    #: seconds per draft step by rows in it, measured by ``calibrate_cost`` (None: not calibrated, costs 0)
    step_cost_fn: Callable[[int], float] | None = None

    # ------------------------------------------------------------------------------------- method hooks
    @abstractmethod
    def _draft_pass(self, active: list[Plan], fed: list[int] | None) -> tuple[list[ForwardItem], DraftLogits]:
        """One batched draft pass over the chains ``active``: the first (``fed`` None) catches each up on what it
        has not seen and feeds its last committed token; later ones feed each chain its previous draft
        (``fed[j]``) at ``shadow.num_computed_tokens``. Returns the items written to the drafter's cache (one per
        chain, in order) and one logit row per chain."""

    def _catchup_for(self, seq: Sequence, start: int) -> torch.Tensor | None:
        """Inputs the first pass needs for committed positions [start, n-1) beyond their tokens. Default: None
        (a draft model reads the tokens themselves)."""
        return None

    # ------------------------------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in seqs]
        active = self._plan(seqs, budgets)
        probs_rows: dict[int, list[torch.Tensor]] = {p.index: [] for p in active}
        fed: list[int] | None = None
        while active:
            items, logits = self._draft_pass(active, fed)
            keep, fed = self._draft_step(active, items, logits, props, probs_rows)
            active = [active[j] for j in keep]
        return attach_probs(props, probs_rows)

    def _plan(self, seqs: list[Sequence], budgets: list[int]) -> list[Plan]:
        """The decoding sequences that can draft this step, each with blocks reserved for the positions it will
        write and its catch-up inputs (``_catchup_for``)."""
        plans: list[Plan] = []
        for i, (seq, k) in enumerate(zip(seqs, budgets)):
            n = seq.num_tokens
            k = min(k, self.max_model_len - n)
            # only decoding sequences: the target's cache holds every token but the last
            if k <= 0 or seq.num_computed_tokens != n - 1:
                continue
            sh = self.shadows.setdefault(seq.request_id, Shadow())
            if sh.num_computed_tokens > n - 1:  # defensive: never trust drafter K/V past the committed prefix
                sh.num_computed_tokens = n - 1
            # the drafter writes positions a .. n+k-2 (the last committed token and all drafts but the last)
            if not self._reserve(sh, n + k - 1):
                continue
            plans.append(Plan(i, seq, sh, k, self._catchup_for(seq, sh.num_computed_tokens)))
        return plans

    def _reserve(self, sh: Shadow, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` positions; False when the pool is short. Only running sequences hold shadows:
        the speculator releases a request's on finish, abort and preemption (a preempted one rebuilds its shadow
        when it drafts again)."""
        bm = self.shadow_bm
        if not bm.can_allocate(sh, num_tokens):  # type: ignore[arg-type]
            return False
        bm.allocate(sh, num_tokens)  # type: ignore[arg-type]
        return True

    def _draft_step(self, active: list[Plan], items: list[ForwardItem], logits: DraftLogits,
                    props: list[Proposal], probs_rows: dict[int, list[torch.Tensor]]) -> tuple[list[int], list[int]]:
        """One draft position for every active chain (row j of ``logits`` is chain j's): its cache now covers
        ``items``; a chain whose top probability is below ``min_draft_prob`` stops, the others draft their argmax
        (or sample it, keeping the distribution for rejection sampling). Returns the indices into ``active`` of
        the chains that go on and the tokens they drafted."""
        sub, ids = logits
        top: list[float] | None = None
        if self.min_draft_prob > 0:
            best = torch.softmax(sub, dim=-1).max(dim=-1)
            top, idx = best.values.tolist(), best.indices
        else:
            idx = sub.argmax(dim=-1)
        argmax = (idx if ids is None else ids[idx]).tolist()
        keep, toks = [], []
        for j, (p, it) in enumerate(zip(active, items)):
            p.shadow.num_computed_tokens = it.start + len(it.tokens)
            seq = p.seq
            if top is not None and top[j] < self.min_draft_prob:
                continue  # not confident enough: stop this chain here
            if seq.params.greedy or self.argmax_drafts:
                tok = argmax[j]
            else:
                tok, q = draw_draft(seq, full_width(sub[j : j + 1], ids, self.vocab_size), self.generator, False)
                assert q is not None  # a sampled draft
                probs_rows[p.index].append(q)
            props[p.index].tokens.append(tok)
            if len(props[p.index].tokens) < p.budget:
                keep.append(j)
                toks.append(tok)
        return keep, toks

    # -------------------------------------------------------------------------------------- bookkeeping
    def timed_draft_step(self, n: int) -> None:
        """Run one draft step of ``n`` rows at a short context (what ``calibrate_cost`` times)."""
        raise NotImplementedError

    def calibrate_cost(self) -> None:
        """Time draft steps of 1, 2, 4, 8 rows (``timed_draft_step``), 3 times each."""
        self.step_cost_fn = StepCostModel.calibrate(self.timed_draft_step, sizes=(1, 2, 4, 8), repeats=3)

    def step_cost(self, num_seqs: int, num_tokens: int) -> float:
        if self.step_cost_fn is None:
            return 0.0
        return num_tokens * self.step_cost_fn(num_seqs)

    def on_verified(self, seq: Sequence, result: Verification) -> None:
        self.roll_back(seq, result.num_prefix_tokens + result.num_accepted)

    def roll_back(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the drafter's cache of ``seq`` for its first ``num_tokens`` positions at most (the committed ones)."""
        sh = self.shadows.get(seq.request_id)
        if sh is None:
            return
        sh.num_computed_tokens = min(sh.num_computed_tokens, num_tokens)
        self.shadow_bm.trim(sh, sh.num_computed_tokens)  # type: ignore[arg-type]

    def release(self, seq: Sequence) -> None:
        sh = self.shadows.pop(seq.request_id, None)
        if sh is not None:
            self.shadow_bm.free(sh)  # type: ignore[arg-type]


__all__ = ["DraftLogits", "Plan", "Shadow", "ShadowCacheProposer", "attach_probs", "draw_draft", "full_width"]
