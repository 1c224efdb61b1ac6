"""Serving basics against a live server (the ``openai`` client where it applies): the API key, CORS, request ids,
/tokenize /detokenize /version, batches of prompts and token-id prompts in /v1/completions, no file-system paths
in answers, and the engine options of ``leapdecode serve``."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import leapdecode
from leapdecode import LLM, SamplingParams
from leapdecode.server.api_server import build_app
from leapdecode.server.serve import add_cli, load_llm, resolve_dtype
from tests.conftest import assert_no_leaks
from tests.server_helpers import live_server

KEY = "sk-test-0123"
ORIGIN = "http://app.example"
PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4"]
MAX_TOKENS = 8


def client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base + "/v1", api_key=key, max_retries=0, http_client=httpx.Client(trust_env=False, timeout=60)
    )


def http(base: str, key: str | None = KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base, trust_env=False, timeout=60, headers=headers)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=128)


@pytest.fixture(scope="module")
def refs(llm: LLM) -> dict[str, str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))}


@pytest.fixture(scope="module")
def server(llm: LLM, refs: dict[str, str]) -> Iterator[str]:
    app = build_app(llm, api_key=KEY, allowed_origins=[ORIGIN])
    with live_server(app) as base:
        yield base
    assert_no_leaks(llm)


def test_api_key_is_required_except_on_health_and_metrics(server: str) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, "wrong").models.list()
    assert e.value.status_code == 401
    with http(server, key=None) as h:
        r = h.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 401
        assert h.post("/tokenize", json={"prompt": "hi"}).status_code == 401
        assert h.get("/health").status_code == 200
        assert h.get("/metrics").status_code == 200
    assert [m.id for m in client(server).models.list()]


def test_cors_preflight_and_allowed_origin(server: str) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    with http(server, key=None) as h:
        r = h.options("/v1/chat/completions", headers=preflight)  # browsers send no credentials here
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = h.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    with http(server) as h:
        r = h.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_request_id_is_echoed_generated_and_logged(server: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="leapdecode.server"), http(server) as h:
        r = h.get("/v1/models", headers={"X-Request-Id": "trace-42"})
        assert r.headers["x-request-id"] == "trace-42"
        fresh = h.get("/v1/models").headers["x-request-id"]
        assert len(fresh) == 32 and fresh != "trace-42"
        bad = h.get("/v1/models", headers={"X-Request-Id": "x" * 500}).headers["x-request-id"]
        assert len(bad) == 32  # too long to trust: replaced
        assert h.get("/v1/models", headers={"Authorization": "Bearer no"}).headers["x-request-id"]  # 401s too
    lines = [r.getMessage() for r in caplog.records if r.name == "leapdecode.server.access"]
    assert any("trace-42" in line and "/v1/models" in line and "200" in line for line in lines), lines
    assert any(fresh in line for line in lines)


def test_tokenize_detokenize_version(server: str, llm: LLM) -> None:
    tok = llm.get_tokenizer()
    with http(server) as h:
        r = h.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        want = tok.encode("Hello world")
        assert r["tokens"] == want and r["count"] == len(want)
        assert r["max_model_len"] == llm.engine.max_model_len
        assert r["token_strs"] == tok.convert_ids_to_tokens(want)
        plain = h.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False}).json()
        assert plain["tokens"] == tok.encode("Hello", add_special_tokens=False) and plain["token_strs"] is None
        conv = [{"role": "user", "content": "Hi there"}]
        r = h.post("/tokenize", json={"messages": conv}).json()
        assert r["tokens"] == llm.apply_chat_template(conv)
        assert h.post("/detokenize", json={"tokens": want}).json() == {"prompt": tok.decode(want)}
        r = h.post("/detokenize", json={"tokens": [10**8]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        assert h.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
        assert h.get("/version").json() == {"version": leapdecode.__version__}
        info = h.get("/tokenizer_info").json()
        assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
        assert info["model_max_length"] == llm.engine.max_model_len


def test_completions_take_a_batch_of_prompts_and_token_ids(server: str, llm: LLM, refs: dict[str, str]) -> None:
    c = client(server)
    out = c.completions.create(model="default", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == [refs[p] for p in PROMPTS]
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert out.usage.prompt_tokens == sum(len(i) for i in ids)
    one = c.completions.create(model="default", prompt=ids[1], max_tokens=MAX_TOKENS, temperature=0)
    assert [ch.text for ch in one.choices] == [refs[PROMPTS[1]]]
    many = c.completions.create(model="default", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert [ch.text for ch in many.choices] == [refs[p] for p in PROMPTS]
    texts = ["", "", ""]
    reasons: dict[int, str] = {}
    stream = c.completions.create(
        model="default", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                assert ch.index not in reasons  # one closing chunk per choice
                reasons[ch.index] = ch.finish_reason
    assert texts == [refs[p] for p in PROMPTS] and sorted(reasons) == [0, 1, 2]
    assert usage is not None and usage.completion_tokens == out.usage.completion_tokens
    with http(server) as h:
        r = h.post("/v1/completions", json={"prompt": [[1, 2], []], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = h.post("/v1/completions", json={"prompt": [[1, 2], [5, 10**8]], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_no_file_system_path_in_answers(server: str, tiny_model_dir: Any) -> None:
    secret = str(tiny_model_dir)
    with http(server) as h:
        answers = [
            h.get("/v1/models"),
            h.post("/v1/completions", json={"prompt": "x", "model": "nope"}),
            h.post("/v1/completions", json={"prompt": "x" * 10, "max_tokens": 10**6}),
            h.get("/nothing"),
            h.get("/openapi.json"),
        ]
    for r in answers:
        assert secret not in r.text and str(tiny_model_dir.parent) not in r.text, r.text
    card = answers[0].json()["data"][0]
    assert card["root"] == card["id"]


def test_serve_exposes_the_engine_options(tiny_model_dir: Any, tmp_path: Any) -> None:
    parser = argparse.ArgumentParser(prog="leapdecode")
    add_cli(parser.add_subparsers(dest="command"))
    defaults = parser.parse_args(["serve"])
    assert (defaults.dtype, defaults.kv_cache_dtype, defaults.linear_kernel) == ("auto", "auto", "auto")
    assert defaults.enable_prefix_caching is True and defaults.api_key is None and defaults.allowed_origins is None
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    args = parser.parse_args(
        ["serve", "--model", str(tiny_model_dir), "--kv-cache-dtype", "int8", "--linear-kernel", "torch",
         "--no-enable-prefix-caching", "--max-num-batched-tokens", "64", "--kv-cache-blocks", "16",
         "--chat-template", str(template), "--allowed-origins", '["http://a", "http://b"]', "--api-key", "k"]
    )
    assert args.allowed_origins == ["http://a", "http://b"] and args.api_key == "k"
    comma = parser.parse_args(["serve", "--allowed-origins", "http://a, http://b"])
    assert comma.allowed_origins == args.allowed_origins
    llm = load_llm(args)
    cfg = llm.config
    assert (cfg.dtype, cfg.kv_cache_dtype, cfg.linear_kernel) == ("float32", "int8", "torch")
    assert (cfg.enable_prefix_caching, cfg.max_num_batched_tokens) == (False, 64)
    assert not llm.engine.block_manager.enable_prefix_caching
    tok = llm.get_tokenizer()
    templated = llm.apply_chat_template([{"role": "user", "content": "hey"}])
    assert templated == tok.encode("<<hey>>", add_special_tokens=False)
    assert resolve_dtype("auto", "cpu", str(tiny_model_dir)) == "float32"
    assert resolve_dtype("bfloat16", "cpu", str(tiny_model_dir)) == "bfloat16"
    assert resolve_dtype("auto", "cuda", str(tiny_model_dir)) == "bfloat16"  # float32 saved: bf16 on a GPU
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "int4"])
