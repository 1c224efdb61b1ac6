"""A separate, smaller draft model with the target's tokenizer, run through its own paged KV cache.

The draft may run at a lower precision than the target (``draft_linear_kernel``, e.g. int8 activations): the
target still verifies every token, so the output stays the target's (mixed precision by phase, brief §6).

The draft keeps a shadow of every target sequence: its own block table and how many leading tokens it has K/V
for. Each step it first *catches up* (feeds the committed tokens it has not seen, usually the bonus token plus the
last accepted draft, or a whole prompt for a new sequence) and then drafts autoregressively, all sequences of the
batch in one forward per draft position. After verification it rolls its shadow back to the committed prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ModelRunner
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.sampler import processed_probs, sample_from
from leapdecode.spec.proposer import Proposal, Proposer


@dataclass
class _Shadow:
    """Duck-types the parts of Sequence that BlockManager uses."""

    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class ShadowCacheProposer(Proposer):
    """A drafter with its own paged KV cache that mirrors each target sequence with a ``_Shadow`` (block table
    + how many leading positions it holds K/V for). Invariant: after verification the shadow never claims more
    than the committed prefix; ``release`` returns its blocks. Subclasses set ``shadows`` and ``shadow_bm``,
    and time their own draft steps (``_timed_draft_step``) for the cost model."""

    shadows: dict[str, _Shadow]
    shadow_bm: BlockManager
    #: draft each sequence's argmax even when it samples: a tree verifier (hybrid) needs candidates, not draws,
    #: and drafting then consumes nothing of the sequence's random stream (seeded output stays reproducible)
    argmax_drafts: bool = False
    #: seconds per draft step by rows in it, measured by ``calibrate_cost`` (None: not calibrated, costs 0)
    step_cost_fn: Callable[[int], float] | None = None

    def _timed_draft_step(self, n: int) -> None:
        """Run one draft step of ``n`` rows at a short context (what ``calibrate_cost`` times)."""
        raise NotImplementedError

    def calibrate_cost(self) -> None:
        """Time draft steps of 1, 2, 4, 8 rows (``_timed_draft_step``), 3 times each."""
        from leapdecode.spec.dynamic_gamma import StepCostModel

        self.step_cost_fn = StepCostModel.calibrate(self._timed_draft_step, sizes=(1, 2, 4, 8), repeats=3)

    def step_cost(self, num_seqs: int, num_tokens: int) -> float:
        if self.step_cost_fn is None:
            return 0.0
        return num_tokens * self.step_cost_fn(num_seqs)

    def on_verified(self, seq: Sequence, num_prefix_tokens: int, num_accepted: int) -> None:
        sh = self.shadows.get(seq.request_id)
        if sh is None:
            return
        sh.num_computed_tokens = min(sh.num_computed_tokens, num_prefix_tokens + num_accepted)
        self.shadow_bm.trim(sh, sh.num_computed_tokens)  # type: ignore[arg-type]

    def release(self, seq: Sequence) -> None:
        sh = self.shadows.pop(seq.request_id, None)
        if sh is not None:
            self.shadow_bm.free(sh)  # type: ignore[arg-type]


def check_same_tokenizer(target_tok, draft_tok) -> None:
    if target_tok is None or draft_tok is None:
        return
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    shared = [t for t in tv if t in dv]
    mismatched = sum(tv[t] != dv[t] for t in shared)
    if len(shared) < 0.99 * len(tv) or mismatched:
        raise ValueError(
            "the draft model's tokenizer differs from the target's "
            f"({len(tv) - len(shared)} target tokens missing, {mismatched} with other ids); "
            "speculative decoding needs a draft with the same tokenizer"
        )


class DraftModelProposer(ShadowCacheProposer):
    name = "draft_model"

    def __init__(self, model, tokenizer, target_vocab: int, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, max_model_len: int) -> None:
        self.model = model
        self.target_vocab = target_vocab
        self.max_model_len = max_model_len
        self.kv = KVCache(model.config, num_blocks, block_size, dtype, device)
        self.bm = self.shadow_bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv, block_size, device)
        self.shadows: dict[str, _Shadow] = {}

    @classmethod
    def from_path(cls, path: str, engine, linear_kernel: str | None = None) -> DraftModelProposer:
        """Load the draft from ``path`` (``"target"``: the target's own checkpoint, loaded a second time, which
        with ``linear_kernel="packed-int8act"`` is a low-precision copy of the target as its drafter)."""
        from leapdecode.models.loader import load_model, load_tokenizer, resolve_model

        p = engine.model_path if path == "target" else resolve_model(path)
        model, _ = load_model(p, engine.config.torch_dtype, engine.device)
        engine.pack_linears(model, linear_kernel)
        check_same_tokenizer(engine.tokenizer, load_tokenizer(p) if engine.tokenizer is not None else None)
        return cls(model, None, engine.model_config.vocab_size, engine.block_manager.num_blocks,
                   engine.config.block_size, engine.device, engine.config.torch_dtype, engine.max_model_len)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v = self.target_vocab
        if logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:  # padded draft vocabulary
            return logits[..., :v]
        pad = logits.new_full((*logits.shape[:-1], v - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in seqs]
        active: list[int] = []
        items: list[ForwardItem] = []
        for i, (seq, k) in enumerate(zip(seqs, budgets)):
            if k <= 0:
                continue
            sh = self.shadows.setdefault(seq.request_id, _Shadow())
            start = sh.num_computed_tokens
            k = min(k, self.max_model_len - seq.num_tokens)
            if k <= 0 or not self.bm.can_allocate(sh, seq.num_tokens + k - 1):
                continue
            self.bm.allocate(sh, seq.num_tokens + k - 1)
            new = seq.token_ids[start:]
            items.append(ForwardItem(sh.block_table, start, new, [len(new) - 1]))
            active.append(i)
            budgets[i] = k
        probs_rows: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        step = 0
        while active:
            results = self.runner.execute(items)
            next_active, next_items = [], []
            for i, it, res in zip(active, items, results):
                seq, sh = seqs[i], self.shadows[seqs[i].request_id]
                sh.num_computed_tokens = it.start + len(it.tokens)
                logits = self._fit_vocab(res.logits[-1:])
                if seq.params.greedy or self.argmax_drafts:
                    tok = int(logits.argmax(dim=-1))
                else:
                    q = processed_probs(logits, [seq.params])[0]
                    tok = sample_from(q, seq.generator)
                    probs_rows[i].append(q)
                props[i].tokens.append(tok)
                if len(props[i].tokens) < budgets[i]:
                    next_active.append(i)
                    next_items.append(ForwardItem(sh.block_table, sh.num_computed_tokens, [tok], [0]))
            active, items = next_active, next_items
            step += 1
        for i, rows in probs_rows.items():
            if rows:
                props[i].probs = torch.stack(rows)
        return props

    def _timed_draft_step(self, n: int) -> None:
        """One draft forward of ``n`` rows at a short context on borrowed blocks."""
        from leapdecode.spec.speculator import Speculator

        Speculator._timed_step(self.runner, self.bm, n)
