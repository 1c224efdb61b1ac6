"""The pieces every method's typed options are made of: the checks, the shared-key sets a method may read, and the
option group that several trained drafters share (``DrafterOptions``).

A ``speculative_config`` dict is flat (vLLM's convention: ``{"method": "eagle", "tree_nodes": 4}``). Each method's
descriptor (speculative/method.py) names the shared keys it reads (fields of ``SpeculativeConfig``, e.g.
``num_speculative_tokens``) and its option groups (frozen dataclasses such as ``DrafterOptions`` here, or the
``EagleTreeOptions`` of methods/eagle.py); ``registry.parse_config`` files each key into the group that owns it and
refuses every key the method does not read, naming the keys it does. One spelling per concept across methods:
``top_k`` is "how many of the best-ranked tokens", ``tree_nodes`` "how many tree nodes the target verifies per
step".

This module names no method: the methods import it, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

DraftPrecision = Literal["int8", "float32"]
DRAFT_PRECISIONS: tuple[str, ...] = get_args(DraftPrecision)
# the shared keys of a chain drafter sized by dynamic gamma and the step-cost model (speculative/policy.py)
CHAIN_KEYS = frozenset({"num_speculative_tokens", "gamma_init", "gamma_max", "gamma_min", "raise_after",
                        "raise_above", "lower_after", "lower_below", "use_cost_model"})
# prompt lookup's n-gram lengths
LOOKUP_KEYS = frozenset({"prompt_lookup_min", "prompt_lookup_max"})


def check(cond: bool, msg: str) -> None:
    """A ValueError with ``msg`` unless ``cond``: every option check says what to change."""
    if not cond:
        raise ValueError(msg)


def is_int(v: object, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def is_prob(v: object, high_open: bool = False) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return 0.0 <= float(v) < 1.0 if high_open else 0.0 <= float(v) <= 1.0


def group_keys(group: type) -> tuple[str, ...]:
    """The keys of an option group (its dataclass fields)."""
    return tuple(f.name for f in fields(group))


@dataclass(frozen=True)
class DrafterOptions:
    """Trained drafters (self_spec, a trained draft_model, eagle; a hybrid's trunk). ``None``: the artifact's
    value. ``min_draft_prob``: stop a chain when the draft's top probability falls below it (default 0.3);
    ``draft_vocab``: score only the N most frequent tokens of the artifact's ranked vocabulary (0 = the whole LM
    head); ``draft_precision``: the drafter's own layers as Q8_0 with int8 activations on a CPU, or float32."""

    min_draft_prob: float | None = None
    draft_vocab: int | None = None
    draft_precision: DraftPrecision = "int8"

    def __post_init__(self) -> None:
        check(self.min_draft_prob is None or is_prob(self.min_draft_prob),
               f"min_draft_prob must be a number in [0, 1], got {self.min_draft_prob!r}")
        check(self.draft_vocab is None or is_int(self.draft_vocab, 0),
               f"draft_vocab must be an integer >= 0, got {self.draft_vocab!r}")
        check(self.draft_precision in DRAFT_PRECISIONS,
               f"draft_precision must be one of {DRAFT_PRECISIONS}, got {self.draft_precision!r}")


__all__ = [
    "CHAIN_KEYS",
    "DRAFT_PRECISIONS",
    "LOOKUP_KEYS",
    "DraftPrecision",
    "DrafterOptions",
    "check",
    "group_keys",
    "is_int",
    "is_prob",
]
