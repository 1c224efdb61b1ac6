"""Per-request generation parameters (mirror vLLM's ``SamplingParams`` and ``StructuredOutputsParams``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top-k log-probabilities per position a request may ask for (OpenAI's chat limit)
MAX_N = 128  # completions per request
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _number(x: object) -> bool:  # a real, finite number (bools and NaN are not)
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a language; exactly one field is set.

    ``json``: a JSON schema (dict or JSON text); ``json_object``: any JSON object; ``regex``: a regular expression
    the whole output matches; ``choice``: the output is one of these strings; ``grammar``: an EBNF grammar (GBNF
    syntax, root rule ``root``). ``disable_any_whitespace`` (JSON schemas): no free whitespace between JSON
    tokens, the fixed separators ``", "`` and ``": "`` instead; small models otherwise may emit whitespace
    forever."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"StructuredOutputsParams.{name} {rule}, got {getattr(self, name)!r}")

        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise bad("json", f"must be a JSON schema (a dict or JSON text): {e}") from None
            except RecursionError:  # (hostile text: "[" nested 50,000 deep)
                raise ValueError("StructuredOutputsParams.json is nested too deeply to parse") from None
            if not isinstance(schema, (dict, bool)):
                raise bad("json", "must be a JSON schema object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise bad("json", "must be a JSON schema (a dict or JSON text)")
        elif self.json is not None:
            try:  # key() writes it as JSON text: what cannot be written is refused here, not in a step
                json.dumps(self.json)
            except RecursionError:
                raise ValueError("StructuredOutputsParams.json is nested too deeply") from None
            except (TypeError, ValueError) as e:
                raise ValueError(f"StructuredOutputsParams.json must be JSON data: {e}") from None
        for flag in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "must be a bool")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex", "must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise bad("choice", "must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise bad("grammar", "must be a non-empty EBNF grammar string")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable identity (kind, spec) for caching compiled grammars."""
        kind = self.kind
        if kind == "json" and self.disable_any_whitespace:
            kind = "json_compact"
        if kind in ("json", "json_compact"):
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)  # property order matters
        elif kind == "choice":
            spec = json.dumps(list(self.choice or []))
        elif kind == "json_object":
            spec = ""
        else:
            spec = str(getattr(self, kind))
        return kind, spec


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` (or below 1e-5) means greedy. Every field is validated on construction and a bad
    value raises a ``ValueError`` that names the field, the value and the accepted range. docs/sampling.md
    defines the order the logits processors run in and what ``logprobs`` report.
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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Whether this request's output may join what the engine keeps across requests to draft from (the suffix
    # method's global tree, which holds other requests' text verbatim); False keeps it out. True by default in the
    # Python API; `leapdecode serve --no-share-output` makes False the default of requests that do not say.
    share_output: bool = True
    stop_list: list[str] = field(init=False, repr=False, default_factory=list)
    # True when a processor that rewrites logits before temperature is on (penalties, bias, min_tokens, grammar):
    # the sampler skips all of that work for requests without one
    has_processors: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_stops()
        self._check_processors()
        self._check_outputs()
        self.has_processors = (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
            or self.min_tokens > 0 or bool(self.logit_bias) or self.structured_outputs is not None
        )

    def _bad(self, name: str, rule: str) -> ValueError:
        return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

    def _check_sampling(self) -> None:
        bad = self._bad
        if not _number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _integer(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not _integer(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "must be None or an integer in [-2**63, 2**64)")
        if not _integer(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", "must be a bool")
        if not isinstance(self.share_output, bool):
            raise bad("share_output", "must be a bool")

    def _check_stops(self) -> None:
        bad = self._bad
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
            or not all(_integer(t) and t >= 0 for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad("include_stop_str_in_output", "must be a bool")

    def _check_processors(self) -> None:
        bad = self._bad
        if not _number(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "must be a number in [0.01, 100] (1.0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be a number in [-2, 2] (0 disables it)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                _integer(k) and k >= 0 and _number(v) and -100 <= v <= 100 for k, v in self.logit_bias.items()
            ):
                raise bad("logit_bias", "must map non-negative integer token ids to numbers in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or None")

    def _check_outputs(self) -> None:
        bad = self._bad
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _integer(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}] (top log-probabilities kept)")
        low = 0 if self.prompt_logprobs is not None else 1
        if not _integer(self.max_tokens) or self.max_tokens < low:
            raise bad("max_tokens", "must be an integer >= 1 (0 is allowed only with prompt_logprobs: scoring)")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")

    @property
    def greedy(self) -> bool:
        # as in vLLM, a temperature below 1e-5 is greedy: dividing logits by it only risks overflow
        return self.temperature < GREEDY_TEMPERATURE
