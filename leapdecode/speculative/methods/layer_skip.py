"""Layer-skip self-drafting: the target drafts for itself with some of its middle layers left out (Zhang et al.
2023, Draft & Verify; Xia et al. 2024, SWIFT). No trained artefact and no second model: any model the engine
loads (every family runs as the one decoder of models/llama.py), and the skip set is found online.

**The draft pass.** Per draft position one batched pass over the drafting sequences: the embedding, every kept
layer (each contiguous run of kept layers in one call, so the CPU's fused layer stack still serves it), the final
norm and the LM head. It feeds the sequence's last committed token at its position, then each draft at the next.

**The KV cache.** The draft runs in the target's own cache. A kept layer attends over the target's K/V of the
committed prefix (the full model's, as Draft & Verify does) and over the draft's own K/V of this chain, which it
writes into the target's slots *beyond* the committed prefix: the last committed token's slot (not computed
yet: one token is always left to compute) and the drafts' slots, which the scheduler reserved for this step.
Skipped layers neither read nor write anything. Every slot a draft pass writes is a row of the verification that
follows (the last committed token, then each draft), and the verification runs every layer over its rows and
overwrites those K/V with the target's own before anything reads them again: nothing of the draft survives the
step, so there is nothing to roll back, no shadow cache, and the committed prefix is never written. Greedy
output is therefore token-identical to plain decoding, and sampled output has the target's distribution
(drafts are sampled from the draft's own distribution, kept for rejection sampling).

**Which layers.** ``skip_search.SkipSearch`` decides from teacher-forced rounds on windows of committed text
(run by :meth:`LayerSkipProposer.observe` on scratch KV blocks, every ``EVAL_EVERY`` observed steps while rounds
are left) and from the live acceptance of every draft; it scores each set by the tokens per second it promises
under the engine's step-cost model and this drafter's measured pass cost (``speed``). ``skip_layers`` fixes the
set instead.

**Sizing.** A chain drafter: the speculator's dynamic γ, cut by the step-cost model; a new sequence's
acceptance estimate starts at the best set's measured acceptance (``prior_acceptance``), and until a window was
scored there is nothing to propose (``has_draft``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.model_runner import ForwardItem
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.attention import AttentionMetadata
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.speculative.method import AutoUse, Method
from leapdecode.speculative.options import CHAIN_KEYS, check, is_int
from leapdecode.speculative.policy import StepCostModel, expected_tokens
from leapdecode.speculative.proposer import EngineView, Proposal, Proposer, StepCost, Verification
from leapdecode.speculative.router import AutoOptions
from leapdecode.speculative.shadow_cache import attach_probs, draw_draft
from leapdecode.speculative.skip_search import SkipSearch, SkipSet, check_skip

EVAL_EVERY = 8  # observed steps between two search rounds (one window each)
CHOOSE_EVERY = 16  # verified drafts between two choices of the best set from the live acceptance
MAX_SPEED_GAMMA = 8  # the longest chain the search's speed estimate considers
SEARCH_FREE_SHARE = 0.2  # a round runs only while this share of the target's KV pool is free


@dataclass(frozen=True)
class LayerSkipOptions:
    """``skip_layers``: the layers the draft leaves out, fixed (None: searched online); ``search_rounds``: windows
    the online search scores (the first is a grid of skip shares, the others refine the best set);
    ``search_window``: committed tokens per window (rows of each scoring pass)."""

    skip_layers: tuple[int, ...] | None = None
    search_rounds: int = 4
    search_window: int = 8

    def __post_init__(self) -> None:
        s = self.skip_layers
        if isinstance(s, list):
            object.__setattr__(self, "skip_layers", s := tuple(s))
        check(s is None or (isinstance(s, tuple) and len(s) > 0 and all(is_int(i, 0) for i in s)),
              f"skip_layers must be a non-empty list of layer indices, got {s!r}")
        check(is_int(self.search_rounds, 0), f"search_rounds must be an integer >= 0, got {self.search_rounds!r}")
        check(is_int(self.search_window, 2) and self.search_window <= 16,
              f"search_window must be an integer in [2, 16], got {self.search_window!r}")


def kept_runs(num_layers: int, skip: SkipSet) -> list[range]:
    """The contiguous runs of layers a draft with ``skip`` left out runs, in order."""
    runs: list[range] = []
    start = None
    for i in range(num_layers + 1):
        keep = i < num_layers and i not in skip
        if keep and start is None:
            start = i
        elif not keep and start is not None:
            runs.append(range(start, i))
            start = None
    return runs


class LayerSkipProposer(Proposer):
    """Chains drafted by the target with the search's best skip set (module docstring). Per request it keeps only
    the skip set its last chain was drafted with; the search and the cost timings are the engine's."""

    name = "layer_skip"
    observes = True  # the search scores windows of committed text after a step (never inside a timed path)

    def __init__(self, view: EngineView, skip_layers: tuple[int, ...] | None = None, search_rounds: int = 4,
                 search_window: int = 8) -> None:
        self.view = view
        self.model: LlamaForCausalLM = view.model
        self.num_layers = len(self.model.layers)
        fixed = None if skip_layers is None else check_skip(skip_layers, self.num_layers)
        self.search = SkipSearch(self.num_layers, search_rounds, fixed)
        self.window = search_window
        self.generator = view.generator
        self.vocab_size = self.model.config.vocab_size
        self._drafted_with: dict[str, SkipSet] = {}
        self._cost: StepCost | None = None  # the engine's step-cost model, as the speculator last handed it
        self._layers_s: Callable[[int], float] | None = None  # seconds of every layer over n rows (calibrated)
        self._head_s: Callable[[int], float] | None = None  # seconds of the final norm + LM head over n rows
        self._observed = 0
        self._verified = 0
        self.num_rounds = 0  # counters: search rounds run, rows through draft passes, chains drafted
        self.num_draft_rows = 0
        self.num_chains = 0
        self.prior_acceptance = self.search.acceptance()

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, view: EngineView) -> LayerSkipProposer:
        o = cfg.options(LayerSkipOptions)
        return cls(view, o.skip_layers, o.search_rounds, o.search_window)

    # ------------------------------------------------------------------------------------------ passes
    def _run(self, items: list[ForwardItem], skip: SkipSet) -> torch.Tensor:
        """The target without the layers ``skip`` over ``items`` (K/V of kept layers to the items' slots):
        float logits of the items' logit rows."""
        ids, pos, meta, rows = self.view.runner.prepare(items)
        h = self._layers(ids, pos, meta, skip)
        self.num_draft_rows += int(ids.numel())
        return self.model.compute_logits(h.index_select(0, rows)).float()

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, skip: SkipSet) -> torch.Tensor:
        kv = self.view.kv_cache.layers
        runs = kept_runs(self.num_layers, skip)
        h: torch.Tensor | None = None
        for j, run in enumerate(runs):
            h = self.model(ids, pos, kv, meta, layers=run, hidden=h, final_norm=j == len(runs) - 1)
        assert h is not None  # the first and the last layer always run
        return h

    # ------------------------------------------------------------------------------------------ drafting
    def has_draft(self, seq: Sequence) -> bool:
        """Nothing to propose until the search has a skip set."""
        return self.search.best is not None

    def tree_budget(self, seq: Sequence, room: int, cost: StepCost | None, batch: int) -> None:
        """A chain drafter (``None``: the speculator's dynamic γ sizes it); it keeps the engine's step-cost model
        the speculator hands it here, which the search's ``speed`` reads."""
        self._cost = cost
        return None

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in seqs]
        skip = self.search.best
        # only decoding sequences: the target's cache holds every token but the last (the speculator's room keeps
        # every chain inside the model's context)
        active = [i for i, (s, k) in enumerate(zip(seqs, budgets))
                  if k > 0 and s.num_computed_tokens == s.num_tokens - 1]
        if skip is None or not active:
            return props
        probs_rows: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        fed = {i: seqs[i].token_ids[-1] for i in active}
        while active:
            items = [ForwardItem(seqs[i].block_table, seqs[i].num_tokens - 1 + len(props[i].tokens), [fed[i]], [0])
                     for i in active]
            logits = self._run(items, skip)
            keep = []
            for j, i in enumerate(active):
                tok, q = draw_draft(seqs[i], logits[j : j + 1], self.generator, False)
                if q is not None:
                    probs_rows[i].append(q)
                props[i].tokens.append(tok)
                fed[i] = tok
                if len(props[i].tokens) < budgets[i]:
                    keep.append(i)
            active = keep
        for i, p in enumerate(props):
            if p.tokens:
                self._drafted_with[seqs[i].request_id] = skip
                self.num_chains += 1
        return attach_probs(props, probs_rows)

    def on_verified(self, seq: Sequence, result: Verification) -> None:
        """The live acceptance of the set that drafted; every ``CHOOSE_EVERY`` verifications the best set is chosen
        again from all measurements (the draft's K/V need no roll-back: the verification overwrote them)."""
        skip = self._drafted_with.pop(seq.request_id, None)
        if skip is None or not result.drafts:
            return
        self.search.record_live(skip, len(result.drafts), result.num_accepted)
        self._verified += 1
        if self._verified % CHOOSE_EVERY == 0:
            self.search.choose(self.speed)
            self.prior_acceptance = self.search.acceptance()

    def release(self, seq: Sequence) -> None:
        self._drafted_with.pop(seq.request_id, None)

    # ------------------------------------------------------------------------------------------- search
    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """After a step: every ``EVAL_EVERY`` calls while the search has rounds left, one round on ``seq``'s last
        ``search_window`` committed tokens."""
        self._observed += 1
        if not self.search.searching or self._observed % EVAL_EVERY:
            return
        end = seq.num_computed_tokens  # positions with the target's K/V
        if end >= self.window:
            self.score_window(seq, end - self.window, end)

    @torch.inference_mode()
    def score_window(self, seq: Sequence, start: int, end: int) -> bool:
        """One search round on committed positions [start, end) of ``seq``, on scratch blocks: the prefix before
        ``start`` is read from the sequence's own blocks (the part of ``start``'s block before it copied into the
        scratch block), the window's K/V of every pass go to scratch slots. False when the pool lacks room."""
        bm, bs = self.view.block_manager, self.view.block_size
        first = (start // bs) * bs
        need = bm.blocks_needed(end - first)
        if need > bm.num_free_blocks - SEARCH_FREE_SHARE * bm.num_blocks:
            return False
        with bm.borrowed(end - first, "the layer-skip search") as scratch:
            table = seq.block_table[: start // bs] + scratch
            if first < start:  # committed K/V of the block's positions before the window, every layer and tier
                dev = self.view.kv_cache.pool.device
                src = torch.tensor([bm.blocks_at(seq.block_table, p) for p in range(first, start)], device=dev)
                dst = torch.tensor([bm.blocks_at(table, p) for p in range(first, start)], device=dev)
                self.view.kv_cache.copy_slots(src, dst)
            item = ForwardItem(table, start, seq.token_ids[start:end], list(range(end - start)))
            ids, pos, meta, _ = self.view.runner.prepare([item])
            target = self._full_pass(ids, pos, meta)
            scores = {}
            for skip in self.search.round_candidates():
                h = self._layers(ids, pos, meta, skip)
                drafted = self.model.compute_logits(h).float().argmax(dim=-1)
                scores[skip] = (int((drafted == target).sum()), int(target.numel()))
        if scores:
            self.search.record_round(scores, self.speed)
            self.prior_acceptance = self.search.acceptance()
        self.num_rounds += 1
        return True

    def _full_pass(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every layer over the window, one at a time: the target's next-token choices at its rows, and each
        layer's influence (``1 - cos`` of its input and output rows, summed) recorded in the search."""
        kv = self.view.kv_cache.layers
        h = self.model.embed(ids)
        turned: list[float] = []
        for i in range(self.num_layers):
            out = self.model(ids, pos, kv, meta, layers=range(i, i + 1), hidden=h, final_norm=False)
            turned.append(float((1.0 - torch.nn.functional.cosine_similarity(h.float(), out.float(), dim=-1)).sum()))
            h = out
        self.search.record_influence(turned, int(ids.numel()))
        return self.model.compute_logits(self.model.norm(h)).float().argmax(dim=-1)

    # --------------------------------------------------------------------------------------------- cost
    def calibrate_cost(self) -> None:
        """Time every layer and the LM head over 1, 2, 4, 8 rows (3 times each) on scratch blocks: a draft pass
        costs the layers' time times its kept share plus the head's."""
        self._layers_s = StepCostModel.calibrate(lambda n: self._timed_layers(n, 64), sizes=(1, 2, 4, 8), repeats=3)
        hidden = torch.zeros(8, self.model.config.hidden_size, dtype=self.view.dtype, device=self.view.device)
        self._head_s = StepCostModel.calibrate(lambda n: self.model.compute_logits(self.model.norm(hidden[:n])),
                                               sizes=(1, 2, 4, 8), repeats=3)

    @torch.inference_mode()
    def _timed_layers(self, n: int, ctx: int) -> None:
        bm = self.view.block_manager
        if bm.blocks_needed(ctx + n) > bm.num_free_blocks:
            return
        with bm.borrowed(ctx + n) as table:
            ids, pos, meta, _ = self.view.runner.prepare([ForwardItem(table, ctx, [0] * n, [])])
            self.model(ids, pos, self.view.kv_cache.layers, meta, final_norm=False)
        if self.view.device.type == "cuda":
            torch.cuda.synchronize(self.view.device)

    def _pass_seconds(self, rows: int, kept_share: float) -> float:
        if self._layers_s is None or self._head_s is None:
            return 0.0
        return self._layers_s(rows) * kept_share + self._head_s(rows)

    def step_cost(self, num_seqs: int, num_tokens: int) -> float:
        skip = self.search.best
        return 0.0 if skip is None else num_tokens * self._pass_seconds(num_seqs, self.search.kept_share(skip))

    def speed(self, kept_share: float, acceptance: float) -> float:
        """Tokens per second a set of this kept share and acceptance promises at batch 1, relative to plain
        decoding: the best chain length under the engine's step-cost model (once the speculator has handed it) and
        the measured pass cost. Without the step-cost model verified rows count as free; without the pass timings
        a plain step counts as one full pass and a draft pass as its kept share of one."""
        cost = self._cost
        full = self._pass_seconds(1, 1.0)
        one = cost(1) if cost is not None else (full if full > 0 else 1.0)
        draft = self._pass_seconds(1, kept_share) if full > 0 else kept_share * one
        best = 0.0
        for g in range(1, MAX_SPEED_GAMMA + 1):
            t = (cost(1 + g) if cost is not None else one) + g * draft
            best = max(best, expected_tokens(acceptance, g) * one / max(t, 1e-12))
        return best

    def explain(self) -> str:
        return self.search.describe(self.speed)


def _usable(cfg: SpeculativeConfig, target: LlamaForCausalLM | None) -> bool:
    """Under ``auto``: with the difficulty-driven compute path (which has a branch for it), or when named."""
    opts = cfg.options(AutoOptions)
    return target is not None and len(target.layers) > 2 and (
        opts.compute_path == "difficulty" or "layer_skip" in (opts.methods or ()))


METHOD = Method(
    name="layer_skip",
    options=(LayerSkipOptions,),
    shared=CHAIN_KEYS,
    build=lambda cfg, view, auto: LayerSkipProposer.from_config(cfg, view),
    auto=AutoUse("separate", rank=4, usable=_usable, self_draft=True),
)

__all__ = ["EVAL_EVERY", "METHOD", "LayerSkipOptions", "LayerSkipProposer", "kept_runs"]
