"""How many tokens to draft: the dynamic-γ rule (technique brief §2.1) and a measured step-cost model.

On a GPU verifying 8 tokens costs about as much as 1; on this CPU it costs ~2.5x, so drafting blindly can make
decoding *slower* (HF's prompt lookup runs at 0.79x of its own plain decoding here). The cost model times target
forward passes at start-up and speculation is only used when the expected tokens per second beat plain decoding.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from statistics import median

from leapdecode.config import SpeculativeConfig

PRIOR_ACCEPTANCE = 0.7  # optimistic, so a new sequence gets to try drafting


@dataclass
class GammaState:
    gamma: int
    high_streak: int = 0
    low_streak: int = 0
    acceptance_ema: float = PRIOR_ACCEPTANCE


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


class StepCostModel:
    """Target forward time as a function of the number of tokens in the step, piecewise linear between
    calibration points measured on this machine."""

    def __init__(self, points: list[tuple[int, float]]) -> None:
        self.points = sorted(points)
        self.xs = [x for x, _ in self.points]

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
            pts.append((n, median(ts)))
        # enforce monotone non-decreasing cost (noise can make a larger step look cheaper)
        fixed, best = [], 0.0
        for n, t in pts:
            best = max(best, t)
            fixed.append((n, best))
        return cls(fixed)

    def __call__(self, n: int) -> float:
        xs, pts = self.xs, self.points
        if n <= xs[0]:
            return pts[0][1] * n / xs[0] if n < xs[0] else pts[0][1]
        i = bisect.bisect_left(xs, n)
        if i >= len(xs):  # extrapolate with the last slope
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
            return y1 + (n - x1) * (y1 - y0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (n - x0) * (y1 - y0) / (x1 - x0)

    def best_gamma(self, alpha: float, max_gamma: int, batch_tokens: int, batch_size: int,
                   draft_cost=lambda g: 0.0, rows=lambda g: g, expected=expected_tokens) -> int:
        """The γ in [0, max_gamma] that maximises this step's tokens per second, for one sequence in a step
        that otherwise holds ``batch_tokens`` tokens of ``batch_size`` sequences; 0 means plain decoding.
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
