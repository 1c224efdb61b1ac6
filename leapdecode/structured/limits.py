"""Bounds on what a request may ask the grammar engine to compile, checked before anything is compiled.

A grammar's compile time grows with its nesting (a JSON schema nested a few hundred levels deep took seconds to
compile, and its size is far under any body limit), so size and depth are capped up front and a compile that
still runs past ``compile_timeout_s`` is given up by the request that asked for it (the others go on). Every
refusal is a :class:`GrammarLimitError` (a ``ValueError``: the server answers 400) naming the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from leapdecode.sampling_params import StructuredOutputsParams


class GrammarLimitError(ValueError):
    """A constraint over one of :class:`GrammarLimits` (the message names the limit and the value)."""


@dataclass(frozen=True)
class GrammarLimits:
    """``max_spec_bytes``: the schema / regex / grammar / choices as text (UTF-8 bytes). ``max_json_depth``: how
    deeply a JSON schema's objects and arrays nest (``{"properties": {"a": {...}}}`` is two levels per nested
    property). ``max_regex_depth``: nested groups in a regular expression. ``max_choices``: strings in a
    ``choice`` list. ``compile_timeout_s``: how long a request waits for its compile. ``cache_bytes``: memory
    the grammar engine's cache of compiled grammars may hold (least recently used ones go first)."""

    max_spec_bytes: int = 64 * 1024
    max_json_depth: int = 64
    max_regex_depth: int = 32
    max_choices: int = 1024
    compile_timeout_s: float = 10.0
    cache_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_spec_bytes", "max_json_depth", "max_regex_depth", "max_choices", "cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GrammarLimits.{name} must be an integer >= 1, got {value!r}")
        t = self.compile_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise ValueError(f"GrammarLimits.compile_timeout_s must be a number > 0, got {t!r}")

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise :class:`GrammarLimitError` if ``params`` is over a limit; cheap (one pass over the text)."""
        kind, spec = params.key()
        field = f"structured_outputs.{params.kind}"
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > self.max_spec_bytes:
            raise GrammarLimitError(
                f"{field} is {size} bytes long; the grammar size limit (max_spec_bytes) is {self.max_spec_bytes}"
            )
        if kind in ("json", "json_compact"):
            depth = json_depth(spec)
            if depth > self.max_json_depth:
                raise GrammarLimitError(
                    f"{field} is nested {depth} levels deep; the schema depth limit (max_json_depth) is "
                    f"{self.max_json_depth}"
                )
        elif kind == "regex":
            depth = regex_depth(spec)
            if depth > self.max_regex_depth:
                raise GrammarLimitError(
                    f"{field} nests groups {depth} deep; the regex depth limit (max_regex_depth) is "
                    f"{self.max_regex_depth}"
                )
        elif kind == "choice" and len(params.choice or ()) > self.max_choices:
            raise GrammarLimitError(
                f"{field} has {len(params.choice or ())} strings; the limit (max_choices) is {self.max_choices}"
            )


    def timeout_error(self, params: StructuredOutputsParams) -> GrammarLimitError:
        """The refusal of a request whose compile ran past ``compile_timeout_s``."""
        return GrammarLimitError(
            f"structured_outputs.{params.kind} did not compile within the compile time limit "
            f"(compile_timeout_s) of {self.compile_timeout_s:g} s; simplify the constraint"
        )


def json_depth(text: str) -> int:
    """How deeply objects and arrays nest in JSON ``text`` (no recursion, so any depth is measured)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def regex_depth(pattern: str) -> int:
    """How deeply groups nest in a regular expression (escapes and character classes skipped)."""
    depth = deepest = 0
    in_class = escaped = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(0, depth - 1)
    return deepest


__all__ = ["GrammarLimitError", "GrammarLimits", "json_depth", "regex_depth"]
