"""What the engine needs of a grammar engine: compile a request's constraint once, then per sequence a matcher
that says which tokens may come next, advances along the tokens the sequence keeps and rolls back tentative ones.

The engine applies a matcher's allowed-token mask as a logits processor (layers/sampler.py), in plain sampling and
at every draft position during speculative verification: to build the masks for a chain of drafts the speculator
advances the matcher along the drafts, reads one mask per position and rolls it back; the engine then advances it
for real along the tokens it emits. docs/sampling.md explains the choice of grammar engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from leapdecode.sampling_params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One sequence's position in a compiled grammar."""

    @abstractmethod
    def allowed_tokens(self) -> torch.Tensor:
        """A bool [vocab] tensor: True where the token may come next."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the sequence ends here."""

    def masks_along(self, tokens: Sequence[int]) -> list[torch.Tensor]:
        """``len(tokens) + 1`` masks: before each token and after the last, with the matcher advanced along
        ``tokens`` and rolled back afterwards. Positions after a token the grammar refuses (or after the grammar
        ended) repeat the last reachable mask: no accepted sequence of drafts can reach them."""
        masks = [self.allowed_tokens()]
        advanced = 0
        for t in tokens:
            if self.is_terminated() or not self.accept(t):
                break
            advanced += 1
            masks.append(masks[-1] if self.is_terminated() else self.allowed_tokens())
        if advanced:
            self.rollback(advanced)
        masks += [masks[-1]] * (len(tokens) + 1 - len(masks))
        return masks


    def mask_after(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """The mask after ``tokens`` (the matcher rolled back afterwards); None when the grammar refuses them or
        ends before their last one."""
        advanced = 0
        for t in tokens:
            if self.is_terminated() or not self.accept(t):
                break
            advanced += 1
        mask = self.allowed_tokens() if advanced == len(tokens) and not self.is_terminated() else None
        if advanced:
            self.rollback(advanced)
        return mask


@dataclass
class CompiledGrammar:
    """One compiled constraint: ``key`` (``StructuredOutputsParams.key()``), the grammar engine's own object, and
    ``wire``, its serialised form for tensor-parallel workers (made off the engine thread where the server can)."""

    key: tuple[str, str]
    handle: Any
    wire: str | None = None


class StructuredOutputBackend(ABC):
    """Compiles constraints (cached by their spec) against one tokenizer and vocabulary.

    Compiles run in the backend's own worker threads, several at once, and never under a lock another compile
    holds: a spec being compiled is compiled once however many requests ask for it (they share its future). Over
    its :class:`~leapdecode.structured.limits.GrammarLimits` a constraint is refused before compiling."""

    @abstractmethod
    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """Start compiling ``params`` (or join the compile already running for it). Raises ``GrammarLimitError``
        at once for a constraint over the limits; the future fails with ``ValueError`` if it does not compile."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """:meth:`submit` and wait, at most the compile timeout (then ``GrammarLimitError``)."""

    @abstractmethod
    def matcher(self, params: StructuredOutputsParams, compiled: CompiledGrammar | None = None) -> GrammarMatcher:
        """A fresh matcher at the start of ``params``' language (compiled unless ``compiled`` is given);
        ValueError if it does not compile."""

    @abstractmethod
    def to_wire(self, compiled: CompiledGrammar) -> str:
        """``compiled`` serialised for another process with the same tokenizer (kept in ``compiled.wire``)."""

    @abstractmethod
    def from_wire(self, key: tuple[str, str], wire: str) -> CompiledGrammar:
        """A grammar another rank compiled, without compiling it again."""


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int, shifts: torch.Tensor) -> torch.Tensor:
    """Unpack an int32 bitmask (bit j of word w is token 32w + j) into a bool [vocab_size] tensor."""
    return ((bitmask.reshape(-1, 1) >> shifts) & 1).reshape(-1)[:vocab_size].bool()


__all__ = ["CompiledGrammar", "GrammarMatcher", "StructuredOutputBackend", "bitmask_to_bool"]
