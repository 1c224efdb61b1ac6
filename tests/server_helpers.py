"""What the server tests share: a live uvicorn on 127.0.0.1 (random free port), clients that ignore proxy settings
(``trust_env=False``), metric scraping, and the module-scoped fixtures of the tiny model's engine, its offline
references and a server over it."""

from __future__ import annotations

import contextlib
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
from leapdecode.server.serve import make_server
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
