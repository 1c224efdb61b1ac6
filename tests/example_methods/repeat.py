"""An example speculative method in one file, as a new method under ``leapdecode/speculative/methods/`` would be:
its typed options, its proposer and its descriptor. It drafts the last committed token again, up to
``max_repeat`` times (right where text repeats a token, as in "...", "000" or runs of spaces); the target's
verification keeps the output identical to plain decoding whatever it proposes.

``tests/test_example_method.py`` puts this folder on the methods package's search path and runs it through
``LLM(...)``; nothing else in the package names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leapdecode.engine.sequence import Sequence
from leapdecode.speculative.method import Method
from leapdecode.speculative.options import CHAIN_KEYS, check, is_int
from leapdecode.speculative.proposer import Proposal, Proposer, Verification


@dataclass(frozen=True)
class RepeatOptions:
    """``max_repeat``: the most copies of the last token one step drafts."""

    max_repeat: int = 2

    def __post_init__(self) -> None:
        check(is_int(self.max_repeat, 1), f"max_repeat must be an integer >= 1, got {self.max_repeat!r}")


@dataclass
class RepeatStats:
    """What the proposer keeps per request: verifications seen, drafts accepted, target rows scored."""

    verified: int = 0
    accepted: int = 0
    rows: int = 0
    committed: list[int] = field(default_factory=list)


class RepeatProposer(Proposer):
    name = "repeat"

    def __init__(self, max_repeat: int) -> None:
        self.max_repeat = max_repeat
        self.stats: dict[str, RepeatStats] = {}  # request id -> its record, dropped by release
        self.released: list[str] = []
        self.verified: list[tuple[int, int, int]] = []  # (target rows scored, drafts, tokens committed) per step

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        return [Proposal([s.token_ids[-1]] * min(k, self.max_repeat)) for s, k in zip(seqs, budgets)]

    def on_verified(self, seq: Sequence, result: Verification) -> None:
        st = self.stats.setdefault(seq.request_id, RepeatStats())
        st.verified += 1
        st.accepted += result.num_accepted
        st.rows += int(result.logits.shape[0])
        st.committed += result.committed
        self.verified.append((int(result.logits.shape[0]), len(result.drafts), len(result.committed)))

    def release(self, seq: Sequence) -> None:
        if self.stats.pop(seq.request_id, None) is not None:
            self.released.append(seq.request_id)


METHOD = Method(
    name="repeat",
    options=(RepeatOptions,),
    shared=CHAIN_KEYS,
    build=lambda cfg, view, auto: RepeatProposer(cfg.options(RepeatOptions).max_repeat),
)

__all__ = ["METHOD", "RepeatOptions", "RepeatProposer"]
