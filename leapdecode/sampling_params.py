"""Per-request generation parameters (mirrors vLLM's ``SamplingParams``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` (or below 1e-5) means greedy. Every field is validated on construction and a bad
    value raises a ``ValueError`` that names the field, the value and the accepted range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # Per-request opt-out of speculative decoding (the engine may still turn it off when it does not pay).
    speculative: bool = True
    stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        def number(x: object) -> bool:  # a real, finite number (bools and NaN are not)
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        def integer(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not integer(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if not number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not number(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "must be a number in [0.01, 100] (1.0 disables it)")
        if not integer(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.seed is not None and (not integer(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "must be None or an integer in [-2**63, 2**64)")
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop_list = list(self.stop)
        else:
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not s for s in self.stop_list):
            raise bad("stop", "must not contain empty strings")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or not all(integer(t) and t >= 0 for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", "must be a bool")

    @property
    def greedy(self) -> bool:
        # as in vLLM, a temperature below 1e-5 is greedy: dividing logits by it only risks overflow
        return self.temperature < GREEDY_TEMPERATURE
