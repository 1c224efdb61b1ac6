"""A grammar matcher that fails on purpose: the poisoned request of the containment tests (one request whose
processing raises inside an engine step, beside healthy ones)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from leapdecode.structured.base import GrammarMatcher


class Exploding(GrammarMatcher):
    """A real matcher that raises from the ``at``-th call of ``method`` on (``allowed_tokens`` or ``accept``);
    ``on_raise`` runs just before (to see what else the engine holds at that moment)."""

    def __init__(self, inner: GrammarMatcher, method: str, at: int, on_raise: Callable[[], None] = lambda: None):
        self.inner, self.method, self.at, self.calls, self.on_raise = inner, method, at, 0, on_raise

    def _tick(self, method: str) -> None:
        if method == self.method:
            self.calls += 1
            if self.calls >= self.at:
                self.on_raise()
                raise RuntimeError(f"simulated failure in {method}")

    def allowed_tokens(self) -> torch.Tensor:
        self._tick("allowed_tokens")
        return self.inner.allowed_tokens()

    def accept(self, token: int) -> bool:
        self._tick("accept")
        return self.inner.accept(token)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()
