"""The server's limits on one hostile request (issue: one request must never hurt another): grammar caps and the
compile timeout as 400s, ``/tokenize`` capped at the context and built off the event loop, the queue cap before
tokenizing, the body-read deadline, ``--request-timeout`` (the request stops and frees its KV), uvicorn's
``--limit-concurrency``, and the KV admission check counting ``n``."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.engine.llm_engine import KVCapacityError
from leapdecode.sampling_params import StructuredOutputsParams
from leapdecode.server.api_server import build_app
from leapdecode.server.serve import add_cli, make_server
from leapdecode.structured import GrammarLimits
from tests.conftest import assert_no_leaks
from tests.server_helpers import CHAT, HOST, live_server

BLOCKS = 64


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=BLOCKS)


@pytest.fixture(scope="module")
def other(tiny_model_dir) -> LLM:  # for the apps made here: one engine is owned by one app at a time
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=BLOCKS)


@pytest.fixture(scope="module")
def base(llm: LLM) -> Iterator[str]:
    with live_server(build_app(llm, max_queue=2, body_read_timeout_s=1.0)) as url:
        yield url
    assert_no_leaks(llm)


def post(base: str, path: str, body: dict | str, timeout: float = 60) -> httpx.Response:
    """POST ``body`` as JSON (a str: already encoded, sent as is)."""
    if isinstance(body, str):
        return httpx.post(base + path, content=body, headers={"content-type": "application/json"}, trust_env=False,
                          timeout=timeout)
    return httpx.post(base + path, json=body, trust_env=False, timeout=timeout)


def test_grammar_over_the_limits_is_a_400_naming_it(base: str) -> None:
    # the body as text: json.dumps recurses once a level, and 941 levels beside a deep caller's stack (a pytest-xdist
    # worker's) exceed Python's recursion limit in the client before the server sees anything
    schema = '{"type": "object", "properties": {"a": ' * 470 + '{"type": "string"}' + '}, "required": ["a"]}' * 470
    body = (f'{{"messages": {json.dumps(CHAT)}, "max_tokens": 4, '
            f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "deep", "schema": {schema}}}}}}}')
    r = post(base, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "grammar_too_large" and "nested 941 levels" in err["message"], err
    assert "max_json_depth" in err["message"], err
    r = post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "(" * 50}})
    assert r.status_code == 400 and "max_regex_depth" in r.json()["error"]["message"]


def test_slow_compile_times_out_alone(base: str, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = llm.engine.structured_backend()
    real, release = backend._compile_now, threading.Event()

    def compile_now(params):
        if params.regex == "slow+":
            release.wait(30)
        return real(params)

    # the small request's grammar is compiled first, so that only the slow one can meet the timeout however busy
    # the machine is (a cold first compile also builds the tokenizer's tables)
    backend.compile(StructuredOutputsParams(choice=["yes", "no"]))
    monkeypatch.setattr(backend, "_compile_now", compile_now)
    monkeypatch.setattr(backend, "limits", GrammarLimits(compile_timeout_s=2.0))
    slow: dict = {}
    t = threading.Thread(target=lambda: slow.update(r=post(base, "/v1/completions", {
        "prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "slow+"}})))
    t.start()
    try:
        small = post(base, "/v1/completions", {
            "prompt": "hi", "max_tokens": 3, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}})
        assert small.status_code == 200 and small.json()["choices"][0]["text"] in ("yes", "no"), small.text
        t.join(30)
        r = slow["r"]
        assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_compile_timeout", r.text
        assert "compile_timeout_s" in r.json()["error"]["message"]
    finally:
        release.set()
        t.join(30)


def test_tokenize_is_capped_at_the_context_and_built_off_the_loop(
    base: str, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = llm.get_tokenizer()
    max_len = llm.engine.max_model_len
    threads: list[str] = []
    real_strs = tok.convert_ids_to_tokens
    monkeypatch.setattr(tok, "convert_ids_to_tokens", lambda ids: (
        threads.append(threading.current_thread().name), real_strs(ids))[1])
    r = post(base, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    got = r.json()
    assert got["tokens"] == tok.encode("hello world") and got["token_strs"] == real_strs(got["tokens"])
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == max_len
    assert threads and "uvicorn-test" not in threads, threads  # the server's event loop runs in that thread
    over = " x" * (max_len + 10)  # a few tokens over the context: tokenized, then refused
    r = post(base, "/tokenize", {"prompt": over})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = post(base, "/tokenize", {"messages": [{"role": "user", "content": over}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    encoded: list[int] = []
    real_encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: (encoded.append(1), real_encode(*a, **k))[1])
    r = post(base, "/tokenize", {"prompt": "a" * 3_000_000})  # far over: refused before tokenizing
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"] and not encoded


def test_queue_cap_is_checked_before_tokenizing(base: str, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_queue=2: two requests held while tokenizing fill it; the third is a 503 and is never tokenized."""
    tok = llm.get_tokenizer()
    real, release, calls = tok.apply_chat_template, threading.Event(), []

    def held(*a, **k):
        calls.append(1)
        release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(tok, "apply_chat_template", held)
    body = {"messages": CHAT, "max_tokens": 2}
    held_threads = [threading.Thread(target=post, args=(base, "/v1/chat/completions", body)) for _ in range(2)]
    for t in held_threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while len(calls) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = post(base, "/v1/chat/completions", body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        assert "Retry-After" in r.headers and len(calls) == 2
    finally:
        release.set()
        for t in held_threads:
            t.join(30)


def test_a_queued_request_counts_once(base: str, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_queue=2 with one request in the engine's queue (held before the engine accepts it): a second one is
    admitted. The request being handed over used to count both as prepared and as queued, refusing the second."""
    real, entered, release = llm.engine.add_request, threading.Event(), threading.Event()

    def held(*a, **k):
        entered.set()
        release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(llm.engine, "add_request", held)
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(r=post(base, "/v1/completions", body)))
    t.start()
    try:
        assert entered.wait(30)
        second: dict = {}
        t2 = threading.Thread(target=lambda: second.update(r=post(base, "/v1/completions", body)))
        t2.start()
        t2.join(1.0)  # a refusal comes back at once; an admitted request waits behind the held one
        assert "r" not in second, second["r"].text
        release.set()
        t.join(30)
        t2.join(30)
        assert first["r"].status_code == 200 and second["r"].status_code == 200, (first["r"].text, second["r"].text)
    finally:
        release.set()
        t.join(30)


def test_slow_body_gets_408(base: str) -> None:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        t0 = time.monotonic()
        answer = b""
        while b"request_body_timeout" not in answer:  # headers and body may come in separate packets
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        answer = answer.decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert "request_body_timeout" in answer and time.monotonic() - t0 < 15


def test_request_timeout_stops_generation_and_frees_kv(other: LLM) -> None:
    llm = other
    body = {"prompt": "hi", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with live_server(build_app(llm, request_timeout_s=0.3)) as url:
        r = post(url, "/v1/completions", body)
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, trust_env=False,
                          timeout=60) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
        short = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert short.status_code == 200
        deadline = time.monotonic() + 10
        while llm.engine.has_unfinished_requests():  # the aborts reach the engine thread within a step
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert_no_leaks(llm)


def test_limit_concurrency_answers_503(other: LLM) -> None:
    llm = other
    urls: list[str] = []
    server = make_server(build_app(llm), HOST, 0, log_level="warning", on_ready=urls.append, limit_concurrency=2)
    assert server.config.limit_concurrency == 2
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not urls:
            time.sleep(0.01)
        host, port = urls[0].removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        time.sleep(0.2)
        r = httpx.get(urls[0] + "/health", trust_env=False, timeout=10)
        assert r.status_code == 503
        for s in idle:
            s.close()
    finally:
        server.should_exit = True
        thread.join(30)


def test_serve_flags() -> None:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve"])
    assert (args.limit_concurrency, args.body_read_timeout, args.request_timeout) == (1024, 30.0, None)
    args = parser.parse_args(["serve", "--limit-concurrency", "8", "--request-timeout", "2.5"])
    assert (args.limit_concurrency, args.request_timeout) == (8, 2.5)


def test_kv_admission_counts_n(llm: LLM, base: str) -> None:
    """64 blocks of 16 slots: one sequence of 10 + 300 tokens fits (20 blocks); eight of them (each with its own
    output blocks) do not, and the server's default max_tokens for n=8 is sized so that all eight fit."""
    eng = llm.engine
    with pytest.raises(KVCapacityError, match="n=8"):
        eng.add_request(list(range(1, 11)), SamplingParams(max_tokens=300, n=8))
    assert not eng.requests
    fits = eng.max_tokens_fitting(10, 8)
    assert eng.blocks_for(10, fits, 8) <= BLOCKS < eng.blocks_for(10, fits + 16, 8)
    r = post(base, "/v1/completions", {"prompt": "hi", "n": 8, "ignore_eos": True, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
