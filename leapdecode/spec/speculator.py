"""Glue between the engine and a drafter: how many drafts per sequence, proposing, verifying, bookkeeping."""

from __future__ import annotations

import time

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.model_runner import ForwardItem, ForwardResult
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.sampler import apply_repetition_penalty, processed_probs
from leapdecode.spec.dynamic_gamma import (
    DynamicGamma,
    GammaState,
    StepCostModel,
    expected_tokens,
)
from leapdecode.spec.proposer import Proposer
from leapdecode.spec.tree import (
    compaction_moves,
    depths_of,
    path_to,
    tree_attention_mask,
    verify_tree_greedy,
    verify_tree_sampling,
    verify_tree_typical,
)
from leapdecode.spec.verify import verify_greedy, verify_sampling

OVERHEAD_EMA = 0.2  # weight of the newest measurement in the speculation-overhead averages
AUTO_CANDIDATES = ("ngram", "draft_model", "self_spec", "eagle", "medusa")  # what ``auto`` may choose among


def make_proposer(cfg: SpeculativeConfig, engine, method: str | None = None) -> Proposer:
    method = method or cfg.method
    if method == "ngram":
        from leapdecode.spec.ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if method == "draft_model":
        from leapdecode.spec.draft_model import DraftModelProposer
        from leapdecode.spec.self_spec import SelfSpecProposer, is_adapter_folder

        if cfg.model is None or is_adapter_folder(cfg.model):  # a trained small draft (`leapdecode train draft`)
            return SelfSpecProposer.from_config(cfg, engine, kind="draft_model")
        return DraftModelProposer.from_path(cfg.model, engine, cfg.draft_linear_kernel)
    if method == "medusa":
        from leapdecode.spec.medusa import MedusaProposer

        return MedusaProposer.from_config(cfg, engine)
    if method == "blockwise":
        from leapdecode.spec.blockwise import BlockwiseProposer

        return BlockwiseProposer.from_config(cfg, engine)
    if method in ("self_spec", "eagle"):
        from leapdecode.spec.self_spec import SelfSpecProposer

        # under auto, "model" names the draft model, so self_spec and eagle use the shipped artefacts
        return SelfSpecProposer.from_config(cfg, engine, shipped_only=cfg.method == "auto", kind=method)
    if method == "hybrid":
        from leapdecode.spec.hybrid import HybridProposer

        return HybridProposer.from_config(cfg, engine)
    raise ValueError(f"unknown speculative method {method!r}")


def auto_methods(cfg: SpeculativeConfig, engine=None) -> list[str]:
    """What ``auto`` chooses among: every lossless drafter usable without further arguments (self_spec when the
    shipped exit adapter was trained for the engine's target), or only those of them that the config's
    ``"methods"`` list names (e.g. to measure what one drafter adds to ``auto``)."""
    wanted = (cfg.extra or {}).get("methods")
    if wanted is not None:
        if not isinstance(wanted, list) or not wanted or not set(wanted) <= set(AUTO_CANDIDATES):
            raise ValueError(f'auto\'s "methods" must be a non-empty list drawn from {list(AUTO_CANDIDATES)}, got '
                             f"{wanted!r}")
    methods = ["ngram"]
    from leapdecode.spec.self_spec import DRAFT_DIR, EAGLE_DIR, shipped_adapter_for

    if cfg.model or (engine is not None and shipped_adapter_for(engine.model, DRAFT_DIR) is not None):
        methods.append("draft_model")
    if engine is not None:
        if shipped_adapter_for(engine.model) is not None:
            methods.append("self_spec")
        if shipped_adapter_for(engine.model, EAGLE_DIR) is not None:
            methods.append("eagle")
        from leapdecode.spec.medusa import shipped_heads_for

        if shipped_heads_for(engine.model) is not None:
            methods.append("medusa")
    if wanted is not None:
        missing = [m for m in wanted if m not in methods]
        if missing:
            raise ValueError(f"auto cannot use {missing} here (no shipped drafter for this model, or no \"model\")")
        methods = [m for m in methods if m in wanted]
    return methods


class Speculator:
    """Owns one proposer per usable method (one, or several for ``auto``) and decides per sequence and per step
    which method drafts and how many tokens, from each method's measured acceptance on that sequence and the
    measured cost of target (and drafter) steps. Invariant: a sequence's drafts always come from one proposer
    per step, recorded in ``seq.spec_state["method"]``, and only that proposer is told the verification result.
    """

    def __init__(self, engine, cfg: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.engine = engine
        self.cfg = cfg
        names = auto_methods(cfg, engine) if cfg.method == "auto" else [cfg.method]
        if proposer is not None:
            self.proposers = {cfg.method: proposer}
        else:
            self.proposers = {name: make_proposer(cfg, engine, name) for name in names}
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
            self.cost = StepCostModel.calibrate(self._timed_target_step)
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
                detach = getattr(prop, "detach", None)
                if detach is not None:
                    detach()  # e.g. self_spec stops capturing the target's hidden states
        self.proposer = next(iter(self.proposers.values()))

    # -------------------------------------------------------------------------------------- calibration
    def _timed_target_step(self, n: int) -> None:
        self._timed_step(self.engine.runner, self.engine.block_manager, n)

    @staticmethod
    def _timed_step(runner, bm, n: int, ctx: int = 64) -> None:
        """One forward of n tokens after ``ctx`` cached ones on a scratch sequence (one block table borrowed from
        the pool, returned). The default is a short chat context: the regime where the step cost matters most."""
        if bm.blocks_needed(ctx + n) > bm.num_free_blocks:
            return
        with bm.borrowed(ctx + n) as table:
            runner.execute([ForwardItem(table, ctx, [0] * n, list(range(n)))])

    # -------------------------------------------------------------------------------------------- policy
    def state(self, seq: Sequence, method: str) -> GammaState:
        key = "gamma:" + method
        st = seq.spec_state.get(key)
        if st is None:
            st = seq.spec_state[key] = self.gamma.new_state()
            st.acceptance_ema = self.proposers[method].acceptance_prior()
        return st

    def budget_for(self, seq: Sequence) -> int:
        """Draft tokens this decoding sequence may verify this step (0 = plain decoding); picks the method."""
        seq.spec_state["method"] = None
        if not seq.params.speculative:
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.engine.max_model_len - seq.num_tokens - 1)
        if room <= 0:
            return 0
        batch = max(1, len(self.engine.scheduler.running))
        # every method must beat plain decoding's rate to be chosen
        best_name, best_k, best_rate = None, 0, (batch / self.cost(batch) if self.cost is not None else 0.0)
        for name, prop in self.proposers.items():
            tree = prop.tree_budget(seq, room, self.cost, batch)
            if tree is not None:  # tree drafters size their own proposals (Proposer.tree_budget)
                k, exp_tokens = tree
                if k <= 0:
                    continue
                if prop.fixed_budget:  # the method's own block size, not the cost model's call (Proposer)
                    best_name, best_k = name, k
                    break
                rate = exp_tokens if self.cost is None else \
                    (batch - 1 + exp_tokens) / (self.cost(batch + k) + prop.step_cost(batch, k)
                                                + self.overhead(name, prop, batch))
                if rate > best_rate:
                    best_name, best_k, best_rate = name, k, rate
                continue
            st = self.state(seq, name)
            k = min(st.gamma, room)
            if self.cost is None:
                rate = float(k)
            else:
                k = self.cost.best_gamma(st.acceptance_ema, k, batch, batch, lambda g, p=prop: p.step_cost(batch, g))
                if k == 0:
                    # drift back toward the prior while not drafting, so a sequence whose text turns
                    # repetitive (or copies from its input) gets to try again
                    st.acceptance_ema += 0.05 * (prop.acceptance_prior() - st.acceptance_ema)
                    continue
                t = self.cost(batch + k) + prop.step_cost(batch, k) + self.overhead(name, prop, batch)
                rate = (batch - 1 + expected_tokens(st.acceptance_ema, k)) / t
            if k > 0 and rate > best_rate:
                best_name, best_k, best_rate = name, k, rate
        seq.spec_state["method"] = best_name
        return best_k

    def overhead(self, name: str, prop: Proposer, batch: int) -> float:
        """Measured seconds a drafting sequence adds to a step beyond the target forward: verification, plus
        proposing where the drafter has no modelled step cost of its own (prompt lookup)."""
        own = prop.step_cost(batch, 1) > 0  # draft models, heads: already in the rate through step_cost
        return self.verify_s + (0.0 if own else self.propose_s.get(name, 0.0))

    @staticmethod
    def _ema(old: float, new: float) -> float:
        return new if old == 0.0 else old + OVERHEAD_EMA * (new - old)

    # ------------------------------------------------------------------------------------------- actions
    def propose(self, scheduled) -> None:
        by_method: dict[str, list] = {}
        for s in scheduled:
            by_method.setdefault(s.seq.spec_state.get("method") or "", []).append(s)
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
                seq.spec_state["tree_parents"] = list(prop.parents) if prop.parents and prop.tokens else None

    def shape_item(self, seq: Sequence, item: ForwardItem, num_prefix: int) -> None:
        """A candidate tree runs as ``num_prefix`` ordinary tokens (the last is the root) plus its nodes at
        RoPE positions by depth under the ancestor mask; chains keep the plain causal layout."""
        parents = seq.spec_state.get("tree_parents")
        if parents is None:
            return
        item.depths = list(range(num_prefix)) + [num_prefix - 1 + d for d in depths_of(parents)]
        item.tree_mask = tree_attention_mask(parents, num_prefix)

    def observe(self, seq: Sequence, res: ForwardResult) -> None:
        """Hand the drafters the hidden state behind the last emitted token (row recorded by ``verify``; the
        last row after plain sampling)."""
        row = seq.spec_state.pop("hidden_row", -1)
        if not seq.is_finished and res.hidden.numel():
            for prop in self.proposers.values():
                prop.observe(seq, res.hidden[row])

    def verify(self, seq: Sequence, res: ForwardResult) -> tuple[list[int], int]:
        """Emitted tokens and the number of drafts accepted, from the target logits at the k+1 positions."""
        t0 = time.perf_counter()
        out = self._verify(seq, res)
        self.verify_s = self._ema(self.verify_s, time.perf_counter() - t0)
        return out

    def _verify(self, seq: Sequence, res: ForwardResult) -> tuple[list[int], int]:
        parents = seq.spec_state.get("tree_parents")
        if parents is not None:
            return self._verify_tree(seq, res, parents)
        drafts = seq.draft_token_ids
        k = len(drafts)
        contexts = [seq.token_ids + drafts[:j] for j in range(k + 1)]
        logits = apply_repetition_penalty(res.logits, contexts, [seq.params.repetition_penalty] * (k + 1))
        name = seq.spec_state["method"]
        own = self.proposers[name].verify_chain(seq, logits, seq.generator or self.engine.generator)
        if own is not None:  # the drafter's own acceptance rule (blockwise: chain walk, opt-in top-k)
            tokens, accepted = own
        elif seq.params.greedy:
            tokens, accepted = verify_greedy(logits.argmax(dim=-1).tolist(), drafts)
        else:
            p = processed_probs(logits, [seq.params] * (k + 1))
            tokens, accepted = verify_sampling(p, drafts, seq.draft_probs, seq.generator or self.engine.generator)
        m = seq.metrics
        m.num_draft_tokens += k
        m.num_accepted_tokens += accepted
        self.gamma.update(self.state(seq, name), k, accepted)
        self.proposers[name].on_verified(seq, seq.num_tokens, accepted)
        seq.spec_state["hidden_row"] = accepted
        return tokens, accepted

    def _verify_tree(self, seq: Sequence, res: ForwardResult, parents: list[int]) -> tuple[list[int], int]:
        """Walk the tree (tree.py) and move the accepted nodes' K/V into the sequential slots of their
        positions; the engine then advances ``num_computed_tokens`` by the path length and trims the rest."""
        drafts = seq.draft_token_ids
        n = len(drafts)
        prop = self.proposers[seq.spec_state["method"]]
        pen = seq.params.repetition_penalty
        logits = res.logits
        if pen != 1.0:
            contexts = [seq.token_ids] + [seq.token_ids + [drafts[j] for j in path_to(i, parents)] for i in range(n)]
            logits = apply_repetition_penalty(logits, contexts, [pen] * (n + 1))
        if seq.params.greedy:
            tokens, path = verify_tree_greedy(logits.argmax(dim=-1).tolist(), drafts, parents)
        else:
            p = processed_probs(logits, [seq.params] * (n + 1))
            gen = seq.generator or self.engine.generator
            typical = getattr(prop, "typical", None)
            if typical is not None:  # lossy opt-in
                tokens, path = verify_tree_typical(p, drafts, parents, gen, *typical)
            else:
                tokens, path = verify_tree_sampling(p, drafts, parents, gen)
        moves = compaction_moves(path)
        if moves:
            base = seq.num_computed_tokens  # position of the first node's slot (right after the root)
            bm = self.engine.block_manager
            dev = self.engine.kv_cache.pool.device
            src = torch.tensor([bm.slot(seq, base + a) for a, _ in moves], dtype=torch.long, device=dev)
            dst = torch.tensor([bm.slot(seq, base + b) for _, b in moves], dtype=torch.long, device=dev)
            self.engine.runner.copy_slots(src, dst)  # every tier, int8 scales, and captured hidden states
        accepted = len(path)
        m = seq.metrics
        m.num_draft_tokens += n
        m.num_accepted_tokens += accepted
        seq.spec_state["accepted_path"] = path  # which nodes: a hybrid tells its trunk drafter how much was its own
        prop.on_verified(seq, seq.num_tokens, accepted)
        seq.spec_state["hidden_row"] = path[-1] + 1 if path else 0
        return tokens, accepted

    def release(self, seq: Sequence) -> None:
        for prop in self.proposers.values():
            prop.release(seq)


__all__ = ["Speculator", "make_proposer"]
