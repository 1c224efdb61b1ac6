"""The OpenAI protocol's sampling and output features, end to end through a live server and the ``openai`` client:
log-probabilities (checked against HF transformers' log_softmax), echo and prompt scoring, ``n``, penalties,
``logit_bias``, ``min_tokens``, stop strings, structured output (``response_format``) and tool calls."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.server.api_server import build_app
from tests.conftest import assert_no_leaks
from tests.server_helpers import live_server

PROMPT = "The quick brown fox jumps over"
CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]
# HF float32 on the same weights; the engine's kernels sum in another order (~1e-5 relative), so 2e-3 absolute is
# far above the noise and far below any real error (one position off, a missing temperature, a wrong token)
TOL = 2e-3


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base + "/v1", api_key="x", max_retries=0, http_client=httpx.Client(trust_env=False, timeout=120)
    )


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_hf: Any) -> Any:
    """``f(ids) -> [len(ids), vocab]`` log_softmax of HF transformers' logits for the same weights."""

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(tiny_hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


@pytest.fixture(scope="module")
def offline(llm: LLM) -> dict[str, Any]:
    """Answers computed offline before the server owns the engine."""
    pen = SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=1.5, frequency_penalty=0.8)
    return {
        "penalized": llm.generate(PROMPT, pen, use_tqdm=False)[0].outputs[0].text,
        "greedy": llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0],
    }


@pytest.fixture(scope="module")
def server(llm: LLM, offline: dict[str, Any]) -> Iterator[str]:
    with live_server(build_app(llm)) as base:
        yield base
    assert_no_leaks(llm)


def test_prompt_scoring_matches_hf_log_softmax(server: str, llm: LLM, hf_logprobs: Any) -> None:
    ids = llm.get_tokenizer().encode(PROMPT)
    ref = hf_logprobs(ids)
    out = client(server).completions.create(
        model="default", prompt=ids, max_tokens=0, echo=True, logprobs=3, temperature=1.0
    )
    lp = out.choices[0].logprobs
    assert out.choices[0].text == llm.get_tokenizer().decode(ids) and out.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=TOL)
        want_top = ref[i - 1].topk(3).indices.tolist()
        top = lp.top_logprobs[i]
        for t in want_top:
            assert top[llm.get_tokenizer().decode([t])] == pytest.approx(ref[i - 1, t].item(), abs=TOL)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_streamed_echo_and_logprobs_equal_the_whole_answer(server: str) -> None:
    c = client(server)
    kw: dict[str, Any] = dict(model="default", prompt=[PROMPT, "Hello"], max_tokens=6, temperature=0, echo=True,
                              logprobs=2)
    whole = c.completions.create(**kw)
    texts, tokens, offsets = ["", ""], [[], []], [[], []]
    for chunk in c.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.logprobs:
                tokens[ch.index] += ch.logprobs.tokens
                offsets[ch.index] += ch.logprobs.text_offset
    for i, ch in enumerate(whole.choices):
        assert texts[i] == ch.text and tokens[i] == ch.logprobs.tokens and offsets[i] == ch.logprobs.text_offset


def test_lm_eval_loglikelihood_request_shape(server: str, llm: LLM, hf_logprobs: Any) -> None:
    """Exactly what lm-evaluation-harness' local-completions sends for loglikelihood (token-id batches, echo,
    max_tokens 1, logprobs 1), parsed the way it parses the answer: continuation log-probabilities and greediness."""
    tok = llm.get_tokenizer()
    context, continuations = tok.encode("Paris is the capital of"), [" France", " the moon"]
    batch = [context + tok.encode(c, add_special_tokens=False) for c in continuations]
    body = {"model": "default", "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = httpx.post(server + "/v1/completions", json=body, trust_env=False, timeout=120).json()
    for choice, ids in zip(sorted(r["choices"], key=lambda c: c["index"]), batch, strict=True):
        ref = hf_logprobs(ids)
        ctxlen = len(context)
        got = choice["logprobs"]["token_logprobs"][ctxlen:-1]  # lm-eval drops the one generated token
        want = [ref[i - 1, ids[i]].item() for i in range(ctxlen, len(ids))]
        assert got == pytest.approx(want, abs=TOL)
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(max(t, key=t.get) == tok.decode([ids[i]]) for t, i in zip(tops, range(ctxlen, len(ids))))
        assert greedy == all(ref[i - 1].argmax().item() == ids[i] for i in range(ctxlen, len(ids)))
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 1


def test_chat_logprobs_greedy_and_streamed(server: str, llm: LLM, hf_logprobs: Any) -> None:
    c = client(server)
    out = c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content
    ids = llm.apply_chat_template(CHAT)
    tok = llm.get_tokenizer()
    generated = tok.encode(out.choices[0].message.content, add_special_tokens=False)
    ref = hf_logprobs(ids + generated)
    for i, entry in enumerate(content[: len(generated)]):
        row = ref[len(ids) + i - 1]
        assert entry.token == entry.top_logprobs[0].token  # greedy: the chosen token is the most likely
        assert entry.logprob == pytest.approx(row.max().item(), abs=TOL)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=TOL)
        assert entry.bytes == list(entry.token.encode())
    streamed = []
    for chunk in c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
    ):
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                streamed += ch.logprobs.content
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=TOL)


def test_n_choices_seeded_and_streamed(server: str) -> None:
    c = client(server)
    kw: dict[str, Any] = dict(model="default", prompt=PROMPT, max_tokens=10, temperature=1.0, n=3, seed=7)
    one = c.completions.create(**kw)
    assert [ch.index for ch in one.choices] == [0, 1, 2]
    assert len({ch.text for ch in one.choices}) > 1  # independently seeded samples
    assert [ch.text for ch in c.completions.create(**kw).choices] == [ch.text for ch in one.choices]
    assert one.usage.completion_tokens == 30
    texts = ["", "", ""]
    for chunk in c.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in one.choices]
    chat = c.chat.completions.create(model="default", messages=CHAT, max_tokens=6, temperature=1.0, n=2, seed=3)
    assert [ch.index for ch in chat.choices] == [0, 1]
    batch = c.completions.create(model="default", prompt=[PROMPT, "Hello"], max_tokens=4, n=2, seed=1)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]  # prompt i, sample j: index 2 * i + j


def test_penalties_bias_min_tokens_and_stop(server: str, llm: LLM, offline: dict[str, Any]) -> None:
    c = client(server)
    pen = c.completions.create(
        model="default", prompt=PROMPT, max_tokens=16, temperature=0, presence_penalty=1.5, frequency_penalty=0.8
    )
    assert pen.choices[0].text == offline["penalized"] != offline["greedy"].outputs[0].text
    eos = llm.engine.eos_token_ids[0]
    forced = c.completions.create(
        model="default", prompt=PROMPT, max_tokens=16, temperature=0, logit_bias={str(eos): 100},
        extra_body={"min_tokens": 5},
    )
    assert forced.usage.completion_tokens == 6 and forced.choices[0].finish_reason == "stop"  # 5, then the EOS
    banned = offline["greedy"].outputs[0].token_ids[0]
    other = c.completions.create(
        model="default", prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(banned): -100}
    )
    assert llm.get_tokenizer().encode(other.choices[0].text, add_special_tokens=False)[0] != banned
    text = offline["greedy"].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text[: text.find(stop)]
    kept = c.completions.create(
        model="default", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == cut + stop and kept.choices[0].finish_reason == "stop"
    assert c.completions.create(model="default", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]) \
        .choices[0].text == cut


def compact(llm: LLM, text: str) -> dict[str, float]:
    """A logit_bias favouring the tokens of ``text``: the JSON grammar allows whitespace between any two tokens, and
    a random tiny model, left alone, may choose it forever; favouring the JSON's own tokens makes it write compact
    JSON, so the test checks the server's handling and not a random model's taste."""
    return {str(t): 30.0 for t in set(llm.get_tokenizer().encode(text, add_special_tokens=False))}


def test_response_format_json(server: str, llm: LLM) -> None:
    c = client(server)
    out = c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=40, temperature=0, response_format={"type": "json_object"},
        logit_bias=compact(llm, "{}"),
    )
    assert json.loads(out.choices[0].message.content) == {}
    unbiased = c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=1, temperature=0, response_format={"type": "json_object"}
    )
    assert unbiased.choices[0].message.content.lstrip()[:1] in ("{", "")  # an object, never an array or scalar
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=60, temperature=0, logit_bias=compact(llm, '{"ok":true}'),
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"ok"} and isinstance(value["ok"], bool)
    choice = c.completions.create(
        model="default", prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].text in ("yes", "no")
    compact_schema = c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )
    assert json.loads(compact_schema.choices[0].message.content)["ok"] in (True, False)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model="default", messages=CHAT, max_tokens=4,
            extra_body={"structured_outputs": {"json": schema, "regex": "a+"}},
        )
    # grammars compile in a worker thread before the engine sees the request, never on the engine thread
    backend = llm.engine.structured_backend()
    real, threads = backend._compile_now, []
    backend._compile_now = lambda spec: (threads.append(threading.current_thread().name), real(spec))[1]
    try:
        c.completions.create(model="default", prompt=PROMPT, max_tokens=4, extra_body={"structured_outputs": {
            "regex": "[xyz]{2,9}"}})
    finally:
        del backend._compile_now
    assert threads and "leapdecode-engine" not in threads, threads
    # compiled before the engine sees the request: a grammar that does not compile is a 400 naming it
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        c.completions.create(model="default", prompt=PROMPT, max_tokens=4, extra_body={"structured_outputs": {
            "regex": "(unclosed"}})


TOOLS = [
    {"type": "function", "function": {"name": "set_mode", "description": "Switch the mode.", "parameters": {
        "type": "object", "properties": {"mode": {"enum": ["on", "off"]}}, "required": ["mode"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]


def test_tool_calls_required_and_named(server: str) -> None:
    c = client(server)
    out = c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=80, temperature=0, tools=TOOLS, tool_choice="required"
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("set_mode", "ping")
        args = json.loads(call.function.arguments)
        assert args == {} if call.function.name == "ping" else args["mode"] in ("on", "off")
    named = {"type": "function", "function": {"name": "set_mode"}}
    out = c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=80, temperature=0, tools=TOOLS, tool_choice=named
    )
    calls = out.choices[0].message.tool_calls
    # a forced (named) call finishes with "stop" in OpenAI's API; "required" with "tool_calls"
    assert out.choices[0].finish_reason == "stop" and [t.function.name for t in calls] == ["set_mode"]
    assert json.loads(calls[0].function.arguments)["mode"] in ("on", "off")
    streamed, reasons = [], []
    for chunk in c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=80, temperature=0, tools=TOOLS, tool_choice=named, stream=True
    ):
        for ch in chunk.choices:
            streamed += ch.delta.tool_calls or []
            reasons += [ch.finish_reason] if ch.finish_reason else []
    assert reasons == ["stop"]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("set_mode", calls[0].function.arguments)]
    text = c.chat.completions.create(
        model="default", messages=CHAT, max_tokens=4, temperature=0, tools=TOOLS, tool_choice="none"
    )
    assert text.choices[0].message.tool_calls is None and text.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="auto"):
        c.chat.completions.create(model="default", messages=CHAT, max_tokens=4, tools=TOOLS)
