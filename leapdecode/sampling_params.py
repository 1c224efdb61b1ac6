"""Per-request generation parameters (mirrors vLLM's ``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy. Every field is validated on construction and a bad value raises a
    ``ValueError`` that names the field, the value and the accepted range.
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

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.repetition_penalty, (int, float)) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1.0 disables it)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif self.stop is None:
            self.stop_list = []
        else:
            if not all(isinstance(s, str) and s for s in self.stop):
                raise bad("stop", "must be a non-empty string or a list of non-empty strings")
            self.stop_list = list(self.stop)
        if self.stop_list and any(not s for s in self.stop_list):
            raise bad("stop", "must not contain empty strings")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
