"""llama-server's ``/props`` and ``/slots``, OpenAI's ``/v1/responses`` (text case) with the ``openai`` client, and
whether a request's output joins the suffix method's global tree (``share_output``: the server's default, the
request's own field)."""

# ruff: noqa: F811  (a pytest fixture imported from tests/server_helpers.py is used as a parameter)
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.server.api_server import build_app
from leapdecode.server.props import slot_states
from tests.conftest import assert_no_leaks
from tests.server_helpers import live_server, one_torch_thread, sync_client  # noqa: F401 (a fixture)

SUFFIX = {"method": "suffix", "use_cost_model": False}
INSTRUCTIONS = "Answer in one word."
QUESTION = "What colour is the sky?"


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dir, one_torch_thread) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=128, speculative_config=SUFFIX)
    yield llm
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def server(spec_llm: LLM) -> Iterator[str]:
    with live_server(build_app(spec_llm, model_name="tiny")) as base:
        yield base


def get(base: str, path: str) -> dict:
    r = httpx.get(base + path, trust_env=False, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------------------------------- /props, /slots


def test_props(server: str, spec_llm: LLM) -> None:
    p = get(server, "/props")
    engine = spec_llm.engine
    assert p["model"] == "tiny" and p["n_ctx"] == engine.max_model_len
    assert p["total_slots"] == engine.config.max_num_seqs
    assert p["chat_template"] == spec_llm.get_tokenizer().chat_template and p["chat_template"]
    settings = p["default_generation_settings"]
    assert settings["n_ctx"] == engine.max_model_len and settings["params"]["temperature"] == 1.0
    assert settings["params"]["share_output"] is True
    assert p["speculative"]["method"] == "suffix" and p["speculative"]["use_cost_model"] is False
    assert p["speculative"]["options"]["SuffixOptions"]["global_tree"] is True
    plan = p["kernel_plan"]
    assert plan["linear_kernel"] == engine.config.linear_kernel
    assert plan["packed_projections"] == engine.num_packed_linears and plan["threads"] == engine.num_threads
    assert p["kv_cache"]["blocks"] == 128 and p["kv_cache"]["block_size"] == engine.block_manager.block_size
    deadline = time.monotonic() + 10  # the engine thread measures its drafters' memory once it has run
    while "suffix" not in get(server, "/props")["speculative"]["drafter_memory_bytes"]:
        assert time.monotonic() < deadline, "the drafter's memory was never published"
        time.sleep(0.05)


def test_slot_states_in_process(tiny_model_dir) -> None:
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, speculative_config=SUFFIX)
    eng = llm.engine
    eng.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20, seed=3, ignore_eos=True, n=2),
                    request_id="r1")
    eng.add_request([7, 8, 9], SamplingParams(max_tokens=5, speculative=False, ignore_eos=True), request_id="r2")
    assert [(s.request_id, s.index, s.state) for s in slot_states(eng)] == [
        ("r1", 0, "waiting"), ("r1", 1, "waiting"), ("r2", 0, "waiting")]
    for _ in range(3):
        eng.step()
    slots = slot_states(eng)
    assert [s.id for s in slots] == list(range(len(slots))) and all(s.state == "decoding" for s in slots)
    first = slots[0]
    assert (first.n_prompt_tokens, first.n_ctx, first.max_tokens) == (6, eng.max_model_len, 20)
    assert first.n_decoded >= 2 and first.n_computed_tokens >= first.n_prompt_tokens
    assert first.speculative.method == "suffix" and slots[-1].speculative.method == "off"
    seq = eng.requests["r1"][0]
    assert first.speculative.num_draft_tokens == seq.metrics.num_draft_tokens
    while eng.has_unfinished_requests():
        eng.step()
    assert slot_states(eng) == ()
    assert_no_leaks(llm)


def test_slots_show_a_running_request(server: str, spec_llm: LLM) -> None:
    """The engine is held after its second step, so the request is certainly running when /slots is read."""
    engine = spec_llm.engine
    gate, steps, step = threading.Event(), [0], engine.step

    def held_step():
        out = step()
        steps[0] += 1
        if steps[0] >= 2:
            gate.wait(30)
        return out

    engine.step = held_step  # type: ignore[method-assign]
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    done: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: done.append(httpx.post(server + "/v1/completions", json=body,
                                                                    trust_env=False, timeout=60)))
    try:
        worker.start()
        deadline = time.monotonic() + 30
        while not (slots := get(server, "/slots")["data"]):
            assert time.monotonic() < deadline, "no slot appeared"
            time.sleep(0.02)
        [slot] = slots
        assert slot["state"] == "decoding" and slot["n_decoded"] >= 1 and slot["max_tokens"] == 12
        assert slot["n_ctx"] == engine.max_model_len and slot["temperature"] == 0.0
        assert slot["speculative"]["method"] == "suffix"
        assert set(slot["speculative"]) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate"}
    finally:
        gate.set()
        worker.join(60)
        del engine.step
    assert done and done[0].status_code == 200
    assert get(server, "/slots")["data"] == []


# ------------------------------------------------------------------------------------------- /v1/responses


def test_responses_match_chat_completions(server: str) -> None:
    c = sync_client(server)
    chat = c.chat.completions.create(model="tiny", temperature=0, max_tokens=6, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    r = c.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=6,
                           temperature=0, top_p=1.0)
    assert r.object == "response" and r.id.startswith("resp-") and r.model == "tiny"
    assert r.output_text == chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    # a message list with typed parts, an assistant's earlier turn included
    history = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION},
               {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And at night?"}]
    chat2 = c.chat.completions.create(model="tiny", temperature=0, max_tokens=5, messages=history)
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "And at night?"}]
    r2 = c.responses.create(model="default", input=items, max_output_tokens=5, temperature=0)
    assert r2.output_text == chat2.choices[0].message.content


def test_responses_stream(server: str) -> None:
    c = sync_client(server)
    whole = c.responses.create(model="tiny", input=QUESTION, max_output_tokens=8, temperature=0)
    events = list(c.responses.create(model="tiny", input=QUESTION, max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    assert events[-1].response.usage.output_tokens == 8 and events[-1].response.output[0].content[0].text == text
    # the SDK's own accumulator reads the same events into the same answer
    with c.responses.stream(model="tiny", input=QUESTION, max_output_tokens=3, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
    assert "".join(deltas) and whole.output_text.startswith("".join(deltas))


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"previous_response_id": "resp-1"}, "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
])
def test_responses_refuse_what_they_do_not_serve(server: str, body: dict, param: str) -> None:
    r = httpx.post(server + "/v1/responses", json={"model": "tiny", "input": QUESTION, **body}, trust_env=False)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(server + "/v1/responses", trust_env=False, json={
        "model": "tiny", "input": QUESTION, "max_output_tokens": 2, "tools": [], "store": False,
        "metadata": {"a": "b"}})
    assert ok.status_code == 200 and ok.json()["metadata"] == {"a": "b"} and ok.json()["store"] is False


# ------------------------------------------------------------------------------------------- share_output


def test_share_output_default_and_per_request(tiny_model_dir, one_torch_thread) -> None:
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=128, speculative_config=SUFFIX)
    cache = llm.engine.speculator.proposer.cache
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate("a b c", params, use_tqdm=False)  # the Python API shares by default
    assert len(cache.texts) == 1
    llm.generate("a b c", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, share_output=False),
                 use_tqdm=False)
    assert len(cache.texts) == 1
    with pytest.raises(ValueError, match="share_output"):
        SamplingParams(share_output="no")  # type: ignore[arg-type]
    with live_server(build_app(llm, share_output=False)) as base:
        c = sync_client(base)
        c.completions.create(model="default", prompt="d e f", max_tokens=4, temperature=0)
        assert len(cache.texts) == 1  # the server's default: kept out
        c.completions.create(model="default", prompt="d e f", max_tokens=4, temperature=0,
                             extra_body={"share_output": True})
        c.responses.create(model="default", input="g h", max_output_tokens=4, extra_body={"share_output": True})
        assert len(cache.texts) == 3  # the requests' own word
        assert get(base, "/props")["default_generation_settings"]["params"]["share_output"] is False
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="default", prompt="x", max_tokens=2, extra_body={"share_output": "yes"})
    assert_no_leaks(llm)
