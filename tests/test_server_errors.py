"""The server against bad and hostile input: every malformed request a 4xx in OpenAI's error format, extreme but
valid values served, body limits, engine failures confined to their requests, disconnects aborting."""

# ruff: noqa: F811  (pytest fixtures imported from tests/server_helpers.py are used as parameters)
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from leapdecode import LLM
from leapdecode.engine.executor import WorkerDiedError
from leapdecode.sampling_params import StructuredOutputsParams
from leapdecode.server.api_server import build_app
from leapdecode.server.async_engine import FAILING_STEPS
from leapdecode.server.defaults import DEFAULT_MAX_REQUEST_BYTES
from tests.poison import Exploding
from tests.server_helpers import (  # noqa: F401 (fixtures)
    CHAT,
    LOAD_TOPICS,
    MAX_TOKENS,
    PROMPT,
    async_client,
    live_server,
    llm,
    model_name,
    one_torch_thread,
    refs,
    scrape,
    server,
    sync_client,
    wait_for_metric,
)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
# JSON text nested past any parser's recursion limit, inside a string field (the body itself parses)
DEEP = "[" * 50_000 + "]" * 50_000
DEEP_CALL = [CHAT[1], {"role": "assistant", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
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
    # nesting no parser takes: a 400 wherever the JSON text sits (it was a RecursionError and a 500)
    ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"json": DEEP}}, 400, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": DEEP}}, 400, "structured_outputs"),
    ("/v1/chat/completions", {"messages": DEEP_CALL, "max_tokens": 2}, 400, "messages"),
    ("/tokenize", {"messages": DEEP_CALL}, 400, "TokenizeChatRequest"),  # (the union member)
    # a grammar whose language is empty: no token could ever be sampled (the step used to fail on it)
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "root ::= root"}}, 400, None),
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


def test_a_model_without_a_chat_template_answers_400_saying_what_to_do(
    server: str, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", None)  # a base model's checkpoint
    with httpx.Client(base_url=server, trust_env=False, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": [CHAT[1]], "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "no chat template" in r.json()["error"]["message"] and "--chat-template" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text


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


def test_a_poisoned_request_fails_alone_beside_streams_in_flight(
    server: str, llm: LLM, refs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one request whose grammar raises inside an engine step (as a grammar refusing a token did): it alone gets
    # the error; the streams in flight with it finish token-identical to running alone, /health stays 200
    pytest.importorskip("xgrammar")
    eng = llm.engine
    backend = eng.structured_backend()
    real, in_flight = backend.matcher, []
    poison = {"regex": "[a-z ]+"}
    backend.compile(StructuredOutputsParams(**poison))  # compiled before the streams start
    poison_added, real_step = threading.Event(), eng.step

    def matcher(params: Any, compiled: Any = None) -> Any:
        m = real(params, compiled)
        if not params.regex:
            return m
        poison_added.set()
        return Exploding(m, "accept", 2, lambda: in_flight.append(len(eng.requests)))

    def step() -> Any:
        # the streams take their time until the poisoned request is in the engine: on a slow machine the client
        # read the streams' first tokens so late that every 24-token stream had finished before it arrived
        if not poison_added.is_set():
            time.sleep(0.05)
        return real_step()

    monkeypatch.setattr(backend, "matcher", matcher)
    monkeypatch.setattr(eng, "step", step)

    async def main() -> tuple[list[str], httpx.Response, int]:
        client = async_client(server)
        started, all_started = [0], asyncio.Event()

        async def stream(topic: str) -> str:
            chunks = await client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": topic}], temperature=0,
                max_tokens=MAX_TOKENS, stream=True,
            )
            parts = []
            async for c in chunks:
                if c.choices and c.choices[0].delta.content:
                    if not parts:
                        started[0] += 1
                        if started[0] == len(LOAD_TOPICS):
                            all_started.set()
                    parts.append(c.choices[0].delta.content)
            return "".join(parts)

        async def poisoned() -> httpx.Response:
            # sent once every stream has its first token, so all of them are decoding in the engine (a fixed sleep
            # raced the streams' prefill on a slow machine)
            await asyncio.wait_for(all_started.wait(), timeout=60)
            async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
                r = await http.post(server + "/v1/chat/completions", json={
                    "messages": CHAT, "structured_outputs": poison, "min_tokens": 10, "max_tokens": 20,
                    "temperature": 0})
                health = (await http.get(server + "/health")).status_code
                return r, health

        *texts, (r, health) = await asyncio.gather(*(stream(t) for t in LOAD_TOPICS), poisoned())
        return texts, r, health

    texts, r, health = asyncio.run(main())
    assert in_flight and in_flight[0] >= 2, in_flight  # the others were in the engine when it failed
    assert r.status_code == 500 and "RuntimeError" in r.json()["error"]["message"], r.text
    assert texts == [refs["load"][t] for t in LOAD_TOPICS]
    assert health == 200 and httpx.get(server + "/health", trust_env=False).json() == {"status": "ok"}
    wait_for_metric(server, "leapdecode_kv_blocks_in_use", 0)


def test_grammar_end_below_min_tokens_is_served(server: str) -> None:
    # the body: the grammar's end below min_tokens used to fail the step of every request in it
    pytest.importorskip("xgrammar")
    body = {"messages": [{"role": "user", "content": "Say a"}], "structured_outputs": {"choice": ["a"]},
            "min_tokens": 5, "max_tokens": 8}
    r = httpx.post(server + "/v1/chat/completions", json=body, trust_env=False, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("a", "stop")


def test_health_answers_503_with_the_reason(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=32)  # its own server: the last case kills it for good
    eng = llm.engine
    body = {"prompt": PROMPT, "max_tokens": 2}
    with live_server(build_app(llm)) as base, httpx.Client(base_url=base, trust_env=False, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}

        def fail_with(target: Any, name: str, exc: Exception) -> None:
            def broken(*args: Any) -> Any:
                raise exc

            monkeypatch.setattr(target, name, broken)

        # steps failing as a whole, and forwards failing for every request in them: 503 after FAILING_STEPS in a row
        for target, name, what in ((eng, "step", "engine step"), (eng.runner, "execute", "model forward")):
            fail_with(target, name, RuntimeError("simulated"))
            for i in range(FAILING_STEPS):
                assert http.get("/health").status_code == 200, (what, i)
                assert http.post("/v1/completions", json=body).status_code == 500
            r = http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "unavailable", r.text
            assert f"{what} failed {FAILING_STEPS} times in a row (RuntimeError)" in r.json()["reason"], r.text
            monkeypatch.undo()  # it recovers: the first good step makes it healthy again
            assert http.post("/v1/completions", json=body).status_code == 200
            assert http.get("/health").json() == {"status": "ok"}
        # a dead tensor-parallel worker: every later step would fail, so it is unhealthy at once, and stays so
        fail_with(eng, "step", WorkerDiedError("tensor-parallel worker rank 1 (pid 7) exited with signal 9"))
        assert http.post("/v1/completions", json=body).status_code == 500
        monkeypatch.undo()
        r = http.get("/health")
        assert r.status_code == 503 and "worker rank 1 (pid 7) exited" in r.json()["reason"], r.text
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 503 and "restart the server" in r.json()["error"]["message"], r.text
        assert http.get("/health").status_code == 503


def test_nonstreaming_client_disconnect_aborts(server: str) -> None:
    before = scrape(server).get('leapdecode_request_finish_total{reason="abort"}', 0)
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server + "/v1/completions", json=body, trust_env=False, timeout=httpx.Timeout(60, read=0.3)
        )
    wait_for_metric(server, 'leapdecode_request_finish_total{reason="abort"}', before + 1)
    wait_for_metric(server, "leapdecode_kv_blocks_in_use", 0)
