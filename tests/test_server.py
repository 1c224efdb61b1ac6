"""The OpenAI-compatible server against a live uvicorn on 127.0.0.1 (random free port), driven by the official
``openai`` client (sync and async, streaming and not) and raw httpx for malformed input.

Every server here binds to the loopback address only; clients ignore proxy settings (``trust_env=False``).
"""

# ruff: noqa: F811  (pytest fixtures imported from tests/server_helpers.py are used as parameters)
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest

from leapdecode import LLM
from leapdecode.server.api_server import build_app
from leapdecode.server.async_engine import AsyncEngine
from leapdecode.server.defaults import DEFAULT_MAX_REQUEST_BYTES
from leapdecode.server.serve import add_cli
from leapdecode.server.streaming import TextDeltas
from tests.conftest import assert_no_leaks
from tests.server_helpers import (  # noqa: F401 (fixtures)
    CHAT,
    LOAD_TOPICS,
    MAX_TOKENS,
    PROMPT,
    async_client,
    greedy,
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

    def spy(tokens, params, request_id=None, prompt=None, grammar=None):  # runs on the engine thread
        seen.append(params.speculative)
        return real(tokens, params, request_id=request_id, prompt=prompt, grammar=grammar)

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
