"""Graceful overload: a request that can never fit the KV cache is refused at once with a clear error (Python API
and server), requests that each fit alone but not together all finish (preemption makes progress), and nothing
leaks. The full-queue 503 + Retry-After is tested in test_server.py (test_full_queue_answers_503_with_retry_after).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.engine.llm_engine import KVCapacityError
from leapdecode.server.api_server import build_app
from tests.conftest import assert_no_leaks
from tests.server_helpers import live_server

BLOCKS = 4  # x 16 tokens: a 64-token pool under a 1024-token context
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path) -> LLM:
    torch.set_num_threads(1)
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=BLOCKS, max_num_seqs=8)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_generate_refuses_what_can_never_fit(small: LLM) -> None:
    start = time.monotonic()
    with pytest.raises(KVCapacityError, match=r"needs \d+ KV blocks but the cache has 4; raise kv_cache_blocks"):
        small.generate(PROMPT, greedy(200), use_tqdm=False)
    # one bad prompt in a batch: nothing of the batch runs, nothing stays behind
    with pytest.raises(KVCapacityError):
        small.generate([PROMPT, PROMPT], [greedy(8), greedy(500)], use_tqdm=False)
    assert time.monotonic() - start < 5, "refusing must not wait for the engine"
    assert_no_leaks(small)
    assert small.generate(PROMPT, greedy(8), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_requests_that_fit_alone_all_finish_together(small: LLM) -> None:
    n = len(small.get_tokenizer().encode(PROMPT))
    longest = BLOCKS * 16 - n  # each one alone fills the whole pool
    alone = small.generate(PROMPT, greedy(longest), use_tqdm=False)[0].outputs[0].token_ids
    preemptions = small.engine.stats.num_preemptions
    start = time.monotonic()
    outs = small.generate([PROMPT] * 3, greedy(longest), use_tqdm=False)
    assert time.monotonic() - start < 120
    assert all(o.outputs[0].token_ids == alone for o in outs)  # preempted and recomputed, nothing lost
    assert small.engine.stats.num_preemptions > preemptions
    assert_no_leaks(small)


def test_server_answers_400_for_what_can_never_fit(tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=BLOCKS, max_num_seqs=8)
    with live_server(build_app(llm, model_name="tiny")) as base:
        with httpx.Client(base_url=base, trust_env=False, timeout=60) as http:
            for stream in (False, True):
                start = time.monotonic()
                r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 300, "stream": stream})
                assert time.monotonic() - start < 5
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert (err["code"], err["param"], err["type"]) == (
                    "kv_cache_capacity_exceeded", "max_tokens", "invalid_request_error"
                )
                assert "KV blocks but the cache has 4" in err["message"]
            # no max_tokens: the default is what the pool holds, so it runs to the end of the pool
            r = http.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"

        async def crowd() -> list[Any]:
            async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=120) as client:
                body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(4)))

        answers = asyncio.run(crowd())  # each fits alone, together they preempt each other
        assert [a.status_code for a in answers] == [200] * 4
        assert all(a.json()["usage"]["completion_tokens"] == 40 for a in answers)
        assert httpx.get(base + "/health", trust_env=False).json() == {"status": "ok"}
    assert llm.engine.stats.num_preemptions > 0
    assert_no_leaks(llm)
