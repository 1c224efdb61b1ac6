"""The OpenAI-compatible server against a live uvicorn on 127.0.0.1 (random free port), driven by the official
``openai`` client (sync and async, streaming and not) and raw httpx for malformed input.

Every server here binds to the loopback address only; clients ignore proxy settings (``trust_env=False``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.server.api_server import build_app
from leapdecode.server.async_engine import AsyncEngine
from leapdecode.server.defaults import DEFAULT_MAX_REQUEST_BYTES
from leapdecode.server.serve import add_cli, make_server
from leapdecode.server.streaming import TextDeltas
from tests.conftest import assert_no_leaks

HOST = "127.0.0.1"
MAX_TOKENS = 24
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there, who are you?"},
]
PROMPT = "The quick brown fox"
LOAD_TOPICS = [f"Tell me about topic number {i}." for i in range(6)]


# -------------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def live_server(app: Any) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on 127.0.0.1 and a free port; yields the base URL."""
    urls: list[str] = []
    server = make_server(app, HOST, 0, log_level="warning", on_ready=urls.append)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not urls:
        assert thread.is_alive(), "the server thread died during startup"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    assert urls[0].startswith(f"http://{HOST}:")
    try:
        yield urls[0]
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not shut down"


def sync_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


def async_client(base: str) -> openai.AsyncOpenAI:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    return openai.AsyncOpenAI(
        base_url=base + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(trust_env=False, timeout=60, limits=limits),
    )


def scrape(base: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}``."""
    text = httpx.get(base + "/metrics", trust_env=False).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def wait_for_metric(base: str, key: str, want: float, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base)
        if m.get(key) == want:
            return m
        assert time.monotonic() < deadline, f"{key} = {m.get(key)}, want {want}"
        time.sleep(0.05)


def greedy(max_tokens: int = MAX_TOKENS, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    # the tiny model's matmuls are far too small for a thread pool, which only adds contention on a busy box
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, one_torch_thread) -> LLM:
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


@pytest.fixture(scope="module")
def refs(llm: LLM) -> dict[str, Any]:
    """Offline answers, computed before the server owns the engine."""
    load = {t: llm.chat([{"role": "user", "content": t}], greedy(), use_tqdm=False)[0] for t in LOAD_TOPICS}
    return {
        "chat": llm.chat(CHAT, greedy(), use_tqdm=False)[0],
        "completion": llm.generate(PROMPT, greedy(), use_tqdm=False)[0],
        "load": {t: o.outputs[0].text for t, o in load.items()},
    }


@pytest.fixture(scope="module")
def server(llm: LLM, refs: dict[str, Any]) -> Iterator[str]:
    app = build_app(llm)
    with live_server(app) as base:
        yield base
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def model_name(tiny_model_dir) -> str:
    return tiny_model_dir.name


# ----------------------------------------------------------------------------------------------- unit bits


def test_text_deltas_hold_back_partial_utf8_and_stop_prefixes() -> None:
    d = TextDeltas([])
    assert d.update("ab\ufffd", False) == "ab"
    assert d.update("ab\u00e9c", False) == "\u00e9c"
    assert d.update("ab\u00e9c\ufffd", True) == "\ufffd"  # a genuine replacement char at the end is sent
    d = TextDeltas(["STOP", "x"])
    assert d.update("hello ST", False) == "hello"  # "ST" (or "hello"'s tail) might start a stop string
    assert d.update("hello STO", False) == " "
    assert d.update("hello ", True) == ""  # the engine cut the stop string: nothing was sent that it removed
    assert d.sent == "hello "


def test_serve_cli_arguments() -> None:
    parser = argparse.ArgumentParser(prog="leapdecode")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve"])
    assert (args.host, args.port, args.max_queue, args.model, args.speculative_config) == (
        "127.0.0.1",
        8000,
        256,
        None,
        None,
    )
    assert args.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 8 * 1024 * 1024
    args = parser.parse_args(
        ["serve", "--port", "0", "--max-queue", "4", "--speculative-config", '{"method": "ngram"}']
        + ["--max-request-bytes", "1000"]
    )
    assert (args.port, args.max_queue, args.speculative_config) == (0, 4, {"method": "ngram"})
    assert args.max_request_bytes == 1000
    assert callable(args.func)


def test_async_engine_generate_abort_and_refusals(tiny_model_dir, one_torch_thread) -> None:
    small = LLM(model=str(tiny_model_dir), kv_cache_blocks=32)
    ids = small.engine.tokenizer.encode(PROMPT)
    want = small.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0].outputs[0].text

    async def main() -> None:
        engine = AsyncEngine(small.engine, max_queue=8)
        engine.start()
        try:
            outs = [o async for o in engine.generate(ids, greedy())]
            assert outs[-1].finished and outs[-1].choices[0].text == want
            assert all(not o.finished for o in outs[:-1])
            async for _ in engine.generate(ids, greedy(500, ignore_eos=True)):
                break  # leaving early aborts
            with pytest.raises(ValueError, match="context"):
                await engine.add_request([5] * 2000, greedy())
            with pytest.raises(ValueError, match="KV blocks"):
                await engine.add_request(ids, greedy(1000))
            for _ in range(200):
                if engine.gauges.kv_blocks_in_use == 0 and not small.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert engine.num_queued == 0
        finally:
            engine.stop()

    asyncio.run(main())
    assert_no_leaks(small)


# --------------------------------------------------------------------------------------------- live server


def test_health_models_and_metrics(server: str, model_name: str) -> None:
    assert httpx.get(server + "/health", trust_env=False).json() == {"status": "ok"}
    client = sync_client(server)
    assert [m.id for m in client.models.list()] == [model_name]
    m = scrape(server)
    assert m["leapdecode_kv_blocks_total"] == 256 and m["leapdecode_kv_blocks_in_use"] == 0
    for name in (
        "leapdecode_queue_length",
        "leapdecode_mean_accepted_tokens",
        "leapdecode_draft_tokens_total",
        "leapdecode_accepted_tokens_total",
        "leapdecode_prompt_tokens_total",
        "leapdecode_generation_tokens_total",
    ):
        assert name in m, name


def test_chat_sync_stream_equals_nonstream_equals_offline(server: str, model_name: str, refs: dict) -> None:
    ref = refs["chat"]
    client = sync_client(server)
    full = client.chat.completions.create(
        model=model_name, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS
    )
    assert full.object == "chat.completion" and full.model == model_name
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == ref.outputs[0].text
    assert full.choices[0].finish_reason == ref.outputs[0].finish_reason
    u = full.usage
    assert (u.prompt_tokens, u.completion_tokens) == (
        len(ref.prompt_token_ids),
        len(ref.outputs[0].token_ids),
    )
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert (u.num_draft_tokens, u.num_accepted_tokens, u.mean_accepted_tokens) == (0, 0, 1.0)

    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=CHAT,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.model_extra["mean_accepted_tokens"] == 1.0

    # without include_usage there is no usage chunk
    plain = list(
        client.chat.completions.create(
            model="default",
            messages=CHAT,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
    )
    assert all(c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == ref.outputs[0].text


def test_async_client_stream_equals_nonstream_equals_offline(server: str, refs: dict) -> None:
    chat_ref, comp_ref = refs["chat"].outputs[0].text, refs["completion"].outputs[0].text

    async def main() -> None:
        client = async_client(server)
        full = await client.completions.create(
            model="default", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS
        )
        assert full.object == "text_completion" and full.choices[0].text == comp_ref
        assert full.usage.completion_tokens == len(refs["completion"].outputs[0].token_ids)
        stream = await client.completions.create(
            model="default",
            prompt=PROMPT,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == comp_ref
        assert chunks[-1].usage.total_tokens == full.usage.total_tokens

        chat = await client.chat.completions.create(
            model="default", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS
        )
        assert chat.choices[0].message.content == chat_ref
        stream = await client.chat.completions.create(
            model="default", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in stream]) == chat_ref
        await client.close()

    asyncio.run(main())
    # a prompt given as token ids is the same request
    ids = refs["completion"].prompt_token_ids
    r = httpx.post(
        server + "/v1/completions",
        json={"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0},
        trust_env=False,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == comp_ref


def stop_across_tokens(llm: LLM, token_ids: list[int], text: str) -> str:
    """A 4-character stop string that first occurs straddling a token boundary (the engine sees half of it
    one step before the other half: a server that streamed eagerly would already have sent that half)."""
    tok = llm.get_tokenizer()
    for k in range(len(token_ids) // 3, len(token_ids) - 1):
        b = len(tok.decode(token_ids[:k], skip_special_tokens=True))
        stop = text[b - 2 : b + 2]
        if (
            b >= 2
            and len(stop) == 4
            and stop.strip() == stop
            and "\ufffd" not in stop
            and text.find(stop) == b - 2
        ):
            return stop
    pytest.skip(f"no token boundary suits a stop string in {text!r}")


def test_stop_strings_stream_like_nonstream(server: str, llm: LLM, refs: dict) -> None:
    out = refs["completion"].outputs[0]
    stop = stop_across_tokens(llm, out.token_ids, out.text)
    want = out.text[: out.text.find(stop)]
    client = sync_client(server)
    full = client.completions.create(
        model="default", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, stop=[stop]
    )
    assert full.choices[0].text == want and full.choices[0].finish_reason == "stop"
    chunks = client.completions.create(
        model="default", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == want


def test_speculative_opt_out_reaches_the_engine(
    server: str, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    real = llm.engine.add_request

    def spy(tokens, params, request_id=None, prompt=None):  # runs on the engine thread
        seen.append(params.speculative)
        return real(tokens, params, request_id=request_id, prompt=prompt)

    monkeypatch.setattr(llm.engine, "add_request", spy)
    client = sync_client(server)
    off = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=4, temperature=0, extra_body={"speculative": False}
    )
    on = client.completions.create(model="default", prompt=PROMPT, max_tokens=4, temperature=0)
    assert seen == [False, True]
    for usage in (off.usage, on.usage):
        extra = usage.model_extra
        assert {"num_draft_tokens", "num_accepted_tokens", "mean_accepted_tokens"} <= set(extra)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
BAD_REQUESTS = [
    # (path, body: str or bytes sent as is / anything else as JSON, status, param)
    ("/v1/chat/completions", "{not json", 400, None),
    ("/v1/chat/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", "", 400, None),
    ("/v1/chat/completions", "[" * 100_000, 400, None),
    ("/v1/chat/completions", b"\xff\xfe{", 400, None),
    ("/v1/chat/completions", {"model": "default"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    # only an assistant turn may lack content (OpenAI answers these with 400 too)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}, CHAT[1]]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [CHAT[1], {"role": "assistant"}, {"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 2.5}, 400, "temperature"),  # OpenAI's cap is 2
    # float fields take JSON numbers only: no numeric strings, no booleans
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "0.5"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": True}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": "0.5"}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": True}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "min_p": "0.1"}, 400, "min_p"),
    ("/v1/chat/completions", {"messages": CHAT, "repetition_penalty": True}, 400, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": "0"}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "frequency_penalty": False}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "temperature": "1"}, 400, "temperature"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": -1}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "top_k": 0}, 400, "top_k"),
    ("/v1/chat/completions", {"messages": CHAT, "top_k": 10**9}, 400, "top_k"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 2**70}, 400, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 1000}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # isdigit, not int
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),  # int()'s limit
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 1, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS}, 400, "tool_choice"),  # "auto" by default
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "auto"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "tool_choice",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 128}, 400, "n"),  # 1152 completions from one body
    ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 1100, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1024}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
]


def test_bad_requests_get_4xx_and_the_server_stays_healthy(server: str, refs: dict) -> None:
    with httpx.Client(base_url=server, trust_env=False, timeout=60) as http:
        for path, body, status, param in BAD_REQUESTS:
            content = body if isinstance(body, (str, bytes)) else json.dumps(body)
            r = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
            assert err["param"] == param, (body, err)
        for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
            r = http.request(method, path)
            assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert http.get("/health").status_code == 200
    client = sync_client(server)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=CHAT, max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        list(client.chat.completions.create(model="default", messages=CHAT, temperature=-1, stream=True))
    ok = client.chat.completions.create(model="default", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS)
    assert ok.choices[0].message.content == refs["chat"].outputs[0].text
    m = scrape(server)
    assert not [k for k in m if k.startswith("leapdecode_requests_total") and 'status="5' in k]
    assert m['leapdecode_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 20


def test_extreme_but_valid_sampling_values_are_served(server: str) -> None:
    # values the engine's float32 sampler cannot take as-is (tiny temperature or top_p) must still be served
    with httpx.Client(base_url=server, trust_env=False, timeout=60) as http:
        for extra in (
            {"temperature": 1e-40},
            {"temperature": 1.0, "top_p": 1e-300},
            {"temperature": 1e-5, "repetition_penalty": 0.01},
            {"temperature": 2.0, "top_k": 1, "min_p": 1.0, "seed": 2**64 - 1},
            # JSON integers are numbers: strict float fields must still take them
            {"temperature": 0, "top_p": 1, "min_p": 0, "repetition_penalty": 1, "presence_penalty": 0},
            {"temperature": 2, "frequency_penalty": 0},
        ):
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **extra})
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["usage"]["completion_tokens"] >= 1


def test_assistant_turn_may_omit_content(server: str) -> None:
    # OpenAI allows a content-less assistant turn (it carried tool calls); the template renders it as empty
    with httpx.Client(base_url=server, trust_env=False, timeout=60) as http:
        for assistant in (
            {"role": "assistant", "content": None},
            {"role": "assistant"},
            {"role": "assistant", "content": ""},
        ):
            messages = [CHAT[1], assistant, {"role": "user", "content": [{"type": "text", "text": "And?"}]}]
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, (assistant, r.text)
            assert r.json()["usage"]["completion_tokens"] >= 1


def test_tokenization_runs_off_the_event_loop(server: str, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one request is being tokenized (here: held inside the tokenizer), the server answers others: a long
    prompt takes about a second per 2 MB to tokenize, and on the event loop it would stall every stream."""
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []

    def held(real: Any) -> Any:
        def tokenize(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            entered.set()
            release.wait(30)
            return real(*args, **kwargs)

        return tokenize

    monkeypatch.setattr(llm, "apply_chat_template", held(llm.apply_chat_template))
    monkeypatch.setattr(llm, "_tokenize", held(llm._tokenize))
    for path, body in (
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
    ):
        entered.clear()
        release.clear()
        answers: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda p=path, b=body, out=answers: out.append(
                httpx.post(server + p, json=b, trust_env=False, timeout=60)
            )
        )
        worker.start()
        try:
            assert entered.wait(30), path
            # the event loop is free: other requests, streams included, go on while the tokenizer works
            assert httpx.get(server + "/health", trust_env=False, timeout=5).status_code == 200, path
            stream = httpx.post(
                server + "/v1/completions",
                json={"prompt": [1, 2, 3], "max_tokens": 2, "stream": True},
                trust_env=False,
                timeout=5,
            )
            assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n"), path
        finally:
            release.set()
            worker.join(60)
        assert answers and answers[0].status_code == 200, (path, answers)
    assert len(threads) == 2 and "uvicorn-test" not in threads, threads


def test_request_body_limit_answers_413(server: str) -> None:
    big = json.dumps({"prompt": "word " * (DEFAULT_MAX_REQUEST_BYTES // 5 + 10), "max_tokens": 4}).encode()
    assert len(big) > DEFAULT_MAX_REQUEST_BYTES

    def chunked() -> Iterator[bytes]:  # no Content-Length: the server must count what it reads
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    for content in (big, chunked()):
        with httpx.Client(base_url=server, trust_env=False, timeout=60) as http:
            r = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "request_too_large", err
        assert str(DEFAULT_MAX_REQUEST_BYTES) in err["message"]
    # under the limit a long body is read and judged on its content (here: too long for the context)
    r = httpx.post(
        server + "/v1/completions", json={"prompt": "word " * 200_000}, trust_env=False, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    with pytest.raises(ValueError, match="max_request_bytes"):
        build_app(object.__new__(LLM), max_request_bytes=0)


def test_engine_failure_fails_only_its_requests(
    server: str, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, calls = llm.engine.step, []

    def broken_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated engine failure reading /srv/secret/model.bin")
        return real()

    monkeypatch.setattr(llm.engine, "step", broken_once)
    r = httpx.post(
        server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, trust_env=False, timeout=60
    )
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert "RuntimeError" in r.text and "/srv/secret" not in r.text, r.text  # the kind, never a server path
    r = httpx.post(
        server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, trust_env=False, timeout=60
    )
    assert r.status_code == 200
    wait_for_metric(server, "leapdecode_kv_blocks_in_use", 0)


def test_nonstreaming_client_disconnect_aborts(server: str) -> None:
    before = scrape(server).get('leapdecode_request_finish_total{reason="abort"}', 0)
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server + "/v1/completions", json=body, trust_env=False, timeout=httpx.Timeout(60, read=0.3)
        )
    wait_for_metric(server, 'leapdecode_request_finish_total{reason="abort"}', before + 1)
    wait_for_metric(server, "leapdecode_kv_blocks_in_use", 0)


def test_load_48_streams_some_hang_up(server: str, refs: dict) -> None:
    # half the hang-ups leave after the opening (role-only) chunk, possibly before their first token; the other
    # half after their first content chunk, so their sequences are mid-generation with KV blocks allocated
    n_clients, hangups = 48, set(range(0, 48, 4))
    mid_generation = set(range(0, 48, 8))
    before = scrape(server).get('leapdecode_request_finish_total{reason="abort"}', 0)

    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        topic = LOAD_TOPICS[i % len(LOAD_TOPICS)]
        if i in hangups:
            stream = await client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": topic}],
                max_tokens=400,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            seen = ""
            async for c in stream:
                seen = c.choices[0].delta.content or ""
                if i not in mid_generation or seen:
                    break  # hang up after the first chunk, or after the first one carrying text
            await stream.close()
            return seen if i in mid_generation else None
        stream = await client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": topic}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def main() -> list[str | None]:
        client = async_client(server)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(n_clients)))
        finally:
            await client.close()

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i in mid_generation:
            assert text, f"client {i} hung up before any text was generated"
        elif i not in hangups:
            assert text == refs["load"][LOAD_TOPICS[i % len(LOAD_TOPICS)]], i
    m = wait_for_metric(server, "leapdecode_kv_blocks_in_use", 0)
    assert m["leapdecode_queue_length"] == 0
    assert m['leapdecode_request_finish_total{reason="abort"}'] == before + len(hangups)
    assert m["leapdecode_time_to_first_token_seconds_count"] >= n_clients - len(hangups)
    assert httpx.get(server + "/health", trust_env=False).status_code == 200


def test_full_queue_answers_503_with_retry_after(tiny_model_dir, one_torch_thread) -> None:
    small = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, max_num_seqs=1)
    app = build_app(small, model_name="tiny", max_queue=1)
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 800, "ignore_eos": True, "stream": True}
    with live_server(app) as base, httpx.Client(base_url=base, trust_env=False, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")  # opening chunk
            while not next(lines).startswith('data: {"id"'):  # a real token: it holds the only running slot
                pass
            with http.stream("POST", "/v1/completions", json=long) as queued:
                assert queued.status_code == 200
                wait_for_metric(base, "leapdecode_queue_length", 1)
                r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
                assert r.status_code == 503 and r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
        m = wait_for_metric(base, "leapdecode_kv_blocks_in_use", 0)
        assert m["leapdecode_queue_length"] == 0
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}).status_code == 200
    assert_no_leaks(small)


def test_leapdecode_serve_prints_url_and_serves(tiny_model_dir) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "leapdecode.cli",
        "serve",
        "--model",
        str(tiny_model_dir),
        "--port",
        "0",
        "--kv-cache-blocks",
        "32",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url, line
        r = httpx.post(
            url.group(0) + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 3},
            trust_env=False,
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)  # Ctrl-C: graceful shutdown, exit status 0
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_speculation_is_reported_and_can_be_turned_off(tiny_model_dir, one_torch_thread) -> None:
    pytest.importorskip("leapdecode.speculative.speculator")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "use_cost_model": False}
    spec_llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, speculative_config=spec)
    prompt = "one two three four " * 4
    ref = spec_llm.generate(prompt, greedy(40), use_tqdm=False)[0].outputs[0].text
    with live_server(build_app(spec_llm)) as base:
        client = sync_client(base)
        kw: dict[str, Any] = dict(model="default", prompt=prompt, temperature=0, max_tokens=40)
        on = client.completions.create(**kw)
        off = client.completions.create(**kw, extra_body={"speculative": False})
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert on.choices[0].text == off.choices[0].text == ref
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
        on_u, off_u, stream_u = on.usage.model_extra, off.usage.model_extra, chunks[-1].usage.model_extra
        assert on_u["num_draft_tokens"] > 0 and on_u["num_accepted_tokens"] <= on_u["num_draft_tokens"]
        assert on_u["mean_accepted_tokens"] >= 1.0
        assert stream_u["num_draft_tokens"] > 0
        assert (off_u["num_draft_tokens"], off_u["num_accepted_tokens"], off_u["mean_accepted_tokens"]) == (
            0,
            0,
            1.0,
        )
        m = scrape(base)
        assert m["leapdecode_draft_tokens_total"] >= on_u["num_draft_tokens"] + stream_u["num_draft_tokens"]
        assert m["leapdecode_accepted_tokens_total"] >= on_u["num_accepted_tokens"]
    assert_no_leaks(spec_llm)
