"""Tool calls the way agent frameworks make them (``tool_choice`` ``"auto"``, the default with tools, and
``"none"``), in each syntax family's own format, ``reasoning_content`` of think tags and ``chat_template_kwargs``:
the parsers on texts, then the server with the ``openai`` client over the tiny model and a template of each family
(the model's text is forced by ``structured_outputs`` so that what it "decides" is known)."""

# ruff: noqa: F811  (a pytest fixture imported from tests/server_helpers.py is used as a parameter)
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from leapdecode import LLM
from leapdecode.server.api_server import build_app
from leapdecode.server.async_engine import ChoiceSnapshot
from leapdecode.server.chat_output import ChatOutputConfig, ChatOutputParser, ChatOutputStream, has_think_tags
from leapdecode.server.routes.chat import AnswerText
from leapdecode.server.tool_parsers import ParsedCall, detect_tool_parser, make_tool_parser
from tests.chat_templates import HERMES_THINK, LLAMA3_JSON, MISTRAL
from tests.conftest import assert_no_leaks
from tests.server_helpers import live_server, one_torch_thread, sync_client  # noqa: F401 (one_torch_thread: a fixture)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


# ------------------------------------------------------------------------------------------------ parsers


def test_parser_chosen_from_the_template() -> None:
    assert detect_tool_parser(HERMES_THINK) == "hermes" and has_think_tags(HERMES_THINK)
    assert detect_tool_parser(LLAMA3_JSON) == "llama3_json" and not has_think_tags(LLAMA3_JSON)
    assert detect_tool_parser(MISTRAL) == "mistral"
    assert detect_tool_parser("{{ messages[0].content }}") is None and detect_tool_parser(None) is None
    assert ChatOutputConfig("none").tool_parser(HERMES_THINK) is None
    assert ChatOutputConfig("mistral", "none").tool_parser(HERMES_THINK) == "mistral"
    assert not ChatOutputConfig(reasoning_parser="none").reasoning(HERMES_THINK)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ChatOutputConfig("pythonic")  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "text", "content", "calls"), [
    ("hermes", "Let me look.\n" + HERMES_CALL, "Let me look.", [PARIS]),
    ("hermes", HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo"), "",
     [PARIS, ParsedCall("get_weather", '{"city": "Oslo"}')]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [PARIS]),  # unclosed end
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", "No call here.", "No call here.", []),
    ("llama3_json", LLAMA3_CALL, "", [PARIS]),
    ("llama3_json", "<|python_tag|>" + LLAMA3_CALL + "; " + LLAMA3_CALL, "", [PARIS, PARIS]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
    ("mistral", MISTRAL_CALL, "", [PARIS]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Sure.", [PARIS]),
    ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
])
def test_parsers(name, text: str, content: str, calls: list[ParsedCall]) -> None:
    answer = ChatOutputParser(make_tool_parser(name), reasoning=False).parse(text, True)
    assert (answer.content, answer.calls) == (content, calls)


def test_reasoning_split() -> None:
    p = ChatOutputParser(None, reasoning=True)
    a = p.parse("<think>\nThe user wants X.\n</think>\n\nHere is X.", True)
    assert (a.reasoning, a.content) == ("\nThe user wants X.\n", "Here is X.")
    assert p.parse("Plain answer.", True).reasoning is None
    cut = p.parse("<think>still thinking", True)  # cut short by max_tokens: all of it is thinking
    assert (cut.reasoning, cut.content) == ("still thinking", "")
    opened = ChatOutputParser(None, reasoning=True, opened=True)  # the prompt ended in <think> (DeepSeek-R1)
    assert opened.parse("hmm</think>Answer", True).reasoning == "hmm"


@pytest.mark.parametrize(("name", "text"), [
    ("hermes", "<think>Paris, so get_weather.</think>\n\nLet me look.\n" + HERMES_CALL + "\n" + HERMES_CALL),
    ("hermes", "<think>no tools needed</think>It is <b>sunny</b> < 30 degrees."),
    ("llama3_json", LLAMA3_CALL),
    ("llama3_json", "  <not a tag> then text"),
    ("mistral", "Sure. " + MISTRAL_CALL),
])
def test_stream_deltas_add_up_to_the_answer(name: str, text: str) -> None:
    parser = ChatOutputParser(make_tool_parser(name), reasoning=True)
    final = parser.parse(text, True)
    rng = random.Random(0)
    for _ in range(20):  # random chunkings of the same text
        stream = ChatOutputStream(parser, hold=2)
        reasoning, content, calls = "", "", []
        cuts = sorted(rng.sample(range(1, len(text)), 8)) + [len(text)]
        for cut in cuts:
            parts = stream.update(text[:cut], cut == len(text))
            reasoning += parts.reasoning
            content += parts.content
            calls += parts.calls
        assert (reasoning or None, content) == (final.reasoning, final.content)
        assert [c for _, c in calls] == final.calls and [i for i, _ in calls] == list(range(len(final.calls)))


def test_special_token_markers_are_put_back(tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})  # as in Mistral's vocabulary
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    body = tok.encode('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', add_special_tokens=False)
    ids = (marker, *body)
    text = tok.decode(ids, skip_special_tokens=True)  # what the engine's detokenizer gives: the marker is gone
    assert "[TOOL_CALLS]" not in text
    c = ChoiceSnapshot(index=0, text=text, token_ids=ids, finish_reason="stop", stop_reason=None)
    restored = AnswerText(tok, make_tool_parser("mistral"))(c)
    assert restored == "[TOOL_CALLS]" + text
    assert ChatOutputParser(make_tool_parser("mistral"), False).parse(restored, True).calls == [PARIS]


# ------------------------------------------------------------------------------------------------- server


def forced(text: str) -> dict:
    """``extra_body`` that makes the model write exactly ``text`` (each character a regex literal)."""
    pattern = "".join(
        c if c.isalnum() or c == " " else "\\n" if c == "\n" else f"\\{c}" if c in "]\\^-" else f"[{c}]"
        for c in text
    )
    return {"structured_outputs": {"regex": pattern}}


@pytest.fixture(scope="module")
def tool_llm(tiny_model_dir, one_torch_thread) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=128)
    yield llm
    assert_no_leaks(llm)


@contextmanager
def serving(llm: LLM, template: str | None, **config) -> Iterator[openai.OpenAI]:
    tok = llm.get_tokenizer()
    before = tok.chat_template
    if template is not None:
        tok.chat_template = template
    try:
        with live_server(build_app(llm, chat_output=ChatOutputConfig(**config))) as base:
            yield sync_client(base)
    finally:
        tok.chat_template = before


def stream_answer(c: openai.OpenAI, **kw) -> tuple[str, str, list, list[str]]:
    reasoning, content, calls, reasons = "", "", [], []
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            reasons += [ch.finish_reason] if ch.finish_reason else []
    return reasoning, content, calls, reasons


def test_hermes_agent_loop(tool_llm: LLM) -> None:
    """An agent's two turns: the model calls the tool (tools sent, tool_choice left to its default "auto"), the
    client runs it and sends the result back, the model answers in text."""
    thought = "<think>Paris: call get_weather.</think>\n\nLet me look.\n" + HERMES_CALL
    with serving(tool_llm, HERMES_THINK) as c:
        kw = dict(model="default", messages=USER, tools=TOOLS, temperature=0, max_tokens=96, extra_body=forced(thought))
        out = c.chat.completions.create(**kw)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.model_extra["reasoning_content"] == "Paris: call get_weather."
        assert choice.message.content == "Let me look."
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        reasoning, content, calls, reasons = stream_answer(c, **kw)
        assert (reasoning, content, reasons) == ("Paris: call get_weather.", "Let me look.", ["tool_calls"])
        assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [
            (0, "get_weather", call.function.arguments)]
        # the tool's result goes back; the template renders the call and the result, the model answers
        history = USER + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
        ]
        final = c.chat.completions.create(model="default", messages=history, tools=TOOLS, temperature=0,
                                          max_tokens=32, extra_body=forced("<think>ok</think>It is sunny."))
        assert final.choices[0].finish_reason == "stop" and final.choices[0].message.content == "It is sunny."
        assert final.choices[0].message.tool_calls is None
        assert final.usage.prompt_tokens > out.usage.prompt_tokens  # the call and its result were in the prompt


def test_chat_template_kwargs(tool_llm: LLM) -> None:
    with serving(tool_llm, HERMES_THINK) as c:
        kw = dict(model="default", messages=USER, temperature=0, max_tokens=2)
        thinking = c.chat.completions.create(**kw)
        closed = c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        # the template closes an empty think block in the prompt when thinking is off
        assert closed.usage.prompt_tokens > thinking.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="not allowed") as e:
            c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"tokenize": False}})
        assert e.value.body["param"] == "chat_template_kwargs"


@pytest.mark.parametrize(("template", "call_text"), [(LLAMA3_JSON, LLAMA3_CALL), (MISTRAL, MISTRAL_CALL)])
def test_llama3_and_mistral_calls(tool_llm: LLM, template: str, call_text: str) -> None:
    with serving(tool_llm, template) as c:
        kw = dict(model="default", messages=USER, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=64)
        out = c.chat.completions.create(**kw, extra_body=forced(call_text))
        assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
        [call] = out.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        _, content, calls, reasons = stream_answer(c, **kw, extra_body=forced(call_text))
        assert (content, reasons, [t.function.name for t in calls]) == ("", ["tool_calls"], ["get_weather"])
        text = c.chat.completions.create(**kw, extra_body=forced("Sunny in Paris."))  # the model chose not to call
        assert text.choices[0].message.content == "Sunny in Paris." and text.choices[0].finish_reason == "stop"


def test_auto_without_tool_syntax_and_none(tool_llm: LLM) -> None:
    """The bundled template shows no tool-call syntax: "auto" is a 400 that says what to do; "none" is text."""
    with serving(tool_llm, None) as c:
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as e:
            c.chat.completions.create(model="default", messages=USER, tools=TOOLS, max_tokens=4)
        assert e.value.body["param"] == "tool_choice"
        out = c.chat.completions.create(model="default", messages=USER, tools=TOOLS, tool_choice="none",
                                        max_tokens=4, temperature=0)
        assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"
    # an explicit parser makes "auto" work with a template that leaves tools out
    with serving(tool_llm, None, tool_call_parser="hermes") as c:
        out = c.chat.completions.create(model="default", messages=USER, tools=TOOLS, max_tokens=64, temperature=0,
                                        extra_body=forced(HERMES_CALL))
        assert out.choices[0].message.tool_calls[0].function.name == "get_weather"


# --------------------------------------------------------------------------------------------- embeddings


def test_embeddings_match_hf_hidden_states(tool_llm: LLM, tiny_hf) -> None:
    """``/v1/embeddings``: the last token's final-norm hidden state (HF's last hidden state), normalised; ``mean``
    pools every position; float and base64 encodings; bad input is a 400."""
    import base64

    import numpy as np
    import torch

    tok = tool_llm.get_tokenizer()
    texts = ["The quick brown fox", "Paris is the capital of France."]
    with torch.no_grad():
        refs = [tiny_hf(torch.tensor([tok.encode(t)]), output_hidden_states=True).hidden_states[-1][0]
                for t in texts]
    for pooling in ("last", "mean"):
        with live_server(build_app(tool_llm, embedding_pooling=pooling)) as base:
            c = sync_client(base)
            out = c.embeddings.create(model="default", input=texts)
            assert out.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
            for ref, got in zip(refs, out.data):
                want = torch.nn.functional.normalize(ref[-1] if pooling == "last" else ref.mean(0), dim=0)
                assert torch.allclose(torch.tensor(got.embedding), want, atol=1e-4), pooling
            if pooling == "last":
                ids = c.embeddings.create(model="default", input=[tok.encode(texts[0])])  # token ids as input
                b64 = httpx.post(base + "/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"},
                                 trust_env=False, timeout=60).json()
                vec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype=np.float32)
                assert np.allclose(vec, ids.data[0].embedding, atol=1e-6)
                assert np.allclose(vec, out.data[0].embedding, atol=1e-6)
                short = c.embeddings.create(model="default", input=texts[0], dimensions=8).data[0].embedding
                assert len(short) == 8 and abs(float(np.linalg.norm(short)) - 1) < 1e-5
                for bad in ({"input": []}, {"input": [[10**9]]}, {"input": "x", "dimensions": 10**6}):
                    with pytest.raises(openai.BadRequestError):
                        c.embeddings.create(model="default", **bad)
