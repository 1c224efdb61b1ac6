"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the sequence's last n tokens and
propose the tokens that followed it. Free to run, and strong when the output copies from the input
(summaries, answers grounded in a passage, code edits).

Each sequence keeps an incremental index ``n-gram -> position after its latest occurrence`` for every n in
[min_n, max_n], updated only for newly appended tokens, so a step costs O(max_n) dictionary work whatever the
prompt length (a rescan of a 6k-token prompt every step would cost more than the step saves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.sequence import Sequence
from leapdecode.speculative.method import AutoUse, Method
from leapdecode.speculative.options import CHAIN_KEYS, LOOKUP_KEYS
from leapdecode.speculative.proposer import Proposal, Proposer


@dataclass
class NgramIndex:
    """One sequence's index: n-gram -> position after its latest occurrence, for n-grams ending before ``done``."""

    positions: dict[tuple[int, ...], int] = field(default_factory=dict)
    done: int = 0


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}  # request id -> its index

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig) -> NgramProposer:
        return cls(cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def _index(self, seq: Sequence) -> dict[tuple[int, ...], int]:
        state = self.indexes.setdefault(seq.request_id, NgramIndex())
        index = state.positions
        done = state.done  # n-grams ending before position `done` are indexed
        toks = seq.token_ids
        # index n-grams that end at positions < len-1: the suffix itself must not match itself
        for end in range(max(done, 1), len(toks)):
            for n in range(self.min_n, self.max_n + 1):
                if end - n < 0:
                    break
                index[tuple(toks[end - n : end])] = end
        state.done = len(toks)
        return index

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        index = self._index(seq)
        toks = seq.token_ids
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            # the suffix's own occurrence was indexed at end == len(toks) only if it occurred earlier too
            pos = index.get(tuple(toks[len(toks) - n :]))
            if pos is not None and pos < len(toks):
                return toks[pos : pos + k]
        return []

    def has_draft(self, seq: Sequence) -> bool:
        """A match for the sequence's suffix: without one there is nothing to propose."""
        return bool(self.lookup(seq, 1))

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        return [self.peek(s, k) for s, k in zip(seqs, budgets)]

    def peek(self, seq: Sequence, budget: int) -> Proposal:
        return Proposal(self.lookup(seq, budget) if budget > 0 else [])

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.request_id, None)


METHOD = Method(
    name="ngram",
    options=(),
    shared=LOOKUP_KEYS | CHAIN_KEYS,
    build=lambda cfg, view, auto: NgramProposer.from_config(cfg),
    auto=AutoUse("separate", rank=1, usable=lambda cfg, target: True, tracks_copying=True),
)

__all__ = ["METHOD", "NgramIndex", "NgramProposer"]
