"""Glue between the engine and a drafter: how many drafts per sequence, proposing, verifying, bookkeeping."""

from __future__ import annotations


from leapdecode.config import SpeculativeConfig
from leapdecode.engine.model_runner import ForwardItem, ForwardResult
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.sampler import apply_repetition_penalty, processed_probs
from leapdecode.spec.dynamic_gamma import PRIOR_ACCEPTANCE, DynamicGamma, GammaState, StepCostModel
from leapdecode.spec.proposer import Proposer
from leapdecode.spec.verify import verify_greedy, verify_sampling


def make_proposer(cfg: SpeculativeConfig, engine) -> Proposer:
    if cfg.method == "ngram":
        from leapdecode.spec.ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "draft_model":
        from leapdecode.spec.draft_model import DraftModelProposer

        return DraftModelProposer.from_path(cfg.model, engine)  # type: ignore[arg-type]
    raise ValueError(
        f"speculative method {cfg.method!r} is not available in this build yet; available: ngram, draft_model"
    )


class Speculator:
    def __init__(self, engine, cfg: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.proposer = proposer or make_proposer(cfg, engine)
        self.gamma = DynamicGamma(cfg)
        self.cost: StepCostModel | None = None
        if cfg.use_cost_model:
            self.cost = StepCostModel.calibrate(self._timed_target_step)
            draft_runner = getattr(self.proposer, "runner", None)
            if draft_runner is not None:
                draft_cost = StepCostModel.calibrate(
                    lambda n: self._timed_step(draft_runner, n), sizes=(1, 2, 4, 8), repeats=3
                )
                self.proposer.step_cost_fn = draft_cost  # type: ignore[attr-defined]

    # -------------------------------------------------------------------------------------- calibration
    def _timed_target_step(self, n: int) -> None:
        self._timed_step(self.engine.runner, n)

    def _timed_step(self, runner, n: int) -> None:
        """One forward of n tokens on a scratch sequence (one block table borrowed from the pool, returned)."""
        bm = self.engine.block_manager if runner is self.engine.runner else self.proposer.bm  # type: ignore[attr-defined]
        ctx = 64  # a short chat context: the regime where the step cost matters most
        from leapdecode.spec.draft_model import _Shadow

        sh = _Shadow()
        if not bm.can_allocate(sh, ctx + n):
            return
        bm.allocate(sh, ctx + n)
        try:
            runner.execute([ForwardItem(sh.block_table, ctx, [0] * n, list(range(n)))])
        finally:
            bm.free(sh)

    # -------------------------------------------------------------------------------------------- policy
    def state(self, seq: Sequence) -> GammaState:
        st = seq.spec_state.get("gamma")
        if st is None:
            st = seq.spec_state["gamma"] = self.gamma.new_state()
        return st

    def budget_for(self, seq: Sequence) -> int:
        """Draft tokens this decoding sequence may verify this step (0 = plain decoding)."""
        if not seq.params.speculative:
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.engine.max_model_len - seq.num_tokens - 1)
        st = self.state(seq)
        k = min(st.gamma, room)
        if k <= 0:
            return 0
        if self.cost is not None:
            batch = max(1, len(self.engine.scheduler.running))
            k = self.cost.best_gamma(
                st.acceptance_ema, k, batch, batch, lambda g: self.proposer.step_cost(batch, g)
            )
            if k == 0:
                # drift back toward the prior while not drafting, so a sequence whose text turns
                # repetitive (or copies from its input) gets to try again
                st.acceptance_ema += 0.05 * (PRIOR_ACCEPTANCE - st.acceptance_ema)
        return k

    # ------------------------------------------------------------------------------------------- actions
    def propose(self, scheduled) -> None:
        seqs = [s.seq for s in scheduled]
        props = self.proposer.propose(seqs, [s.spec_budget for s in scheduled])
        for seq, prop in zip(seqs, props):
            seq.draft_token_ids = list(prop.tokens)
            seq.draft_probs = prop.probs

    def verify(self, seq: Sequence, res: ForwardResult) -> tuple[list[int], int]:
        """Emitted tokens and the number of drafts accepted, from the target logits at the k+1 positions."""
        drafts = seq.draft_token_ids
        k = len(drafts)
        contexts = [seq.token_ids + drafts[:j] for j in range(k + 1)]
        logits = apply_repetition_penalty(res.logits, contexts, [seq.params.repetition_penalty] * (k + 1))
        if seq.params.greedy:
            tokens, accepted = verify_greedy(logits.argmax(dim=-1).tolist(), drafts)
        else:
            p = processed_probs(logits, [seq.params] * (k + 1))
            tokens, accepted = verify_sampling(p, drafts, seq.draft_probs, seq.generator or self.engine.generator)
        m = seq.metrics
        m.num_draft_tokens += k
        m.num_accepted_tokens += accepted
        self.gamma.update(self.state(seq), k, accepted)
        self.proposer.on_verified(seq, seq.num_tokens, accepted)
        return tokens, accepted

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)


__all__ = ["Speculator", "make_proposer"]
