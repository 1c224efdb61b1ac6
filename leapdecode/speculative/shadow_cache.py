"""The shared base of drafters that keep a paged KV cache of their own beside the target's.

A draft model, an exit adapter or EAGLE's feature draft each run layers of their own over every sequence, so they
need K/V for those layers: their own ``BlockManager`` over their own pool, and per target sequence a ``Shadow``
(a block table and how many leading positions it holds). The invariant all of them keep: after verification a
shadow never claims more than the committed prefix (``on_verified`` trims it), and ``release`` frees it, so a
rejected draft never leaves K/V behind that a later step would read.

Drafting loops draw sampled tokens through :func:`draw_draft`, one rule for every drafter: greedy requests (and
``argmax_drafts`` drafters) take the argmax; sampled ones draw from the request's processed distribution with its
own generator, or the engine's for an unseeded request, and keep the distribution for rejection sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.sampler import processed_probs, sample_from
from leapdecode.speculative.policy import StepCostModel
from leapdecode.speculative.proposer import Proposal, Proposer


@dataclass
class Shadow:
    """A drafter's view of one target sequence in its own cache; duck-types the parts of Sequence that
    BlockManager uses."""

    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


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


class ShadowCacheProposer(Proposer):
    """A drafter with its own paged KV cache that mirrors each target sequence with a ``Shadow``. Subclasses set
    ``shadows`` and ``shadow_bm``, and time their own draft steps (``timed_draft_step``) for the cost model."""

    shadows: dict[str, Shadow]
    shadow_bm: BlockManager
    #: draft each sequence's argmax even when it samples: a tree verifier (hybrid) needs candidates, not draws,
    #: and drafting then consumes nothing of the sequence's random stream (seeded output stays reproducible)
    argmax_drafts: bool = False
    #: seconds per draft step by rows in it, measured by ``calibrate_cost`` (None: not calibrated, costs 0)
    step_cost_fn: Callable[[int], float] | None = None

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


__all__ = ["Shadow", "ShadowCacheProposer", "attach_probs", "draw_draft"]
