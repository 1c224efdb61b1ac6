"""What trains when in a Medusa run: progressive offsets, the context-length curriculum, and its sampler."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch


# --------------------------------------------------------------------------------------------- schedules
@dataclass
class ProgressiveSchedule:
    """Which offsets train: offset 1 alone first, then one more each time the newest is stable.

    ``update(step, loss)`` is fed the newest offset's loss after every optimiser step. The loss is averaged over
    consecutive windows of ``window`` steps; once the stage has run ``min_steps``, a window that improves on the
    previous one by less than ``tol`` (relative) means stable. A stage never lasts more than ``max_steps``."""

    max_offset: int
    enabled: bool = True
    min_steps: int = 20
    max_steps: int = 200
    tol: float = 0.01
    window: int = 20
    offset: int = 1
    stage_start: int = 0
    transitions: list[int] = field(default_factory=list)
    _win: list[float] = field(default_factory=list)
    _prev: float | None = None

    def __post_init__(self) -> None:
        if not self.enabled:
            self.offset = self.max_offset

    def active_offsets(self) -> list[int]:
        return list(range(1, self.offset + 1))

    def update(self, step: int, newest_loss: float) -> bool:
        """Returns True when an offset was added after ``step`` (0-based index of the step just taken)."""
        if self.offset >= self.max_offset:
            return False
        ran = step + 1 - self.stage_start
        self._win.append(float(newest_loss))
        stable = False
        if len(self._win) >= self.window:
            mean = sum(self._win) / len(self._win)
            if self._prev is not None and ran >= self.min_steps:
                stable = (self._prev - mean) / max(abs(self._prev), 1e-8) < self.tol
            self._prev, self._win = mean, []
        if stable or ran >= self.max_steps:
            self.offset += 1
            self.stage_start = step + 1
            self.transitions.append(step + 1)
            self._win, self._prev = [], None
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        for k, v in d.items():
            setattr(self, k, v)


@dataclass
class CurriculumSchedule:
    """Longest context (tokens before the predicted position) a batch may draw from at training progress
    ``p`` in [0, 1]: ``start_len`` growing linearly to ``end_len`` over the first ``ramp_frac`` of the run."""

    end_len: int
    enabled: bool = True
    start_len: int = 64
    ramp_frac: float = 0.5

    def max_len(self, progress: float) -> int:
        if not self.enabled or self.ramp_frac <= 0 or progress >= self.ramp_frac:
            return self.end_len
        start = min(self.start_len, self.end_len)
        return int(start + (self.end_len - start) * progress / self.ramp_frac)


class CurriculumSampler:
    """Uniform batches over the eligible rows (context length <= the curriculum's limit), seeded and
    resumable (the generator state is checkpointed). If fewer rows than a batch are eligible, the shortest
    ``batch`` rows are."""

    def __init__(self, positions: np.ndarray, batch: int, generator: torch.Generator) -> None:
        self.order = np.argsort(positions, kind="stable")
        self.sorted_pos = positions[self.order]
        self.batch = batch
        self.gen = generator

    def eligible(self, max_len: int) -> int:
        n = int(np.searchsorted(self.sorted_pos, max_len, side="right"))
        return max(n, min(self.batch, len(self.order)))

    def sample(self, max_len: int) -> np.ndarray:
        n = self.eligible(max_len)
        pick = torch.randint(n, (self.batch,), generator=self.gen).numpy()
        return self.order[pick]



__all__ = ["CurriculumSampler", "CurriculumSchedule", "ProgressiveSchedule"]
