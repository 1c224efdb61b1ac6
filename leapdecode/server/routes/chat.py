"""``POST /v1/chat/completions``: the conversation goes through the model's chat template.

``logprobs``/``top_logprobs`` add OpenAI's chat log-probabilities; ``response_format`` constrains the text;
``tools`` with ``tool_choice`` ``"required"`` or a named function constrain the output to the tools' JSON schemas
and answer ``tool_calls`` (``finish_reason: "tool_calls"``; ``"stop"`` for a named function, as OpenAI's API does;
see :mod:`leapdecode.server.tools`; streamed, the calls come whole in the choice's last chunk). Under
``tool_choice: "auto"`` (the default with tools) the model writes calls in its own syntax, read by the parser its
chat template implies; templates with think tags answer ``reasoning_content`` beside ``content``; both streamed as
deltas (:mod:`leapdecode.server.chat_output`). ``chat_template_kwargs`` are extra template variables.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import FastAPI, Request

from leapdecode.server import protocol as P
from leapdecode.server.async_engine import ChoiceSnapshot, StreamOutput
from leapdecode.server.chat_output import THINK_START, ChatOutputParser, ChatOutputStream
from leapdecode.server.logprobs import ChatLogprobs, LogprobFormatter
from leapdecode.server.openapi import route
from leapdecode.server.serving import COMPLETION_ERRORS, Serving, not_unicode
from leapdecode.server.streaming import Delta
from leapdecode.server.tool_parsers import TOOL_PARSERS, ToolParser, make_tool_parser
from leapdecode.server.tools import ChosenTool, Tool, ToolCall, parse_tool_calls, tool_call, tool_constraint

ToolConstraint = Tool | Literal["required"] | None
# prompt tokens read back to see whether the generation prompt opened a think block
THINK_PROMPT_TOKENS = 6


class AnswerText:
    """A choice's text for the output parser: the detokenized text, with the parser's markers put back where they
    are special tokens that detokenization drops (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``)."""

    def __init__(self, tokenizer: Any, parser: ToolParser | None) -> None:
        self.tokenizer = tokenizer
        self.markers: dict[int, str] = {}
        for marker in parser.markers if parser is not None else ():
            tid = tokenizer.convert_tokens_to_ids(marker)
            if isinstance(tid, int) and tid >= 0 and tid != tokenizer.unk_token_id \
                    and tokenizer.decode([tid], skip_special_tokens=True) == "":
                self.markers[tid] = marker

    def __call__(self, c: ChoiceSnapshot) -> str:
        if not self.markers or not any(t in self.markers for t in c.token_ids):
            return c.text
        parts, segment = [], []
        for t in c.token_ids:
            if t in self.markers:
                parts += [self.tokenizer.decode(segment, skip_special_tokens=True), self.markers[t]]
                segment = []
            else:
                segment.append(t)
        parts.append(self.tokenizer.decode(segment, skip_special_tokens=True))
        return "".join(parts)


def parsed_answer(parser: ChatOutputParser, text: str) -> P.ChatResponseMessage:
    """The message of a finished choice split by ``parser``."""
    answer = parser.parse(text, True)
    calls = [tool_call(call.name, call.arguments) for call in answer.calls] or None
    content = None if calls and not answer.content else answer.content
    return P.ChatResponseMessage(content=content, reasoning_content=answer.reasoning, tool_calls=calls)


def answer(c: ChoiceSnapshot, tool: ToolConstraint) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """``(content, tool_calls, finish_reason)`` of a finished choice: a complete constrained output becomes tool
    calls; one cut short by ``max_tokens`` stays text. As in OpenAI's API, the finish reason of calls is
    ``tool_calls`` under ``"required"`` and ``stop`` under a named function (the client forced that call)."""
    calls = parse_tool_calls(c.text, tool) if tool is not None else None
    if calls is None:
        return c.text, None, c.finish_reason
    return None, calls, "tool_calls" if tool == "required" else "stop"


def delta_content(delta: Delta, tool: ToolConstraint) -> tuple[dict[str, Any], str | None] | None:
    """A streamed chunk's ``delta`` object and finish reason; None when nothing goes out for ``delta`` (a tool
    call still being generated: the calls go out whole, once the choice has finished)."""
    content: dict[str, Any] = {"role": "assistant", "content": ""} if delta.first else {}
    reason = delta.finish_reason
    c = delta.choice
    if tool is not None and c is not None:
        if reason is None:
            return None
        text, calls, reason = answer(c, tool)
        if calls is not None:
            content["tool_calls"] = [
                P.ToolCallDelta(index=i, **call.model_dump()).model_dump() for i, call in enumerate(calls)
            ]
        elif text:
            content["content"] = text
    elif delta.text:
        content["content"] = delta.text
    return content, reason


class ChatReply:
    """One request's answer: its streamed chunks or its whole body, with its output parser (None: the text is the
    content as it is), its tool constraint and what each streamed choice has shown so far."""

    def __init__(self, serving: Serving, req: P.ChatCompletionRequest, route: ChatRoute,
                 parser: ChatOutputParser | None, tool: ToolConstraint, hold: int) -> None:
        self.serving, self.req, self.route, self.parser, self.tool, self.hold = serving, req, route, parser, tool, hold
        self.rid, self.ts = P.random_id("chatcmpl"), P.now_s()
        self.outputs: dict[int, ChatOutputStream] = {}

    def logprobs(self, c: ChoiceSnapshot, start: int) -> ChatLogprobs | None:
        if not self.req.logprobs or c.logprobs is None:
            return None
        return self.route.formatter.chat(c.token_ids[start:], c.logprobs[start:], self.req.top_logprobs or 0)

    def parsed_delta(self, delta: Delta) -> tuple[dict[str, Any], str | None] | None:
        """A streamed chunk's delta with the answer split by the output parser."""
        c = delta.choice
        if delta.first or c is None:
            return {"role": "assistant", "content": ""}, None
        assert self.parser is not None
        stream = self.outputs.setdefault(delta.index, ChatOutputStream(self.parser, self.hold))
        parts = stream.update(self.route.answer_text(c), c.finished)
        reason = ("tool_calls" if stream.num_calls else c.finish_reason) if c.finished else None
        if not parts and reason is None:
            return None
        content: dict[str, Any] = {}
        if parts.reasoning:
            content["reasoning_content"] = parts.reasoning
        if parts.content:
            content["content"] = parts.content
        if parts.calls:
            content["tool_calls"] = [
                P.ToolCallDelta(index=i, **tool_call(call.name, call.arguments).model_dump()).model_dump()
                for i, call in parts.calls
            ]
        return content, reason

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        got = self.parsed_delta(delta) if self.parser is not None else delta_content(delta, self.tool)
        if got is None:
            return None
        content, reason = got
        c = delta.choice
        lp = self.logprobs(c, 0 if self.tool is not None else delta.tokens_from) if c is not None else None
        d = P.ChatCompletionChunk(
            id=self.rid,
            created=self.ts,
            model=self.serving.name,
            choices=[P.ChatChunkChoice(index=delta.index, delta=P.ChatDelta(), logprobs=lp, finish_reason=reason)],
        ).model_dump()
        d["choices"][0]["delta"] = content
        return d

    def usage_chunk(self, usage: P.Usage) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(id=self.rid, created=self.ts, model=self.serving.name, choices=[], usage=usage)

    def body(self, finals: list[StreamOutput]) -> P.ChatCompletionResponse:
        choices = []
        for c in finals[0].choices:
            if self.parser is not None:
                message = parsed_answer(self.parser, self.route.answer_text(c))
                reason = "tool_calls" if message.tool_calls else c.finish_reason
            else:
                text, calls, reason = answer(c, self.tool)
                message = P.ChatResponseMessage(content=text, tool_calls=calls)
            lp = self.logprobs(c, 0)
            choices.append(P.ChatChoice(index=c.index, message=message, logprobs=lp, finish_reason=reason))
        return P.ChatCompletionResponse(
            id=self.rid, created=self.ts, model=self.serving.name, usage=self.serving.usage(finals), choices=choices
        )


class ChatRoute:
    """What every chat request of one server shares: the tokenizer, and the tool-call and reasoning syntax its chat
    template implies."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.tokenizer = serving.engine.tokenizer
        self.formatter = LogprobFormatter(self.tokenizer)
        template = getattr(self.tokenizer, "chat_template", None)
        self.parser_name = serving.chat_output.tool_parser(template)
        self.reasoning = serving.chat_output.reasoning(template)
        self.answer_text = AnswerText(self.tokenizer, make_tool_parser(self.parser_name) if self.parser_name else None)

    async def encode(self, req: P.ChatCompletionRequest, tool: ChosenTool) -> list[int]:
        conversation = req.conversation()
        shown = req.tools if req.tools and tool is not None else None  # "none": the model is not shown them
        tools = [t.model_dump(exclude_none=True) for t in shown] if shown else None
        try:
            # in a worker thread: the tokenizer releases the GIL, so the event loop keeps streaming meanwhile
            return await asyncio.to_thread(
                self.serving.llm.apply_chat_template, conversation, tools, req.chat_template_kwargs,
                req.escape_special_tokens,
            )
        except Exception as e:  # template errors (e.g. role order rules) are the caller's input
            why = not_unicode([m["content"] for m in conversation]) or str(e)
            param = "chat_template_kwargs" if "template variables" in str(e) else "messages"
            raise P.APIError(f"could not apply the chat template: {why}", param=param) from None

    def output_parser(self, tool: ChosenTool, tokens: list[int]) -> ChatOutputParser | None:
        """The parser of the answer's text (None: the text is the content as it is)."""
        if tool == "auto" and self.parser_name is None:
            raise P.APIError(
                'tool_choice "auto" (the default with tools) lets the model call tools in its own syntax, but this '
                "model's chat template shows no tool-call syntax; start the server with --tool-call-parser "
                f"({', '.join(TOOL_PARSERS)}) and a --chat-template that teaches it, or send tool_choice "
                '"required", a named function {"type": "function", "function": {"name": ...}} or "none"',
                param="tool_choice",
            )
        tools = make_tool_parser(self.parser_name) if tool == "auto" and self.parser_name else None
        if tool not in (None, "auto") or (tools is None and not self.reasoning):
            return None
        opened = self.reasoning and \
            self.tokenizer.decode(tokens[-THINK_PROMPT_TOKENS:]).rstrip().endswith(THINK_START)
        return ChatOutputParser(tools, self.reasoning, opened)

    async def chat_completions(self, request: Request) -> Any:
        serving = self.serving
        req: P.ChatCompletionRequest = await serving.parse(request, P.ChatCompletionRequest)
        serving.check_model(req.model)
        req.check_supported()
        chosen = req.tool_constraint()
        tool: ToolConstraint = None if chosen == "auto" else chosen
        with serving.admission() as admitted:  # the queue cap, before tokenizing and compiling
            tokens = await self.encode(req, chosen)
            parser = self.output_parser(chosen, tokens)
            extra: dict[str, Any] = {"logprobs": req.num_logprobs()}
            if tool is not None:
                try:
                    extra["structured_outputs"] = tool_constraint(req.tools or [], tool)
                except ValueError as e:  # e.g. parameters nested too deeply
                    raise P.APIError(str(e), param="tools") from None
            params = serving.sampling_params(req, len(tokens), "messages", **extra)
            hold = max((len(stop) for stop in params.stop_list), default=1) - 1
            streams = await serving.submit_all([(tokens, None)], [params], "messages", admitted)
        reply = ChatReply(serving, req, self, parser, tool, hold)
        return await serving.respond(request, streams, req.n or 1, bool(req.stream), req.include_usage(),
                                     reply.chunk, reply.usage_chunk, reply.body)


def add_routes(app: FastAPI, serving: Serving) -> None:
    chat = ChatRoute(serving)
    route(app, "POST", "/v1/chat/completions", P.ChatCompletionRequest, P.ChatCompletionResponse,
          COMPLETION_ERRORS, streams=True)(chat.chat_completions)
