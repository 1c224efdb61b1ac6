"""How many tokens to draft: the dynamic-γ rule and a measured step-cost model.

Dynamic γ: each sequence's draft length follows its own acceptance, one step up after a streak of well-accepted
verifications, one down after a streak of poor ones (a fixed ``num_speculative_tokens`` turns the rule off).

On a GPU verifying 8 tokens costs about as much as 1; on this CPU it costs ~2.5x, so drafting blindly can make
decoding *slower* (HF's prompt lookup runs at 0.79x of its own plain decoding here). The cost model times target
forward passes at start-up and speculation is only used when the expected tokens per second beat plain decoding.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from statistics import median

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.model_runner import ForwardItem, ModelRunner
from leapdecode.parallel import rank0_value
from leapdecode.speculative.state import GammaState


class DynamicGamma:
    """Per-sequence draft length: +1 after ``raise_after`` consecutive verifications with acceptance above
    ``raise_above``; -1 after ``lower_after`` consecutive ones below ``lower_below``; within [min, max].
    A fixed ``num_speculative_tokens`` disables the rule."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def new_state(self) -> GammaState:
        return GammaState(gamma=self.cfg.num_speculative_tokens or self.cfg.gamma_init)

    def update(self, st: GammaState, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        rate = num_accepted / num_drafted
        st.drafted += num_drafted
        st.accepted += num_accepted
        st.acceptance_ema = 0.7 * st.acceptance_ema + 0.3 * rate
        c = self.cfg
        if c.num_speculative_tokens is not None:
            return
        if rate > c.raise_above:
            st.high_streak += 1
            st.low_streak = 0
            if st.high_streak >= c.raise_after:
                st.gamma = min(c.gamma_max, st.gamma + 1)
                st.high_streak = 0
        elif rate < c.lower_below:
            st.low_streak += 1
            st.high_streak = 0
            if st.low_streak >= c.lower_after:
                st.gamma = max(c.gamma_min, st.gamma - 1)
                st.low_streak = 0
        else:
            st.high_streak = st.low_streak = 0


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens emitted per verification of ``gamma`` drafts with per-token acceptance ``alpha``."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


TREE_REALISM_DECAY = 0.98  # per verified tree: the weight the older accepted / promised history keeps
TREE_REALISM_PRIOR = 8.0  # a new tree drafter starts as if it had delivered this many promised nodes in full
TREE_REALISM_FADE = 0.0003  # per sequence and step a tree drafter declines: its realism drifts back toward 1
TREE_REALISM_MAX = 2.0  # a drafter that keeps under-promising gets at most twice its own estimate


class TreeRealism:
    """How many draft nodes a tree drafter's own estimate promised against how many its verifications accepted,
    per method, as decayed sums. A tree's expected gain (``Proposer.tree_budget``) comes from the drafter's own
    statistics (match frequencies, recorded successor probabilities), and where those are optimistic every tree
    it drafts costs its extra rows for less than it promised: measured on chat prompts, Token Recycling promised
    ~0.9 accepted nodes per tree and delivered ~0.5, so its trees cost more than plain steps. The speculator
    scales each promise by ``ratio`` before comparing rates. While a drafter declines it drifts back toward 1
    (``fade``), so text that turns predictable gets it drafting again; its first trees then measure it anew."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}  # method -> [accepted nodes, promised nodes]

    def ratio(self, name: str) -> float:
        acc, promised = self.sums.get(name, (TREE_REALISM_PRIOR, TREE_REALISM_PRIOR))
        return min(TREE_REALISM_MAX, acc / promised) if promised > 0 else 1.0

    def record(self, name: str, promised: float, accepted: int) -> None:
        """One verified tree of ``name``: its own estimate promised ``promised`` accepted nodes; ``accepted`` were."""
        s = self.sums.setdefault(name, [TREE_REALISM_PRIOR, TREE_REALISM_PRIOR])
        s[0] = TREE_REALISM_DECAY * s[0] + accepted
        s[1] = TREE_REALISM_DECAY * s[1] + promised

    def fade(self, name: str) -> None:
        s = self.sums.get(name)
        if s is not None:
            s[0] += TREE_REALISM_FADE * (s[1] - s[0])


ONLINE_EMA = 0.05  # weight of a live step in its calibration point's measured/calibrated ratio (after a mean)
ONLINE_MIN_STEPS = 3  # live steps near a calibration point before its own ratio replaces its nearest neighbour's


class StepCostModel:
    """Target forward time as a function of the number of tokens in the step, piecewise linear between
    calibration points measured on this machine. A calibrated model also learns from the live steps
    (``observe``): a start-up calibration of three timings per size can be off by a noisy moment, and every
    draft-length decision reads it; a model given by hand stays as given."""

    def __init__(self, points: list[tuple[int, float]], online: bool = False) -> None:
        self.calibrated = sorted(points)
        self.points = list(self.calibrated)
        self.xs = [x for x, _ in self.points]
        self.online = online
        # per calibration size: [measured / calibrated time of the live steps nearest to it (a mean over the first
        # 1 / ONLINE_EMA steps, then an EMA), how many]
        self.ratios: dict[int, list[float]] = {}
        # per calibration point, the measured point whose ratio scales it (recomputed when a point becomes
        # measured, not every step: ``observe`` runs once per engine step)
        self._near: list[int] = []

    def observe(self, n: int, seconds: float) -> None:
        """A live target step of ``n`` tokens took ``seconds``. Its ratio to the calibrated time at ``n`` enters the
        nearest calibration point's ratio, and the curve becomes the calibrated one scaled point by point: each
        point by its own ratio once ``ONLINE_MIN_STEPS`` steps measured it, else by its nearest measured point's.
        So a level shift seen on plain steps (a longer context than the calibration's) moves the whole curve and
        keeps its shape, what an extra verified row costs, until steps of that size measure it themselves. Steps
        past the largest calibrated size are left out; the curve stays non-decreasing."""
        if not self.online or n < 1 or n > self.xs[-1] or seconds <= 0:
            return
        i = bisect.bisect_left(self.xs, n)
        if self.xs[i] != n and i > 0 and n - self.xs[i - 1] <= self.xs[i] - n:
            i -= 1
        r = self.ratios.setdefault(self.xs[i], [0.0, 0])
        r[1] += 1
        r[0] += max(ONLINE_EMA, 1.0 / r[1]) * (seconds / self._interp(self.xs, self.calibrated, n) - r[0])
        if r[1] == ONLINE_MIN_STEPS:  # a newly measured point: it may now be some points' nearest
            measured = [x for x, (_, c) in self.ratios.items() if c >= ONLINE_MIN_STEPS]
            self._near = [min(measured, key=lambda m: (abs(m - x), m)) for x in self.xs]
        if not self._near:
            return
        pts, best = [], 0.0
        for (x, y), near in zip(self.calibrated, self._near):
            best = max(best, y * self.ratios[near][0])
            pts.append((x, best))
        self.points = pts

    @classmethod
    def calibrate(cls, run_step, sizes: tuple[int, ...] = (1, 2, 3, 5, 9, 17, 33, 65), repeats: int = 3):
        """``run_step(n)`` runs one target forward of n tokens; each size is timed ``repeats`` times."""
        run_step(1)  # warm-up
        pts = []
        for n in sizes:
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                run_step(n)
                ts.append(time.perf_counter() - t0)
            pts.append((n, rank0_value(median(ts))))  # tensor-parallel ranks: rank 0's timing, the same plan
        # enforce monotone non-decreasing cost (noise can make a larger step look cheaper)
        fixed, best = [], 0.0
        for n, t in pts:
            best = max(best, t)
            fixed.append((n, best))
        return cls(fixed, online=True)

    def headroom(self, batch: int, max_drafts: int) -> float:
        """The most a step of ``batch`` one-token sequences could speed up if one of them verified up to
        ``max_drafts`` drafts and every draft were accepted: max over k of ((batch + k) / t(batch + k)) over
        (batch / t(batch)). Where rows cost in proportion to their count (a CPU's compute-bound regime) it is about
        1: no drafter can pay there, whatever it drafts."""
        base = batch / self(batch)
        return max(((batch + k) / self(batch + k) for k in range(1, max_drafts + 1)), default=base) / base

    def __call__(self, n: int) -> float:
        return self._interp(self.xs, self.points, n)

    @staticmethod
    def _interp(xs: list[int], pts: list[tuple[int, float]], n: int) -> float:
        if n <= xs[0]:
            return pts[0][1] * n / xs[0] if n < xs[0] else pts[0][1]
        i = bisect.bisect_left(xs, n)
        if i >= len(xs):  # extrapolate with the last slope
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
            return y1 + (n - x1) * (y1 - y0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (n - x0) * (y1 - y0) / (x1 - x0)

    def best_gamma(self, alpha: float, max_gamma: int, batch_tokens: int, batch_size: float,
                   draft_cost=lambda g: 0.0, rows=lambda g: g, expected=expected_tokens) -> int:
        """The γ in [0, max_gamma] that maximises this step's tokens per second, for one sequence in a step
        that otherwise holds ``batch_tokens`` rows expected to emit ``batch_size`` tokens (one per sequence, more
        where earlier sequences were granted drafts); 0 means plain decoding.
        At batch 1 this is the classic test E(α, γ) · t(1) > t(1 + γ) + draft time. A drafter that verifies more
        than its γ chain tokens (a hybrid tree) passes ``rows(γ)``, the rows it adds to the step, and its own
        ``expected(α, γ)`` tokens per step."""
        base = self(batch_tokens)
        best, best_rate = 0, batch_size / base if base > 0 else 0.0
        for g in range(1, max_gamma + 1):
            t = self(batch_tokens + rows(g)) + draft_cost(g)
            rate = (batch_size - 1 + expected(alpha, g)) / t if t > 0 else float("inf")
            if rate > best_rate * 1.02:  # demand a small margin: calibration is noisy
                best, best_rate = g, rate
        return best


def scratch_step(runner: ModelRunner, bm: BlockManager, n: int, ctx: int = 64) -> None:
    """One forward of n tokens after ``ctx`` cached ones on a scratch sequence (one block table borrowed from the
    pool, returned): what the cost models time. The default is a short chat context, the regime where the step
    cost matters most. Skipped when the pool has no room (an idle pool always has)."""
    if bm.blocks_needed(ctx + n) > bm.num_free_blocks:
        return
    with bm.borrowed(ctx + n) as table:
        runner.execute([ForwardItem(table, ctx, [0] * n, list(range(n)))])
    if runner.device.type == "cuda":  # a GPU returns before the step ran: time the work, not its launch
        torch.cuda.synchronize(runner.device)


def calibrate_target(runner: ModelRunner, bm: BlockManager) -> StepCostModel:
    """The target's step-cost model, timed on this machine with scratch steps."""
    step: Callable[[int], None] = lambda n: scratch_step(runner, bm, n)  # noqa: E731
    return StepCostModel.calibrate(step)

