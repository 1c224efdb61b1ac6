"""A feature-conditioned draft (EAGLE-style): one small decoder stack that reads the target's own last features.

A plain small draft sees only tokens, so it has to re-derive from scratch what the target "had in mind". This
drafter reads, at each position p, the target's final normed hidden state one position back together with the
token actually chosen there, ``fc([f_{p-1}, embed(x_p)])``, and is trained (``leapdecode train draft --features``)
to output the target's next feature f_p, which the target's own LM head turns into the draft's next token::

    committed (target features)                 drafting (the draft's own features)
    x_{n-2}   x_{n-1}                           d_1            d_2
      |         |                                |              |
    f_{n-3} -> [fc+layers] -> f^_{n-2}  ...    f^_{n-1} -> [fc+layers] -> f^_n -> LM head -> d_2 ...
    (f from the target's verification pass, tagged by KV slot)

- **Features of committed tokens** come from the target's passes: the runner hands the residual stream after its
  last layer to :meth:`FeatureDraftProposer._capture` (``ModelRunner.add_capture`` at L = num_layers), which
  applies the target's final norm and files it by KV slot with the (position, token) it belongs to, exactly as
  self-speculation files h_L. Nothing of the target is ever recomputed for the draft, except the fallback below.
- **The draft's K/V** lives in its own paged cache (``adapter_bm``). After verification it is rolled back to
  the positions drafted from *target* features (the prefix before drafting), not to the accepted drafts: those
  were computed from the draft's own features, and the next step recomputes them from the target's (one
  cheap pass of the draft's layers over the accepted tokens) so the draft always conditions on the truth.
- **Fallback:** a committed position whose stored feature does not carry the expected tag gets its feature from
  a full target pass over those positions that writes its K/V to a scratch slot, never over committed K/V. (Tree
  compaction does not cause it: the stored features follow the K/V, ``ModelRunner.copy_slots``.)

It shares everything else with self-speculation (SelfSpecProposer): artefact format and loading, the stop
threshold ``min_draft_prob``, the vocabulary-subset head, shadow caches, cost calibration. The draft is an
``ExitAdapter`` with ``feature_input`` (L = 0), so ``{"method": "draft_model"}`` runs whichever kind the
artefact holds.
"""

from __future__ import annotations

import torch

from leapdecode.engine.model_runner import ForwardItem
from leapdecode.engine.sequence import Sequence
from leapdecode.spec.proposer import Proposal
from leapdecode.spec.self_spec import SelfSpecProposer, _with_probs


class FeatureDraftProposer(SelfSpecProposer):
    """Drafts with a feature-conditioned ExitAdapter over the target's captured top-layer features (module
    docstring). Invariant: after ``on_verified`` the draft's cache holds only positions whose input feature was
    the target's."""

    name = "eagle"

    def capture_layer(self) -> int:
        return self.model.config.num_hidden_layers

    def _capture(self, h: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """After the target's last layer: keep its normed features (what its LM head reads) by slot, tagged."""
        super()._capture(self.model.norm(h), input_ids, positions, slot_mapping)

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

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in seqs]
        plans = self._plan(seqs, budgets)
        if not plans:
            return props
        probs_rows: dict[int, list[torch.Tensor]] = {p.index: [] for p in plans}
        # step 0: every position from the draft's cache end through the last committed token, on target features
        items = []
        for p in plans:
            a, m = p.shadow.num_computed_tokens, p.catchup.shape[0]
            self.num_catchup_tokens += m - 1
            items.append(ForwardItem(p.shadow.block_table, a, [0] * m, [m - 1]))
        h_in = torch.cat([self._fused(p.catchup, p.seq.token_ids[p.shadow.num_computed_tokens :]) for p in plans])
        active = plans
        while active:
            feats = self._adapter_pass(items, h_in)  # f^ at each sequence's newest position
            keep, toks = self._draft_step(active, items, self._logits(feats), props, probs_rows)
            active = [active[j] for j in keep]
            if active:  # each chain's next input: its own feature and the token it just drafted
                items = [ForwardItem(p.shadow.block_table, p.shadow.num_computed_tokens, [0], [0]) for p in active]
                h_in = self._fused(feats[keep], toks)
        return _with_probs(props, probs_rows)

    def on_verified(self, seq: Sequence, num_prefix_tokens: int, num_accepted: int) -> None:
        """Keep only positions drafted from target features: accepted drafts are recomputed from the target's."""
        super().on_verified(seq, num_prefix_tokens, 0)

    @torch.inference_mode()
    def _timed_draft_step(self, n: int) -> None:
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
                torch.softmax(self._logits(out), dim=-1).max(dim=-1)
        finally:
            self.num_adapter_tokens = count
