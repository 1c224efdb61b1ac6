"""What the engine needs of speculative decoding: the ``Drafting`` object it calls in each step, and the factory that
builds one (``leapdecode.speculative.speculator.Speculator``).

Whoever builds the engine hands it the factory (``LLM`` does): the engine imports nothing of the speculative
package, whose drafters read the engine's parts (sequences, the KV cache, the runner), so the arrows between the
two folders run one way.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.model_runner import ForwardItem, ForwardResult
from leapdecode.engine.scheduler import ScheduledSeq
from leapdecode.engine.sequence import Sequence


class Drafting(Protocol):
    """One engine's speculative decoding, in the order the engine's step calls it."""

    cfg: SpeculativeConfig

    def budget_for(self, seq: Sequence) -> int:
        """Draft tokens ``seq`` may verify this step (0: plain decoding); the scheduler reserves their room."""
        ...

    def propose(self, scheduled: list[ScheduledSeq]) -> None:
        """Draft for the scheduled sequences given a budget (``draft_token_ids`` of each)."""
        ...

    def shape_item(self, seq: Sequence, item: ForwardItem, num_prefix: int) -> None:
        """Lay a drafted tree out in ``item`` (positions by depth, the ancestor mask); chains keep the causal one."""
        ...

    def verify(self, seq: Sequence, res: ForwardResult) -> tuple[list[int], int, torch.Tensor | None]:
        """(tokens to commit, drafts accepted, the processed logits of their rows or None) from the target's pass."""
        ...

    def observe(self, seq: Sequence, res: ForwardResult) -> None:
        """After a step committed tokens to ``seq``: the drafters that watch the target's hidden states see them."""
        ...

    def observe_step(self, rows: int, seconds: float) -> None:
        """A target forward of ``rows`` rows took ``seconds`` (the step-cost model learns from live steps)."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted."""
        ...

    def preempt(self, seq: Sequence) -> None:
        """The scheduler preempted ``seq``."""
        ...

    def close(self) -> None:
        """The engine stops using this object (another config, or none)."""
        ...


class DraftingFactory(Protocol):
    """Builds an engine's ``Drafting`` (``Speculator``), and checks a config dict the engine is handed later."""

    def __call__(self, engine: Any, cfg: SpeculativeConfig) -> Drafting: ...

    def parse(self, d: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None: ...


__all__ = ["Drafting", "DraftingFactory"]
