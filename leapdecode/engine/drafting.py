"""What the engine and speculative decoding see of each other: the ``Drafting`` object the engine calls in each step,
the factory that builds one (``leapdecode.speculative.speculator.Speculator``), the ``EngineView`` it is built
from, and the values a step passes between them (``StepSnapshot`` in, ``Draft`` and ``Verdict`` out): nothing is
written onto the engine's ``Sequence`` and nothing calls back into the scheduler.

Whoever builds the engine hands it the factory (``LLM`` does): the engine imports nothing of the speculative
package, whose drafters read the engine's parts (sequences, the KV cache, the runner), so the arrows between the
two folders run one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ForwardResult, ModelRunner
from leapdecode.engine.sequence import Sequence
from leapdecode.models.llama import LlamaForCausalLM


class PackLinears(Protocol):
    """The engine's ``pack_linears``: give a module the engine's few-row linear kernel; returns layers packed."""

    def __call__(self, model: torch.nn.Module, linear_kernel: str | None = None, quantize_q8: bool = False) -> int: ...


@dataclass(frozen=True)
class EngineView:
    """What speculative decoding may see of the engine: the target, its cache and runner, and a few settings. The
    engine builds it (``LLMEngine.drafting_view``) and hands it to the speculator, which hands it to the
    proposers: none of them gets the engine itself, so what they depend on is named here (nothing reaches the
    scheduler's or the server's state: what a step's drafting needs of the batch comes in its ``StepSnapshot``)."""

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


@dataclass(frozen=True)
class DraftSlot:
    """A scheduled decoding sequence and the most draft tokens the scheduler reserved room for this step."""

    seq: Sequence
    budget: int


@dataclass(frozen=True)
class StepSnapshot:
    """What the speculator sees of one step when it drafts: the slots with a budget, and how many sequences run.
    Read-only: a drafter never changes a sequence (it returns drafts as values)."""

    slots: tuple[DraftSlot, ...]
    num_running: int


@dataclass(frozen=True)
class Draft:
    """One sequence's drafts for this step, as the speculator returns them: a chain (``tokens``) or a candidate tree
    (``parents``: node i's parent index, -1 for a child of the last committed token), the distribution each token
    was sampled from (``probs``; None: deterministic), and the method that drafted them."""

    method: str
    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None
    parents: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Verdict:
    """What verification decided for one sequence's drafts: the tokens to commit (accepted drafts, then the
    target's own), the accepted node indices (a chain: 0 .. n-1), the processed logits of the rows the committed
    tokens were drawn at (None unless the request reports log-probabilities), and the row of the forward whose
    hidden state produced the last committed token."""

    committed: list[int]
    accepted: list[int]
    drawn: torch.Tensor | None
    hidden_row: int

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


class Drafting(Protocol):
    """One engine's speculative decoding, in the order the engine's step calls it. Data flows one way: the engine
    asks for plain limits before it schedules, hands a snapshot of the scheduled batch, and gets values back."""

    cfg: SpeculativeConfig

    def draft_limits(self, decoding: list[Sequence], num_running: int) -> dict[str, int]:
        """The most draft tokens each decoding sequence (by request id; absent: none) would verify this step, with
        ``num_running`` sequences in the batch; the scheduler reserves room for them from this plain data."""
        ...

    def propose(self, snapshot: StepSnapshot) -> dict[str, Draft]:
        """Drafts for the snapshot's slots, by request id (a sequence without drafts is absent)."""
        ...

    def shape_item(self, draft: Draft, item: ForwardItem, num_prefix: int) -> None:
        """Lay a drafted tree out in ``item`` (positions by depth, the ancestor mask); chains keep the causal one."""
        ...

    def verify(self, seq: Sequence, draft: Draft, res: ForwardResult) -> Verdict:
        """What the target's pass ``res`` accepts of ``draft``."""
        ...

    def observe(self, seq: Sequence, res: ForwardResult, draft: Draft, verdict: Verdict) -> None:
        """After ``verdict``'s tokens were committed to ``seq``: the drafters that watch the target's hidden states
        or logits see them."""
        ...

    def observe_sampled(self, seqs: list[Sequence], results: list[ForwardResult]) -> None:
        """After plain sampling committed one token to each of ``seqs`` (one call per step)."""
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


__all__ = ["Draft", "DraftSlot", "Drafting", "DraftingFactory", "EngineView", "PackLinears", "StepSnapshot", "Verdict"]
