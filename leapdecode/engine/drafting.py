"""What the engine and speculative decoding see of each other: the ``Drafting`` object the engine calls in each step,
the factory that builds one (``leapdecode.speculative.speculator.Speculator``) and the ``EngineView`` it is built
from.

Whoever builds the engine hands it the factory (``LLM`` does): the engine imports nothing of the speculative
package, whose drafters read the engine's parts (sequences, the KV cache, the runner), so the arrows between the
two folders run one way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ForwardResult, ModelRunner
from leapdecode.engine.scheduler import ScheduledSeq
from leapdecode.engine.sequence import Sequence
from leapdecode.models.llama import LlamaForCausalLM


class PackLinears(Protocol):
    """The engine's ``pack_linears``: give a module the engine's few-row linear kernel; returns layers packed."""

    def __call__(self, model: torch.nn.Module, linear_kernel: str | None = None, quantize_q8: bool = False) -> int: ...


@dataclass(frozen=True)
class EngineView:
    """What speculative decoding may see of the engine: the target, its cache and runner, and a few settings. The
    engine builds it (``LLMEngine.drafting_view``) and hands it to the speculator, which hands it to the
    proposers: none of them gets the engine itself, so what they depend on is named here (and nothing can reach
    the scheduler's or the server's state by accident)."""

    model: LlamaForCausalLM
    model_path: Path | None
    tokenizer: Any  # a transformers tokenizer, or None for a model given without one
    runner: ModelRunner
    kv_cache: KVCache
    block_manager: BlockManager
    block_size: int
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    generator: torch.Generator  # the engine's stream, for unseeded requests
    num_packed_linears: int  # target layers on the few-row kernel (0: torch ops)
    pack_linears: PackLinears
    running: Callable[[], list[Sequence]]  # the sequences the scheduler runs now


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

    def __call__(self, view: EngineView, cfg: SpeculativeConfig) -> Drafting: ...

    def parse(self, d: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None: ...


__all__ = ["Drafting", "DraftingFactory", "EngineView", "PackLinears"]
