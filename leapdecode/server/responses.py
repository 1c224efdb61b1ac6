"""OpenAI's Responses API (``POST /v1/responses``), the text case: bodies and their mapping onto a chat completion.

A request's ``input`` (a string: one user turn; or a list of messages, each ``{"role", "content"}`` with a string
or ``input_text`` / ``output_text`` parts, ``"type": "message"`` optional) after its ``instructions`` (a system
turn first) goes through the model's chat template as ``/v1/chat/completions`` would, with ``max_output_tokens``,
``temperature``, ``top_p`` (and the sampling extensions of the chat route). The answer is one ``message`` output
item with one ``output_text`` part; a generation cut by ``max_output_tokens`` is ``status: "incomplete"``.

Nothing is stored (``store: true`` is refused: there is no ``GET /v1/responses/{id}``), and the fields of the
other cases (tools, earlier responses, reasoning settings, non-text formats and inputs, background runs) are a 400
that names the field, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictStr, ValidationError

from leapdecode.server import protocol as P
from leapdecode.server.protocol import JsonInt

# field -> why it is refused when given (a value other than null, or than the listed harmless one)
UNSUPPORTED = {
    "tools": "tool calls are served by /v1/chat/completions",
    "previous_response_id": "responses are not stored; send the whole conversation as input",
    "conversation": "conversations are not stored; send the whole conversation as input",
    "reasoning": "reasoning settings are not supported",
    "include": "extra output data (include) is not supported",
    "prompt": "stored prompt templates are not supported",
    "max_tool_calls": "tool calls are served by /v1/chat/completions",
    "top_logprobs": "log-probabilities are served by /v1/chat/completions",
    "prompt_cache_key": "prompt cache keys are not supported (the prefix cache needs none)",
}
HARMLESS: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "include": ([],),
    "top_logprobs": (0,),
}


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | Annotated[list[InputText], Field(min_length=1)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (the text case); unknown fields are ignored, as in the other routes."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: StrictStr | None = None
    input: StrictStr | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: JsonInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=P.MAX_TEMPERATURE)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool | None = False
    store: StrictBool | None = None
    background: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto"] | None = None
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: StrictBool | None = None
    user: StrictStr | None = None
    # the chat route's sampling extensions (vLLM and leapdecode names)
    seed: JsonInt | None = None
    top_k: JsonInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    stop: StrictStr | list[StrictStr] | None = None
    speculative: StrictBool = True
    share_output: StrictBool | None = None

    def check_supported(self) -> None:
        """A 400 naming the first field of a case this route does not serve."""
        extra = self.model_extra or {}
        for name, why in UNSUPPORTED.items():
            value = extra.get(name)
            if value is not None and value not in HARMLESS.get(name, ()):
                raise P.APIError(f"{name} is not supported by /v1/responses: {why}", param=name)
        if self.store:
            raise P.APIError("store: true is not supported: responses are not stored (send store: false or omit "
                             "it; the answer says store: false)", param="store")
        if self.background:
            raise P.APIError("background responses are not supported", param="background")

    def messages(self) -> list[dict[str, Any]]:
        """The conversation: ``instructions`` as a system turn, then the input's turns."""
        turns: list[dict[str, Any]] = []
        if self.instructions is not None:
            turns.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*turns, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind != "message":
                raise P.APIError(f"input[{i}] is a {kind!r} item; /v1/responses takes messages only",
                                 param=f"input[{i}].type")
            try:
                message = InputMessage.model_validate(item)
            except ValidationError as e:
                err = e.errors()[0]
                loc = ".".join(str(x) for x in err.get("loc", ()))
                raise P.APIError(f"input[{i}].{loc}: {err.get('msg')} (the content parts served are input_text "
                                 "and output_text)", param=f"input[{i}]") from None
            role = "system" if message.role == "developer" else message.role  # as the chat route maps it
            turns.append({"role": role, "content": message.text()})
        return turns

    def as_chat(self) -> P.ChatCompletionRequest:
        """The same request as a chat completion (its validation applies: ``ValidationError``)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(), "max_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                                "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                                "stop": self.stop, "speculative": self.speculative, "share_output": self.share_output}
        return P.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The answer of ``POST /v1/responses`` (and the ``response`` of its stream's lifecycle events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    output: list[OutputMessage]
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    store: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    usage: ResponseUsage | None = None


class ResponseStreamEvent(BaseModel):
    """The ``data`` of one event of the ``POST /v1/responses`` stream: its ``type``, its ``sequence_number`` and the
    fields of that type (``response`` for the lifecycle events, ``item``, ``part``, ``delta``, ``text`` or
    ``message`` for the others)."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
    response: ResponseObject | None = None


def response_object(req: ResponsesRequest, rid: str, created: int, model: str, status: str,
                    output: list[OutputMessage], usage: ResponseUsage | None) -> ResponseObject:
    """The response ``rid`` of ``req`` in state ``status`` (``incomplete``: cut by ``max_output_tokens``)."""
    return ResponseObject(
        id=rid, created_at=created, status=status, model=model, instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p, output=output,
        metadata=req.metadata or {}, usage=usage,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
    )


def usage(u: P.Usage, cached: int) -> ResponseUsage:
    return ResponseUsage(input_tokens=u.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=u.completion_tokens, output_tokens_details=OutputTokensDetails(),
                         total_tokens=u.total_tokens)


def status_of(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish_reason == "length" else "completed"


__all__ = ["OutputMessage", "OutputText", "ResponseObject", "ResponseStreamEvent", "ResponsesRequest",
           "response_object", "status_of", "usage"]
