"""What the speculator remembers about one sequence between steps (``Speculator.states``, by request id).

One typed record instead of a dict of string keys, for the speculator's and the router's bookkeeping; what a
method keeps per request lives in its proposer (proposer.py), and nothing rides on the engine's ``Sequence``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leapdecode.speculative.counterfactual import PendingDraft

PRIOR_ACCEPTANCE = 0.7  # optimistic, so a new sequence gets to try drafting
MAX_IDLE_STEPS = 8  # the longest pause of a drafter with nothing worth drafting in a batch (IdleState)
MAX_IDLE_STEPS_ALONE = 4  # the same at batch 1, where only auto's drafters pause (DraftState.paused)


@dataclass
class GammaState:
    """One sequence's dynamic draft length for one drafter (policy.DynamicGamma) and its acceptance estimate."""

    gamma: int
    high_streak: int = 0
    low_streak: int = 0
    acceptance_ema: float = PRIOR_ACCEPTANCE
    drafted: int = 0  # drafts this drafter verified for the sequence, and how many were accepted
    accepted: int = 0


@dataclass
class Route:
    """The strategy router's decision for one request (router.py): the task it read from the prompt, the branch of
    the decision tree it took, the methods that branch allows (the tree's preference first), and each place where
    measurement made it depart from the tree, with the reason."""

    task: str
    branch: list[str]
    candidates: tuple[str, ...]
    departures: list[str] = field(default_factory=list)

    def explain(self) -> str:
        text = f"task={self.task}; {' -> '.join(self.branch)} [{', '.join(self.candidates) or 'plain decoding'}]"
        return text + "".join(f"; departs: {d}" for d in self.departures)


@dataclass
class DomainState:
    """One sequence's copy detector (router.DomainDetector): each committed token's bigram -> the token that
    followed its latest occurrence, how far the index reaches, the running share of tokens that bigram lookup
    predicted, and the domain it last settled on ("copying" or "writing"; None until the first window)."""

    next_of: dict[tuple[int, int], int] = field(default_factory=dict)
    done: int = 0
    seen: int = 0
    hit_rate: float = 0.0
    domain: str | None = None


@dataclass
class DifficultyState:
    """One sequence's difficulty signal (difficulty.py): the target's top-1 probability and its margin over the
    runner-up at the row behind each committed step's last token, as running averages over recent steps, how
    many steps they cover, and the compute path last chosen from them (None before the first choice)."""

    top1: float = 0.0
    margin: float = 0.0
    steps: int = 0
    path: str | None = None


@dataclass
class IdleState:
    """One sequence's pause for one drafter in a batch (under auto also at batch 1): a drafter that had nothing
    worth drafting is asked again only after ``skip`` steps, a pause that doubles (1, 2, 4, 8; at batch 1 up to 4)
    while it keeps having nothing, and ends at once when it drafts or the batch gets smaller than ``batch`` (the
    size it last said no at)."""

    skip: int = 0
    pause: int = 0
    batch: int = 0


@dataclass
class DraftState:
    """Per-sequence draft state. Invariant: ``method`` names the one proposer that drafts this step (None: plain
    decoding), and only that proposer is told the verification result."""

    # the speculator's bookkeeping (this step's drafts and their verdict are values: engine/drafting.py)
    method: str | None = None  # the proposer chosen to draft this step
    gamma: dict[str, GammaState] = field(default_factory=dict)  # per chain drafter: draft length and acceptance
    # the strategy router (router.py): this request's route and its copy detector
    route: Route | None = None
    domain: DomainState = field(default_factory=DomainState)
    difficulty: DifficultyState = field(default_factory=DifficultyState)  # the difficulty-driven compute path
    idle: dict[str, IdleState] = field(default_factory=dict)  # per drafter: its pause in a batch (IdleState)
    tree_promise: float = 0.0  # the accepted nodes this step's tree drafter promised by its own estimate
    # the drafts other candidates would have made, scored once the target commits past them (counterfactual.py)
    pending: list[PendingDraft] = field(default_factory=list)

    def begin_step(self) -> None:
        """Nothing chosen yet for this step: no drafter, no promise."""
        self.method, self.tree_promise = None, 0.0

    def paused(self, name: str, batch: int, pause_alone: bool = False) -> bool:
        """Whether drafter ``name`` sits this step out for the sequence: a drafter that had nothing worth drafting
        pauses (IdleState), since asking it (matching an index, growing a tree, sizing) costs more than its rare
        drafts win. In a batch, always; at batch 1 only with ``pause_alone`` (auto), where asking its six drafters
        cost ~0.5 ms a step by per-call timing, ~7% of a one-row int8 step of the bundled model: paused there (at
        most 4 steps), auto's requests ran 1.00-1.10x faster (chat, agent loop, grounded prompts; int8 and float32;
        Zen 3). A single drafter is cheap to ask and lost drafts paused at batch 1 (prompt lookup and suffix on
        grounded prompts: 0.98x and 0.91x), so there it is asked every step."""
        idle = self.idle.get(name)
        if idle is None or (batch <= 1 and not pause_alone) or batch < idle.batch:
            if idle is not None:
                idle.skip = idle.pause = 0
            return False
        if idle.skip > 0:
            idle.skip -= 1
            return True
        return False

    def said_no(self, name: str, batch: int, pause_alone: bool = False) -> None:
        """Drafter ``name`` had nothing worth drafting for the sequence this step: its next pause doubles (at most
        MAX_IDLE_STEPS, MAX_IDLE_STEPS_ALONE at batch 1)."""
        if batch <= 1 and not pause_alone:
            return
        idle = self.idle.setdefault(name, IdleState())
        idle.pause = min(MAX_IDLE_STEPS if batch > 1 else MAX_IDLE_STEPS_ALONE, max(1, 2 * idle.pause))
        idle.skip, idle.batch = idle.pause, batch


__all__ = ["MAX_IDLE_STEPS", "MAX_IDLE_STEPS_ALONE", "PRIOR_ACCEPTANCE", "DifficultyState", "DomainState", "DraftState",
           "GammaState", "IdleState", "Route"]
