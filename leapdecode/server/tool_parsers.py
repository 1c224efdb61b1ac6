"""Tool calls in a model's own syntax (``tool_choice: "auto"``): the model decides whether to call, and writes the
calls the way its chat template taught it. One parser per syntax family, chosen from the template:

* ``hermes`` (Hermes, Qwen2.5, Qwen3, SmolLM3...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text before the first block is the answer's content.
* ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": {...}}`` (several joined by
  ``;``), optionally after ``<|python_tag|>``; an answer that does not start with ``{`` is content.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects (tokenizer v3) or
  ``name[ARGS]{...}`` per call (v11 and later).

A parser finds where the call section starts (:meth:`ToolParser.start`), how much of an unfinished text could
still turn out to be the start of a marker (:meth:`ToolParser.undecided_from`) and the calls in a section
(:meth:`ToolParser.calls`): the complete ones while the answer is still being generated, all of them at the end;
a section whose calls do not parse leaves the whole answer as content. Parsers read text only; markers that are
special tokens (``[TOOL_CALLS]``, ``<|python_tag|>``) are put back into the text by the caller
(:attr:`ToolParser.markers`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

ToolParserName = Literal["hermes", "llama3_json", "mistral"]
TOOL_PARSERS: tuple[ToolParserName, ...] = ("hermes", "llama3_json", "mistral")

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """A call from a decoded ``{"name": ..., "arguments"/"parameters": ...}`` object (None if it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_suffix(text: str, marker: str) -> int:
    """Where a suffix of ``text`` that is a proper prefix of ``marker`` starts (``len(text)`` if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


class ToolParser:
    """A syntax family's tool calls (subclasses set ``marker`` and implement :meth:`calls`)."""

    name: ClassVar[ToolParserName]
    marker: ClassVar[str]

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts that may be special tokens the detokenizer drops: the caller keeps them in the text."""
        return (self.marker,)

    def start(self, text: str) -> int | None:
        """Where the call section starts in ``text`` (None: no call so far)."""
        i = text.find(self.marker)
        return None if i < 0 else i

    def undecided_from(self, text: str) -> int:
        """Before :meth:`start` finds a section: where the tail that could still become a marker begins."""
        return partial_suffix(text, self.marker)

    def calls(self, section: str, finished: bool) -> list[ParsedCall] | None:
        """The calls of ``section`` (which starts at the marker): complete ones so far; None at the end when the
        section holds no call that parses (the answer is then content)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    END = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def calls(self, section: str, finished: bool) -> list[ParsedCall] | None:
        out = []
        for m in self._BLOCK.finditer(section):
            closed = m.group(0).endswith(self.END)
            if not closed and not finished:
                break
            try:
                call = _call(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:
                break  # a malformed block ends the calls (those before it stand)
            out.append(call)
        return out if out or not finished else None


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    marker = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.marker) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def undecided_from(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.marker.startswith(stripped):
            return 0  # nothing but whitespace, or the beginning of the tag: content or a call, not known yet
        return len(text)

    def calls(self, section: str, finished: bool) -> list[ParsedCall] | None:
        if not finished:
            return []  # a JSON answer is only known to be a call once it is complete
        body = section.removeprefix(self.marker).strip()
        out = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except ValueError:
                return None
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return None
            out.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return out or None


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.marker, self.ARGS)

    def calls(self, section: str, finished: bool) -> list[ParsedCall] | None:
        if not finished:
            return []
        parts = [p.strip() for p in section.split(self.marker)[1:]]
        out: list[ParsedCall] = []
        for part in parts:
            if part.startswith("["):  # v3: one JSON list of calls
                try:
                    value, _ = _DECODER.raw_decode(part)
                except ValueError:
                    return out or None
                calls = [_call(v) for v in (value if isinstance(value, list) else [value])]
            elif self.ARGS in part:  # v11: name[ARGS]{...}
                name, _, args = part.partition(self.ARGS)
                try:
                    value, _ = _DECODER.raw_decode(args.strip())
                except ValueError:
                    return out or None
                calls = [_call({"name": name.strip(), "arguments": value})]
            else:
                return out or None
            if any(c is None for c in calls):
                return out or None
            out += [c for c in calls if c is not None]
        return out or None


_PARSERS: dict[ToolParserName, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def make_tool_parser(name: ToolParserName) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return _PARSERS[name]()


def detect_tool_parser(chat_template: str | None) -> ToolParserName | None:
    """The syntax family a chat template teaches its model (None: the template shows no tool-call syntax)."""
    if not chat_template:
        return None
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or ("<|start_header_id|>" in chat_template and "tools" in chat_template):
        return "llama3_json"
    return None
