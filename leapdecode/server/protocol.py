"""Request and response bodies of the OpenAI-compatible API (the subset leapdecode serves).

Request models are *lenient about unknown fields* (ignored: OpenAI clients send many optional ones) but
*strict about the fields they know*: a wrong type or an out-of-range value fails validation, which the server
turns into a 400 with an OpenAI-style error body. Number fields take JSON numbers only (``"0.5"`` or ``true`` for
``temperature`` is a 400; ``0`` and ``1`` are fine; an integer field takes ``4.0`` as 4 but not ``4.5``),
``temperature`` is capped at 2 as in OpenAI's API, ``stop`` holds at most 64 strings, and every message except an
assistant's must have content. Fields the engine cannot honour (``best_of`` other than ``n``, ``suffix``)
are rejected explicitly rather than silently ignored.

Response models mirror OpenAI's JSON; ``Usage`` adds leapdecode's speculative-decoding counters
(``num_draft_tokens``, ``num_accepted_tokens``, ``mean_accepted_tokens``) next to the standard token counts.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RootModel,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from leapdecode.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, StructuredOutputsParams
from leapdecode.server.logprobs import ChatLogprobs, CompletionLogprobs
from leapdecode.server.tools import (
    ChosenTool,
    ResponseFormat,
    StructuredOutputsRequest,
    Tool,
    ToolCall,
    ToolChoice,
    chosen_tool,
    response_format_params,
    structured_outputs_params,
)

# ------------------------------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}`` — the body of every 4xx/5xx answer."""

    error: ErrorInfo


class APIError(Exception):
    """An error to report to the client: HTTP ``status`` plus the OpenAI error fields.

    ``headers`` are added to the response (e.g. ``Retry-After`` on 503)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


# ----------------------------------------------------------------------------------------------- requests


def _integral_float_to_int(v: Any) -> Any:
    # JSON has one number type: 4.0 is the integer 4 to JSON Schema (and so to /openapi.json's "integer") and to
    # JavaScript clients, whose JSON.stringify cannot tell them apart; 4.5, inf, NaN, "4" and true stay errors
    if type(v) is float and v.is_integer():
        return int(v)
    return v


# an integer field: a JSON integer, or a float with no fractional part; never a string or a boolean
JsonInt = Annotated[StrictInt, BeforeValidator(_integral_float_to_int)]

MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's cap; the engine would take more, but clients must not depend on that
MIN_TOP_P = 1e-6
# the engine scans every stop string after every token: 200,000 of them (well within the body limit) cost ~50 ms
# per token of the one engine thread, stalling every other request; OpenAI allows 4, 64 serves any real use
MAX_STOP_STRINGS = 64
MAX_TOKEN_ID_DIGITS = 12  # a logit_bias key longer than this is no token id of any vocabulary


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class _SamplingRequest(BaseModel):
    """Fields shared by chat and text completions. Ranges match ``SamplingParams`` (``temperature`` also OpenAI's).

    Float fields are ``StrictFloat``: a plain ``float`` would coerce ``"0.5"`` and ``true``, hiding client bugs;
    strict mode still takes JSON integers (``"temperature": 0``)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: StrictStr | None = None
    max_tokens: JsonInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    n: JsonInt | None = Field(default=None, ge=1, le=MAX_N)
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool | None = False  # null (as OpenAI's API allows) means false
    stream_options: StreamOptions | None = None
    seed: JsonInt | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    user: StrictStr | None = None
    # extensions (vLLM names)
    top_k: JsonInt | None = None
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(default=None, ge=0.01, le=100.0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[JsonInt] | None = None
    logit_bias: dict[StrictStr, Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    # extensions (vLLM names)
    min_tokens: JsonInt = Field(default=0, ge=0)
    include_stop_str_in_output: StrictBool = False
    structured_outputs: StructuredOutputsRequest | None = None
    # leapdecode extension: ``false`` opts this request out of speculative decoding
    speculative: StrictBool = True
    # leapdecode extension: whether the output may join what other requests draft from (the suffix method's global
    # tree); null: the server's default (``leapdecode serve --no-share-output`` makes it false)
    share_output: StrictBool | None = None

    def check_supported(self) -> None:
        """Raise ``APIError`` for field combinations that leapdecode does not serve."""
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs:
            raise APIError("pass response_format or structured_outputs, not both", param="structured_outputs")

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint of ``response_format`` / ``structured_outputs`` (a 400 when malformed)."""
        try:
            if self.structured_outputs is not None:
                return structured_outputs_params(self.structured_outputs)
            if self.response_format is not None:
                return response_format_params(self.response_format)
        except ValueError as e:
            param = "structured_outputs" if self.structured_outputs is not None else "response_format"
            raise APIError(str(e), param=param) from None
        return None

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids (OpenAI's keys are the ids as strings)."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            # ASCII digits only: str.isdigit() also takes "²" (int() refuses it) and other scripts' digits; a key
            # longer than any vocabulary's ids would hit int()'s digit limit
            if not (key.isascii() and key.isdigit()) or len(key) > MAX_TOKEN_ID_DIGITS:
                raise APIError(f"logit_bias keys must be token ids (digits), got {key[:32]!r}", param="logit_bias")
            bias[int(key)] = value
        return bias

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, default_max_tokens: int, **extra: Any) -> SamplingParams:
        """Build the engine's ``SamplingParams`` (``extra``: what the route adds, e.g. log-probabilities or a tool
        constraint); a ``ValueError`` names the offending field."""
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        top_p = 1.0 if self.top_p is None else float(self.top_p)
        kw: dict[str, Any] = {
            "max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
            # below 1e-5 the engine's float32 sampler can overflow to NaN: that is greedy anyway (as in vLLM)
            "temperature": 0.0 if temperature < MIN_TEMPERATURE else temperature,
            # a top_p that rounds to 0 in float32 would drop every token; a tiny top_p keeps the top token
            "top_p": max(top_p, MIN_TOP_P),
            "stop": self.stop or None,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "speculative": self.speculative,
            "share_output": True if self.share_output is None else self.share_output,
            "n": self.n or 1,
            "min_tokens": self.min_tokens,
            "logit_bias": self.token_bias(),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_outputs": self.structured(),
        }
        for name in ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return SamplingParams(**{**kw, **extra})


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool message: which call it answers

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # as in OpenAI's API: only an assistant turn may omit its content (it had tool calls instead); a user
        # turn without content would otherwise reach the template as "" and be answered as if it said nothing
        if self.role != "assistant" and (self.content is None or self.content == []):
            got = "no content" if self.content is None else "an empty content list"
            raise ValueError(f"a {self.role!r} message needs content (a string or a non-empty list), got {got}")
        return self

    @model_validator(mode="after")
    def _arguments_parse(self) -> ChatMessage:
        # the chat template gets a call's arguments parsed (text that is not JSON as it is): JSON nested too deeply
        # to parse is refused here, a 400, rather than failing the template
        for call in self.tool_calls or []:
            try:
                json.loads(call.function.arguments)
            except ValueError:
                pass
            except RecursionError:
                raise ValueError("a tool call's arguments are JSON nested too deeply to parse") from None
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def _args(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # not JSON (or refused by ChatMessage already): the text as it came
        return call.function.arguments


def as_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the ``[{"role", "content", ...}]`` list the chat template expects (an assistant's tool calls
    with their arguments parsed, as HF templates expect them; a tool message with its ``tool_call_id``)."""
    conversation = []
    for m in messages:
        turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args(c)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        conversation.append(turn)
    return conversation


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JsonInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # vLLM's extension: extra variables for the chat template (e.g. Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # leapdecode extension: message text is tokenized as text, a special token's text never a control token
    escape_special_tokens: StrictBool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    def num_logprobs(self) -> int | None:
        """Top log-probabilities per generated token the engine must keep (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_constraint(self) -> ChosenTool:
        """The tool (or any of them, ``"required"``) the output must call, ``"auto"`` (the model may call one in
        its own syntax; a constraint on its text may apply too), or None for text."""
        try:
            chosen = chosen_tool(self.tools or [], self.tool_choice)
        except ValueError as e:
            raise APIError(str(e), param="tool_choice") from None
        if chosen not in (None, "auto") and self.structured() is not None:
            raise APIError("a tool call cannot also follow response_format or structured_outputs", param="tool_choice")
        return chosen

    def conversation(self) -> list[dict[str, Any]]:
        return as_conversation(self.messages)


# one prompt of /v1/completions: a text, or token ids
PromptInput = StrictStr | Annotated[list[JsonInt], Field(min_length=1)]
MAX_PROMPTS = 256  # prompts per /v1/completions request (each is one engine request)
# completions one /v1/completions request may ask for (prompts x n): each is an engine sequence holding its own
# copy of its prompt, so 256 prompts x n=128 would be 32,768 sequences from one body
MAX_CHOICES = 1024


class CompletionRequest(_SamplingRequest):
    # 0 scores the prompt (with echo): nothing is generated
    max_tokens: JsonInt | None = Field(default=None, ge=0)
    # a string, a list of token ids, or a batch of either (OpenAI's four forms)
    prompt: (
        StrictStr
        | Annotated[list[JsonInt], Field(min_length=1)]
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[Annotated[list[JsonInt], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    echo: StrictBool = False
    logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: JsonInt | None = None
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.n or 1):
            raise APIError("best_of is not supported (other than equal to n)", param="best_of")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if len(self.prompts()) * (self.n or 1) > MAX_CHOICES:
            raise APIError(
                f"{len(self.prompts())} prompts x n={self.n} asks for more than {MAX_CHOICES} completions in one "
                "request; split the batch",
                param="n",
            )
        if self.max_tokens == 0 and not self.echo:
            raise APIError("max_tokens 0 generates nothing: it is for scoring a prompt, with echo", param="max_tokens")

    def prompt_logprobs(self) -> int | None:
        """Top log-probabilities per prompt token the engine must keep: the prompt's own are reported with echo
        and logprobs (and computed for max_tokens 0, which the engine runs as prompt scoring)."""
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            return self.logprobs or 0
        return None


# ---------------------------------------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class Usage(BaseModel):
    """Token counts; ``mean_accepted_tokens``: output tokens per target forward (1.0 without speculation)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_tokens: float = 1.0


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # (vLLM's field) the thinking of templates with think tags
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(ToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the non-streaming body and each streamed chunk (``object`` is ``text_completion`` in both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "leapdecode"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------------------------ tokenize, version


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a text (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with a conversation: the tokens the chat template makes of it, ready for the assistant's
    turn (what ``/v1/chat/completions`` would feed the model)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    return_token_strs: StrictBool = False
    escape_special_tokens: StrictBool = False  # as in ChatCompletionRequest

    def conversation(self) -> list[dict[str, str]]:
        return as_conversation(self.messages)


class TokenizeRequest(RootModel[TokenizeChatRequest | TokenizeCompletionRequest]):
    """Either form of ``POST /tokenize``: ``messages`` (a conversation) or ``prompt`` (a text)."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[JsonInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """``GET /tokenizer_info`` (vLLM's endpoint): what a client needs to tokenize like the server (evaluation
    harnesses use it with ``/tokenize`` and ``/detokenize`` instead of loading the tokenizer themselves)."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    model_max_length: int


class VersionResponse(BaseModel):
    version: str
