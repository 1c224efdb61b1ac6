"""Scoring the drafts a step did not verify.

When several drafters could draft for a sequence (``auto``), the speculator verifies the one whose estimate
promises the most, and only the verified drafter learns how good its estimate was. That is a selection bias: a
drafter is chosen when its estimate happens to be high, so what it learns is mostly that it was over-promised, and
a drafter that stops being chosen (or declines because its estimate sank) no longer learns at all. Measured on the
agentic prompts with int8 activations, ``auto`` over prompt lookup, suffix and Token Recycling took 233 target steps
for 512 tokens where suffix alone took 162-171: suffix's estimate had sunk after a few over-promised trees, and it was
rarely chosen again.

So the drafts a sequence's other candidates would have made (``Proposer.peek``, no side effects) are kept as
``PendingDraft`` values and scored once the target has committed enough tokens after their root: a greedy walk of
the draft against the committed tokens gives the nodes verification would have accepted (for sampled requests the
committed tokens are draws from the target, and a deterministic draft token is accepted exactly when it is the
draw). The score enters the same estimates a verification does (a tree drafter's realism, a chain drafter's
acceptance). Nothing here changes what is emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PENDING = 64  # per sequence: the oldest unscored drafts are dropped past this many (each resolves within its depth)


@dataclass(frozen=True)
class PendingDraft:
    """A draft ``method`` would have made for a sequence of ``start`` tokens (a chain when ``parents`` is None, else
    a tree: node i's parent index, -1 for a child of the root); ``promise``: the accepted nodes its own estimate
    promised (trees; 0 for chains)."""

    method: str
    start: int
    tokens: tuple[int, ...]
    parents: tuple[int, ...] | None
    promise: float = 0.0


def accepted_nodes(draft: PendingDraft, committed: list[int]) -> int | None:
    """How many nodes of ``draft`` greedy verification accepts, given ``committed``: the tokens the target committed
    after the draft's root. None while that is not decided yet (every committed token matched a node and the
    matched node has children)."""
    if draft.parents is None:
        for i, token in enumerate(draft.tokens):
            if i >= len(committed):
                return None
            if committed[i] != token:
                return i
        return len(draft.tokens)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents):
        children.setdefault(p, []).append(i)
    node, depth = -1, 0
    while True:
        kids = children.get(node)
        if not kids:
            return depth
        if depth >= len(committed):
            return None
        node = next((j for j in kids if draft.tokens[j] == committed[depth]), -2)
        if node == -2:
            return depth
        depth += 1


def hold(pending: list[PendingDraft], draft: PendingDraft) -> None:
    """Keep ``draft`` to be scored; past ``MAX_PENDING`` the oldest go unscored."""
    pending.append(draft)
    if len(pending) > MAX_PENDING:
        del pending[: len(pending) - MAX_PENDING]


def decided(pending: list[PendingDraft], token_ids: list[int]) -> list[tuple[PendingDraft, int]]:
    """The held drafts that a sequence's tokens ``token_ids`` now decide, with their accepted nodes; they leave
    ``pending`` (the undecided stay)."""
    out, keep = [], []
    for d in pending:
        accepted = accepted_nodes(d, token_ids[d.start :])
        if accepted is None:
            keep.append(d)
        else:
            out.append((d, accepted))
    pending[:] = keep
    return out


__all__ = ["MAX_PENDING", "PendingDraft", "accepted_nodes", "decided", "hold"]
