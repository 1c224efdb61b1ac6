"""The drafter interface: every speculative method proposes tokens that the target then verifies in one pass."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from leapdecode.engine.sequence import Sequence
from leapdecode.spec.dynamic_gamma import PRIOR_ACCEPTANCE


@dataclass
class Proposal:
    """Draft tokens for one sequence.

    A chain is ``tokens`` alone. A candidate tree (Medusa, hybrid) adds ``parents``: node i's parent index in
    ``tokens`` (-1 = child of the last committed token), with nodes in topological order; the target verifies
    all nodes in one pass under a tree attention mask. ``probs`` ([len(tokens), vocab]) is the distribution the
    drafter sampled each token from, needed for lossless rejection sampling at temperature > 0; ``None`` means
    the drafter is deterministic (a point mass on each token).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None


class Proposer(ABC):
    """Invariants: ``propose`` returns one Proposal per input sequence with ``len(tokens) <= budgets[i]``
    (a shorter or empty proposal is always allowed); it never mutates ``seq.token_ids``. After the target has
    verified, ``on_verified(seq, num_prefix_tokens, num_accepted)`` says that the first ``num_prefix_tokens``
    tokens (the sequence before drafting) plus ``num_accepted`` draft tokens are now committed, so a drafter
    with its own cache can roll back the rest. ``release(seq)`` frees whatever the drafter holds for ``seq``.
    """

    name: str = "proposer"
    #: True: draft exactly what ``tree_budget`` asks every step, never switched off by the engine's step-cost
    #: model (blockwise decoding: the block size is the method, and a lossy mode's output must not depend on
    #: how fast this machine happened to be when the cost model was calibrated)
    fixed_budget: bool = False
    #: per-token acceptance measured for this drafter on held-out data (a trained artefact's validation), or None;
    #: the speculator starts each sequence's estimate there instead of an optimistic default, and ``auto`` drops
    #: a drafter whose measured acceptance cannot pay for its step cost on this machine
    prior_acceptance: float | None = None

    def acceptance_prior(self) -> float:
        """Where a sequence's acceptance estimate for this drafter starts, and drifts back to while not drafting:
        its measured ``prior_acceptance``, else the optimistic default."""
        return PRIOR_ACCEPTANCE if self.prior_acceptance is None else self.prior_acceptance

    @abstractmethod
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]: ...

    def on_verified(self, seq: Sequence, num_prefix_tokens: int, num_accepted: int) -> None:  # noqa: B027
        """Default: stateless drafters keep nothing."""

    def release(self, seq: Sequence) -> None:  # noqa: B027
        """Default: nothing to free."""

    def calibrate_cost(self) -> None:  # noqa: B027
        """Time this drafter's own steps for ``step_cost`` (called by the speculator when it uses the cost model).
        Default: nothing to time (lookup methods; heads measure themselves on first use)."""

    def step_cost(self, num_seqs: int, num_tokens: int) -> float:
        """Seconds the drafter spends to propose ``num_tokens`` per sequence (0 for lookup methods)."""
        return 0.0

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:  # noqa: B027
        """Called after each step that emitted tokens for ``seq`` (and is not finished) with the target's final
        hidden state at the position whose logits produced the last emitted token. Default: ignored; drafters
        that read the target's hidden state (Medusa heads) keep it for the next ``propose``."""

    def verify_chain(
        self, seq: Sequence, logits: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[list[int], int] | None:
        """A drafter with its own acceptance rule verifies its chain here: ``logits`` [len(drafts) + 1, vocab]
        are the target's (repetition penalty applied) at the drafts' positions; returns (emitted tokens, drafts
        accepted). Default ``None``: the engine's lossless verification (greedy match / rejection sampling)."""
        return None

    def tree_budget(self, seq: Sequence, room: int, cost, batch: int) -> tuple[int, float] | None:
        """Tree drafters size their own proposals (a tree's acceptance is not the chain model's per-token rate):
        return ``(nodes, expected tokens per step)`` for ``seq`` this step, at most ``room`` nodes, given the
        engine's step-cost model ``cost`` (may be None) and the number of running sequences. ``None`` (chain
        drafters) means "use dynamic gamma"."""
        return None
