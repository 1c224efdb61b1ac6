"""The drafter protocol: every speculative method proposes tokens that the target then verifies in one pass.

One step, as the speculator drives it (speculator.py), for the sequences the scheduler decided to run:

1. **Size.** For each decoding sequence the speculator asks every candidate drafter whether it has anything to
   propose (``has_draft``) and how much: a chain drafter is sized by the speculator's dynamic draft length and the
   engine's step-cost model; a drafter that sizes itself returns ``(nodes, expected tokens per step)`` from
   ``tree_budget(seq, room, cost, batch)``, where ``cost`` is that step-cost model (``StepCost``: seconds of a
   target step of n rows, and its ``best_gamma`` rule), so a tree drafter can choose the node count whose
   expected tokens per second beat plain decoding. The fastest drafter drafts, within ``room``.
2. **Propose.** ``propose(seqs, budgets)`` returns one ``Proposal`` per sequence as a value: a chain
   (``tokens``), or a token tree (``tokens`` plus ``parents``: node i's parent index, -1 for a child of the last
   committed token, parents before children), with the draft distributions (``probs``) for lossless rejection
   sampling when the drafter sampled. A drafter never changes the sequence.
3. **Verify.** The target scores every node in one pass (a tree under its ancestor mask); the engine's lossless
   rule (greedy match, rejection sampling, the tree walk) or the drafter's own (``verify_chain``,
   ``tree_acceptance``) decides what is accepted.
4. **Observe.** The drafter that drafted gets the result as a value: ``on_verified(seq, Verification)`` with the
   committed length before the step, the drafts and their parents, the accepted nodes, the tokens committed this
   step and the target's logits (the request's processors applied) at every verified row, accepted or not: row 0
   scored the first draft position, row i + 1 the children of node i. A drafter that declares ``observes = True``
   is also called after *every* step that committed tokens to a running sequence, whoever drafted or none:
   ``observe(seq, hidden)``, with the target's final hidden state at the row that produced the last committed
   token; ``seq.token_ids`` then ends with the tokens this step committed (what an index of the text appends).
   One that declares ``observes_rows = True`` gets the target's raw logits at every verified row of every
   sequence, whoever drafted, and at the row of every plain step: ``observe_rows(tokens, logits)`` (a plain step's
   rows of every sequence in one call).

Per-request state (indexes, caches, estimates) lives in the proposer, keyed by ``seq.request_id``, and is freed
by ``release(seq)``, which the speculator calls when the request finishes, is aborted or is preempted (a preempted
sequence rebuilds its state on its next draft). Nothing a method keeps rides on ``Sequence``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from leapdecode.engine.drafting import EngineView
from leapdecode.engine.sequence import Sequence
from leapdecode.speculative.state import PRIOR_ACCEPTANCE


@dataclass(frozen=True)
class Verification:
    """One sequence's verification result, for the drafter that drafted it (module docstring, step 4).

    ``num_prefix_tokens``: the sequence's length before this step's tokens were committed; ``drafts`` and
    ``parents`` (None: a chain) as proposed; ``accepted``: the accepted node indices along the path (a chain:
    0 .. n-1); ``committed``: the tokens committed this step (the accepted drafts, then the target's own next
    token); ``logits``: the target's logits [len(drafts) + 1, vocab] with the request's processors applied, at
    every verified row."""

    num_prefix_tokens: int
    drafts: list[int]
    parents: list[int] | None
    accepted: list[int]
    committed: list[int]
    logits: torch.Tensor

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


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


def tree_proposal(tokens: list[int], parents: list[int]) -> Proposal:
    """A deterministic tree of these nodes, or no draft when there are none."""
    return Proposal(tokens, None, parents) if tokens else Proposal([])


class StepCost(Protocol):
    """The engine's step-cost model (policy.StepCostModel) as drafters use it."""

    def __call__(self, n: int) -> float: ...

    def best_gamma(self, alpha: float, max_gamma: int, batch_tokens: int, batch_size: int,
                   draft_cost: Callable[[int], float] = ..., rows: Callable[[int], int] = ...,
                   expected: Callable[[float, int], float] = ...) -> int: ...


class Proposer(ABC):
    """Invariants: ``propose`` returns one Proposal per input sequence with ``len(tokens) <= budgets[i]``
    (a shorter or empty proposal is always allowed); it never mutates the sequence. After the target has
    verified, ``on_verified`` says what was committed (the first ``num_prefix_tokens + num_accepted`` tokens), so
    a drafter with its own cache can roll back the rest. ``release(seq)`` frees whatever the drafter holds for
    ``seq``. The optional capabilities are declared (``observes``, ``fixed_budget``) or are hooks whose default
    means "not used" (``tree_budget``, ``verify_chain``, ``tree_acceptance``).
    """

    name: str = "proposer"
    #: True: ``observe`` is called after every step that committed tokens to a running sequence (module docstring)
    observes: bool = False
    #: True: ``observe_rows`` is called with the target's logits at every row a step verified (whoever drafted) and
    #: at the last row of every plain decoding step
    observes_rows: bool = False
    #: True: draft exactly what ``tree_budget`` asks every step, never switched off by the engine's step-cost
    #: model (blockwise decoding's lossy top-k mode: its output must not depend on how fast this machine happened
    #: to be when the cost model was calibrated)
    fixed_budget: bool = False
    #: per-token acceptance measured for this drafter on held-out data (a trained artifact's validation), or None;
    #: the speculator starts each sequence's estimate there instead of an optimistic default, and ``auto`` drops
    #: a drafter whose measured acceptance cannot pay for its step cost on this machine
    prior_acceptance: float | None = None

    def acceptance_prior(self) -> float:
        """Where a sequence's acceptance estimate for this drafter starts, and drifts back to while not drafting:
        its measured ``prior_acceptance``, else the optimistic default."""
        return PRIOR_ACCEPTANCE if self.prior_acceptance is None else self.prior_acceptance

    @abstractmethod
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]: ...

    def on_verified(self, seq: Sequence, result: Verification) -> None:  # noqa: B027
        """What the target accepted of this drafter's proposal for ``seq``. Default: stateless drafters keep nothing."""

    def release(self, seq: Sequence) -> None:  # noqa: B027
        """Free what the drafter keeps for ``seq`` (finished, aborted or preempted). Default: nothing to free."""

    def has_draft(self, seq: Sequence) -> bool:
        """Whether the drafter has anything to propose for ``seq`` this step. A drafter without a proposal is left
        out of the step's choice (it costs nothing and says nothing about its acceptance). Default: always."""
        return True

    def peek(self, seq: Sequence, budget: int) -> Proposal | None:
        """The proposal ``propose`` would make for ``seq`` with ``budget`` this step, with no side effect on the
        drafter (nothing is verified: when another drafter drafts, the speculator scores this one against the
        tokens the target goes on to commit, counterfactual.py). Default ``None``: the drafter cannot say without
        drafting (a draft model runs), and learns only from its own verifications."""
        return None

    def calibrate_cost(self) -> None:  # noqa: B027
        """Time this drafter's own steps for ``step_cost`` (called by the speculator when it uses the cost model).
        Default: nothing to time (lookup methods; heads measure themselves on first use)."""

    def step_cost(self, num_seqs: int, num_tokens: int) -> float:
        """Seconds the drafter spends to propose ``num_tokens`` per sequence (0 for lookup methods)."""
        return 0.0

    def memory_bytes(self) -> int:
        """Memory the drafter holds of its own (weights, caches, buffers), beyond the target's: what ``auto``'s
        ``memory_budget_mb`` bounds. Default: 0 (prompt lookup holds an index per sequence, no more)."""
        return 0

    def forget_requests(self) -> None:  # noqa: B027
        """Drop the text of earlier requests the drafter keeps to draft from (suffix's global trie), so a run that
        repeats them cannot draft from their answers (the benchmark's rounds over one prompt set start alike).
        Default: no request's text is kept."""

    def detach(self) -> None:  # noqa: B027
        """The speculator stopped using this drafter (``auto`` found it cannot pay here): stop whatever it does on
        the engine's passes. Default: nothing."""

    def tree_acceptance(self) -> tuple[float, float] | None:
        """A tree drafter's lossy opt-in: ``(eps, delta)`` of typical acceptance for sampled requests (acceptance.
        verify_tree_typical). Default ``None``: lossless tree verification."""
        return None

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:  # noqa: B027
        """Called, for drafters that declare ``observes``, after each step that committed tokens to ``seq`` (not
        finished), with the target's final hidden state at the position whose logits produced the last committed
        token. Drafters that read the target's hidden state (Medusa heads) keep it for the next ``propose``."""

    def observe_rows(self, tokens: list[int], logits: torch.Tensor) -> None:  # noqa: B027
        """For drafters that declare ``observes_rows``: the target's raw logits ``[len(tokens), vocab]`` at rows
        whose input tokens were ``tokens`` (a verification: the root, then every draft, accepted or not; a
        plain step: the last row of every sequence it sampled). Token Recycling's successor matrix learns from them."""

    def verify_chain(
        self, seq: Sequence, drafts: list[int], logits: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[list[int], int] | None:
        """A drafter with its own acceptance rule verifies its chain ``drafts`` here: ``logits``
        [len(drafts) + 1, vocab] are the target's (the request's logits processors applied) at the drafts'
        positions; returns (emitted tokens, drafts accepted). Default ``None``: the engine's lossless verification
        (greedy match / rejection sampling)."""
        return None

    def tree_budget(self, seq: Sequence, room: int, cost: StepCost | None, batch: int) -> tuple[int, float] | None:
        """Tree drafters size their own proposals (a tree's acceptance is not the chain model's per-token rate):
        return ``(nodes, expected tokens per step)`` for ``seq`` this step, at most ``room`` nodes, given the
        engine's step-cost model ``cost`` (may be None) and the number of running sequences. ``None`` (chain
        drafters) means "use dynamic gamma"."""
        return None


def tensor_bytes(*parts: torch.nn.Module | torch.Tensor | None) -> int:
    """Bytes of the given modules' parameters and buffers and of the given tensors (None skipped)."""
    total = 0
    for part in parts:
        if isinstance(part, torch.nn.Module):
            total += sum(t.numel() * t.element_size() for t in (*part.parameters(), *part.buffers()))
        elif part is not None:
            total += part.numel() * part.element_size()
    return total


__all__ = ["EngineView", "Proposal", "Proposer", "StepCost", "Verification", "tensor_bytes", "tree_proposal"]
