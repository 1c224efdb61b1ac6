"""Structured output and tool calls in OpenAI's request shapes, mapped onto the engine's grammar-constrained
generation (``StructuredOutputsParams``).

* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema"}}`` (JSON valid against the schema).
* ``structured_outputs`` (vLLM's extension): exactly one of ``json``, ``regex``, ``choice``, ``grammar`` (and
  ``disable_any_whitespace`` for compact JSON).
* ``tools`` + ``tool_choice``: ``"required"`` constrains the output to a JSON list of one or more calls
  ``[{"name": <a tool's name>, "parameters": <its parameters>}]``; a named function (``{"type": "function",
  "function": {"name"}}``) constrains it to that function's parameters (compact JSON either way). The answer
  carries them as ``tool_calls`` (``finish_reason: "tool_calls"``, ``"stop"`` for a named function). ``"none"``
  generates text (the tools are then not shown to the model). ``"auto"`` (the default when ``tools`` are given)
  lets the model decide, in its own tool-call syntax, which the parser chosen from its chat template reads
  (:mod:`leapdecode.server.tool_parsers`); a template without tool-call syntax makes it a 400 that says what to
  send instead, never silently text.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from leapdecode.sampling_params import StructuredOutputsParams


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def schema(self) -> dict[str, Any]:
        """The JSON schema of the function's arguments (a function without parameters takes an empty object)."""
        return self.parameters or {"type": "object", "properties": {}}


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr = "response"
    description: StrictStr | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` request field (one of the fields)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    disable_any_whitespace: StrictBool = False


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def response_format_params(fmt: ResponseFormat) -> StructuredOutputsParams | None:
    """The constraint ``response_format`` asks for (``ValueError`` when a ``json_schema`` has no schema)."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise ValueError('response_format of type "json_schema" needs a "json_schema": {"name", "schema"} object')
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def structured_outputs_params(req: StructuredOutputsRequest) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=req.json_,
        regex=req.regex,
        choice=req.choice,
        grammar=req.grammar,
        disable_any_whitespace=req.disable_any_whitespace,
    )


ChosenTool = Tool | Literal["required", "auto"] | None


def chosen_tool(tools: list[Tool], choice: ToolChoice | None) -> ChosenTool:
    """Which calls the request's tools allow: one named tool, ``"required"`` (any one or more, constrained),
    ``"auto"`` (the model decides, in its own syntax) or None (plain text). ``ValueError`` for a named function that
    is not among ``tools``."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise ValueError(f"tool_choice {choice!r} needs tools")
    if choice in ("auto", "required"):
        return choice
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool
    names = ", ".join(t.function.name for t in tools)
    raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools ({names})")


def tool_constraint(tools: list[Tool], chosen: Tool | Literal["required"]) -> StructuredOutputsParams:
    """The engine constraint of a tool call: its JSON schema, written compactly (no free whitespace, which a small
    model may otherwise emit forever; the arguments are handed on as JSON text anyway)."""
    return StructuredOutputsParams(json=tool_call_schema(tools, chosen), disable_any_whitespace=True)


def tool_call_schema(tools: list[Tool], chosen: Tool | Literal["required"]) -> dict[str, Any]:
    """The JSON schema the output is constrained to for ``chosen``."""
    if isinstance(chosen, Tool):
        return chosen.function.schema()
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": t.function.schema()},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls} if len(calls) > 1 else calls[0]}


def tool_call(name: str, arguments: str) -> ToolCall:
    """One call as the answer carries it, with a fresh id."""
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments))


def parse_tool_calls(text: str, chosen: Tool | Literal["required"]) -> list[ToolCall] | None:
    """The calls in a constrained output, or None when it is not complete JSON (generation hit ``max_tokens``)."""
    try:
        value = json.loads(text)
        if isinstance(chosen, Tool):
            pairs = [(chosen.function.name, value)]
        else:
            pairs = [(call["name"], call["parameters"]) for call in value]
        return [tool_call(name, json.dumps(args)) for name, args in pairs]
    except (ValueError, RecursionError):  # (a schema allowing any value lets the output nest past the parser)
        return None
