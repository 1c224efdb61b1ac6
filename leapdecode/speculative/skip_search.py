"""Which of the target's layers the layer-skip draft leaves out (methods/layer_skip.py), found online, no training.

The drafter runs passes; this module only decides. A *round* of the search is one window of committed tokens of
a running request (the last ``search_window`` of them), scored twice or more, teacher-forced: once through every
layer (the target's own next-token choices there, and how much each layer turns the residual stream), then once
per candidate skip set (its choices with those layers left out). A candidate's score on the window is how many
of its choices equal the target's: what greedy verification would have accepted, token by token. All candidates
of a round see the same window, so they are compared on the same text.

1. **Influence.** Every round's full pass adds, per layer, ``1 - cos(input, output)`` of its rows: a layer that
   barely turns the residual stream costs the draft little agreement when skipped (Men et al. 2024 measured this
   on Llama-family models). The first and the last layer always run.
2. **Grid** (the first round): skip sets of the ``k`` least influential middle layers, ``k`` a few shares of
   them (``GRID``), so the search starts from the trade-off's shape: more skipped layers draft faster and agree
   less.
3. **Refinement** (later rounds, while ``rounds`` last, and only while the best set promises to beat plain
   decoding; the search stops once its neighbours were all scored): the neighbours of the best set so far (one
   layer more or fewer skipped, the most influential skipped layer swapped for the least influential kept one, by the
   influence measured so far), scored beside the best set itself on the round's window.
4. **Live.** Every verification of a draft adds its drafted and accepted tokens to the set that drafted it, so
   the estimate of each set is its teacher-forced agreement and its real acceptance together, and the best set
   is chosen again from them (``choose``) as drafting goes on.

"Best" is the most tokens per second a set promises: ``speed(kept_share, acceptance)``, which the drafter
computes from the engine's step-cost model and its own measured draft cost, so the search weighs agreement
against what a draft pass costs on this machine, not agreement alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

SkipSet = tuple[int, ...]  # sorted indices of the layers a draft leaves out
GRID = (0.2, 0.35, 0.5)  # shares of the middle layers the first round's candidates skip
# (kept share, per-token acceptance) -> promised tokens per second relative to plain decoding
Speed = Callable[[float, float], float]


@dataclass
class Candidate:
    """One skip set's measurements: teacher-forced matches over scored rows, live accepted over drafted tokens."""

    skip: SkipSet
    matches: int = 0
    rows: int = 0
    drafted: int = 0
    accepted: int = 0

    def acceptance(self) -> float:
        """Per-token acceptance estimate: both kinds of evidence pooled, with one pseudo-hit and one pseudo-miss."""
        return (self.matches + self.accepted + 1) / (self.rows + self.drafted + 2)


class SkipSearch:
    """The search of the module docstring over a target of ``num_layers`` layers, at most ``rounds`` rounds
    (the first is the grid)."""

    def __init__(self, num_layers: int, rounds: int, fixed: SkipSet | None = None) -> None:
        if num_layers < 1:
            raise ValueError(f"a layer-skip draft needs a target with layers, got {num_layers}")
        if rounds < 0:
            raise ValueError(f"search rounds must be >= 0, got {rounds}")
        self.num_layers = num_layers
        self.rounds_left = 0 if fixed is not None else rounds
        self.influence = [0.0] * num_layers
        self.influence_rows = 0
        self.candidates: dict[SkipSet, Candidate] = {}
        self.best: SkipSet | None = None
        if fixed is not None:
            self.best = check_skip(fixed, num_layers)
            self.candidates[self.best] = Candidate(self.best)

    # ------------------------------------------------------------------------------------------- rounds
    @property
    def searching(self) -> bool:
        """Whether another round is due (the drafter then scores a window when it finds one)."""
        return self.rounds_left > 0 and self.num_layers > 2

    def middle(self) -> list[int]:
        """The layers a draft may skip, least influential first (ties: the later layer first)."""
        return sorted(range(1, self.num_layers - 1), key=lambda i: (self.influence[i], -i))

    def record_influence(self, per_layer: list[float], rows: int) -> None:
        """A full pass turned the residual stream by ``per_layer[i]`` (summed over its ``rows`` rows) at layer i."""
        if len(per_layer) != self.num_layers:
            raise ValueError(f"influence of {len(per_layer)} layers for a target of {self.num_layers}")
        self.influence = [a + b for a, b in zip(self.influence, per_layer)]
        self.influence_rows += rows

    def round_candidates(self) -> list[SkipSet]:
        """The skip sets this round scores (call after ``record_influence`` of its full pass): the grid first, then
        the best set and its neighbours not yet scored."""
        order = self.middle()
        if self.best is None:
            sets = [tuple(sorted(order[: max(1, round(share * len(order)))])) for share in GRID]
        else:
            sets = [self.best, *self._neighbours(self.best, order)]
        out: list[SkipSet] = []
        for s in sets:
            if s and s not in out and (s == self.best or s not in self.candidates or self.best is None):
                out.append(s)
        if self.best is not None and out == [self.best]:  # every neighbour scored: the search has converged
            self.rounds_left = 0
            return []
        return out

    @staticmethod
    def _neighbours(best: SkipSet, order: list[int]) -> list[SkipSet]:
        skipped = [i for i in order if i in best]  # least influential first
        kept = [i for i in order if i not in best]
        out: list[SkipSet] = []
        if kept:
            out.append(tuple(sorted((*best, kept[0]))))  # one more skipped
        if len(skipped) > 1:
            out.append(tuple(sorted(skipped[:-1])))  # one fewer
        if kept and skipped:
            out.append(tuple(sorted((*skipped[:-1], kept[0]))))  # a swap
        return out

    def record_round(self, scores: dict[SkipSet, tuple[int, int]], speed: Speed) -> None:
        """The round's (matches, rows) per candidate; the best set is chosen again."""
        for skip, (matches, rows) in scores.items():
            c = self.candidates.setdefault(skip, Candidate(skip))
            c.matches += matches
            c.rows += rows
        self.rounds_left = max(0, self.rounds_left - 1)
        self.choose(speed)
        # nothing scored promises to beat plain decoding: further rounds would cost passes for nothing
        if self.best is not None and self.score(self.best, speed) < 1.0:
            self.rounds_left = 0

    # --------------------------------------------------------------------------------------------- live
    def record_live(self, skip: SkipSet, drafted: int, accepted: int) -> None:
        c = self.candidates.setdefault(skip, Candidate(skip))
        c.drafted += drafted
        c.accepted += accepted

    def kept_share(self, skip: SkipSet) -> float:
        return 1.0 - len(skip) / self.num_layers

    def score(self, skip: SkipSet, speed: Speed) -> float:
        return speed(self.kept_share(skip), self.candidates[skip].acceptance())

    def choose(self, speed: Speed) -> SkipSet | None:
        """The scored set that promises the most tokens per second (None before the first round)."""
        if self.candidates:
            self.best = max(self.candidates, key=lambda s: (self.score(s, speed), -len(s)))
        return self.best

    def acceptance(self) -> float | None:
        """The best set's acceptance estimate, None before the first round."""
        return None if self.best is None else self.candidates[self.best].acceptance()

    def describe(self, speed: Speed) -> str:
        """One line for logs and ``--explain``: the best set, its acceptance and promised speed-up, rounds left."""
        if self.best is None:
            return "layer skip: no window scored yet"
        c = self.candidates[self.best]
        return (f"layer skip: {len(self.best)}/{self.num_layers} layers skipped {list(self.best)}, acceptance "
                f"{c.acceptance():.2f} ({c.rows} scored rows, {c.drafted} drafted), promises "
                f"{self.score(self.best, speed):.2f}x; {len(self.candidates)} sets scored, "
                f"{self.rounds_left} rounds left")


def check_skip(skip: SkipSet | list[int], num_layers: int) -> SkipSet:
    """A user's fixed skip set, checked: distinct middle layers (the first and the last always run)."""
    out = tuple(sorted(set(skip)))
    if len(out) != len(list(skip)):
        raise ValueError(f"skip_layers lists a layer twice: {list(skip)}")
    bad = [i for i in out if not (isinstance(i, int) and 0 < i < num_layers - 1)]
    if bad or not out:
        raise ValueError(f"skip_layers must name middle layers of this {num_layers}-layer target (1 .. "
                         f"{num_layers - 2}; the first and the last always run), got {list(skip)}")
    return out


__all__ = ["GRID", "Candidate", "SkipSearch", "SkipSet", "Speed", "check_skip"]
