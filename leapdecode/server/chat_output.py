"""One chat answer split into what OpenAI's API returns separately: ``reasoning_content`` (the model's thinking
between ``<think>`` and ``</think>``, for templates with think tags), ``content`` and ``tool_calls`` (the model's own
tool-call syntax, :mod:`leapdecode.server.tool_parsers`, under ``tool_choice: "auto"``).

:class:`ChatOutputParser` splits a text; :class:`ChatOutputStream` turns a growing text into stream deltas.

Invariant: the reasoning and content deltas sent so far are prefixes of the final answer's reasoning and content
(an unfinished text only yields what no later token can change: a tail that could still become ``</think>``, a
tool-call marker or a stop string is held back, and so is trailing whitespace before a possible call); each tool call
is sent once, whole, when its syntax closes (or when the answer ends).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from leapdecode.server.tool_parsers import (
    TOOL_PARSERS,
    ParsedCall,
    ToolParser,
    ToolParserName,
    detect_tool_parser,
    partial_suffix,
)

THINK_START = "<think>"
THINK_END = "</think>"

# vLLM's option names: "auto" reads the chat template; qwen3 and deepseek_r1 both mean think tags (whether the
# prompt already opened the tag is read from the prompt)
ToolCallParserOption = Literal["auto", "none", "hermes", "llama3_json", "mistral"]
ReasoningParserOption = Literal["auto", "none", "qwen3", "deepseek_r1"]
TOOL_CALL_PARSER_OPTIONS: tuple[str, ...] = get_args(ToolCallParserOption)
REASONING_PARSER_OPTIONS: tuple[str, ...] = get_args(ReasoningParserOption)


def has_think_tags(chat_template: str | None) -> bool:
    """Whether a chat template writes think tags (Qwen3, DeepSeek-R1 and their kin)."""
    return bool(chat_template) and THINK_END in chat_template


@dataclass(frozen=True)
class ChatOutputConfig:
    """How the server splits chat answers: ``tool_call_parser`` for ``tool_choice: "auto"`` and
    ``reasoning_parser`` for ``reasoning_content`` (``"auto"``: chosen from the chat template)."""

    tool_call_parser: ToolCallParserOption = "auto"
    reasoning_parser: ReasoningParserOption = "auto"

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_CALL_PARSER_OPTIONS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSER_OPTIONS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSER_OPTIONS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_OPTIONS)}, got "
                             f"{self.reasoning_parser!r}")

    def tool_parser(self, chat_template: str | None) -> ToolParserName | None:
        if self.tool_call_parser == "auto":
            return detect_tool_parser(chat_template)
        if self.tool_call_parser == "none":
            return None
        assert self.tool_call_parser in TOOL_PARSERS
        return self.tool_call_parser

    def reasoning(self, chat_template: str | None) -> bool:
        if self.reasoning_parser == "auto":
            return has_think_tags(chat_template)
        return self.reasoning_parser != "none"


@dataclass
class ChatAnswer:
    reasoning: str | None = None
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class ChatOutputParser:
    """Splits an answer. ``tools``: the tool-call parser (None: no calls are parsed); ``reasoning``: split think
    tags off; ``opened``: the prompt itself ended in ``<think>`` (the answer starts inside the thinking)."""

    def __init__(self, tools: ToolParser | None, reasoning: bool, opened: bool = False) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.opened = opened

    def split_reasoning(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        """``(reasoning so far, the text after it)``; the text after is None while the answer is still thinking
        (or could still be starting to)."""
        start = 0
        if not self.opened:
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                start = len(text) - len(stripped) + len(THINK_START)
            elif not finished and THINK_START.startswith(stripped):
                return None, None  # "", " " or "<thi": thinking or not, not known yet
            else:
                return None, text
        body = text[start:]
        end = body.find(THINK_END)
        if end >= 0:
            return body[:end], body[end + len(THINK_END) :].lstrip()
        return (body if finished else body[: partial_suffix(body, THINK_END)]), None

    def parse(self, text: str, finished: bool) -> ChatAnswer:
        """The answer ``text`` holds (an unfinished one: the part no later token can change)."""
        reasoning, rest = self.split_reasoning(text, finished) if self.reasoning else (None, text)
        if rest is None:
            return ChatAnswer(reasoning=reasoning)
        if self.tools is None:
            return ChatAnswer(reasoning=reasoning, content=rest)
        start = self.tools.start(rest)
        if start is None:
            content = rest if finished else rest[: self.tools.undecided_from(rest)].rstrip()
            return ChatAnswer(reasoning=reasoning, content=content)
        calls = self.tools.calls(rest[start:], finished)
        if calls is None:  # the calls do not parse: the whole answer is text
            return ChatAnswer(reasoning=reasoning, content=rest)
        return ChatAnswer(reasoning=reasoning, content=rest[:start].rstrip(), calls=calls)


@dataclass
class ChatDeltaParts:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, ParsedCall]] = field(default_factory=list)  # (index among the answer's calls, call)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatOutputStream:
    """One choice's stream: :meth:`update` with the cumulative text gives what is new since the last update.
    ``hold``: characters kept back at the end of an unfinished text (a stop string could be completing there)."""

    def __init__(self, parser: ChatOutputParser, hold: int = 0) -> None:
        self.parser = parser
        self.hold = hold
        self.reasoning = ""
        self.content = ""
        self.num_calls = 0

    def update(self, text: str, finished: bool) -> ChatDeltaParts:
        if not finished:
            text = text[: max(0, len(text) - self.hold)]
            while text.endswith("\ufffd"):  # a character still missing bytes
                text = text[:-1]
        answer = self.parser.parse(text, finished)
        parts = ChatDeltaParts()
        reasoning = answer.reasoning or ""
        if reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            parts.reasoning = reasoning[len(self.reasoning) :]
            self.reasoning = reasoning
        if answer.content.startswith(self.content) and len(answer.content) > len(self.content):
            parts.content = answer.content[len(self.content) :]
            self.content = answer.content
        parts.calls = list(enumerate(answer.calls))[self.num_calls :]
        self.num_calls = max(self.num_calls, len(answer.calls))
        return parts
