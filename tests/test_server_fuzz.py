"""Schema-driven fuzzing of the OpenAI-compatible server: schemathesis generates bodies (valid and invalid) for
every operation in ``/openapi.json`` and sends them to a live uvicorn on 127.0.0.1 serving a tiny random model.

Every answer must be 2xx or 4xx (never 5xx), conform to the documented status codes and schemas, and every error
body must be OpenAI's ``{"error": {"message", "type", "param", "code"}}``. Afterwards the server must be healthy
with every KV block back in the pool. ``LEAPDECODE_FUZZ_EXAMPLES`` sets the examples per operation (``make fuzz``
raises it for a longer run)."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis import strategies as st  # noqa: E402
from schemathesis import checks as st_checks  # noqa: E402

from leapdecode import LLM  # noqa: E402
from leapdecode.server.api_server import build_app  # noqa: E402
from leapdecode.server.responses import ResponseStreamEvent  # noqa: E402
from tests.conftest import assert_no_leaks  # noqa: E402
from tests.server_helpers import live_server  # noqa: E402

EXAMPLES = int(os.environ.get("LEAPDECODE_FUZZ_EXAMPLES", "60"))
MAX_MODEL_LEN = 64  # a short context keeps every generated request fast: at most ~60 tokens of a tiny model
ERROR_FIELDS = {"message", "type", "param", "code"}
ANSWERS: Counter[str] = Counter()  # "METHOD path mode status" -> examples, printed at the end (pytest -s)


@pytest.fixture(scope="module")
def fuzz_llm(tiny_model_dir: Any) -> LLM:
    import torch

    torch.set_num_threads(1)
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=16, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def fuzz_app(fuzz_llm: LLM) -> Any:
    return build_app(fuzz_llm, model_name="tiny")


@pytest.fixture(scope="module")
def fuzz_server(fuzz_app: Any, fuzz_llm: LLM) -> Iterator[str]:
    with live_server(fuzz_app) as base:
        yield base
    assert_no_leaks(fuzz_llm)


@pytest.fixture(scope="module")
def fuzz_session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        s.trust_env = False  # loopback only: never through a proxy from the environment
        yield s


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_app: Any) -> Any:
    return schemathesis.openapi.from_dict(fuzz_app.openapi())


@schemathesis.check
def openai_error_body(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx/5xx answer carries OpenAI's error object (a 499 to a client that left has no body)."""
    if response.status_code < 400 or response.status_code == 499:
        return None
    body = json.loads(response.content)
    err = body["error"]
    if set(body) != {"error"} or set(err) != ERROR_FIELDS or not isinstance(err["message"], str) or not err["message"]:
        raise AssertionError(f"not an OpenAI error body: {body!r}")
    return None


CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
    st_checks.negative_data_rejection,
    openai_error_body,
]

# every operation of /openapi.json (test_the_schema_lists_exactly_these_operations keeps this list honest)
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/props"),
    ("GET", "/slots"),
    ("POST", "/detokenize"),
    ("GET", "/tokenizer_info"),
    ("GET", "/version"),
]
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


def test_the_schema_lists_exactly_these_operations(fuzz_app: Any) -> None:
    doc = fuzz_app.openapi()
    listed = {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}
    assert listed == set(OPERATIONS)
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        props = doc["components"]["schemas"][name]["properties"]
        assert {"model", "max_tokens", "temperature", "top_p", "stop", "stream", "seed"} <= set(props)
        assert ("messages" if "chat" in path else "prompt") in props


def test_the_responses_stream_is_declared_as_its_events(fuzz_app: Any, fuzz_server: str) -> None:
    """/v1/responses streams typed events, not chunks of its answer: the schema says so (a fuzzed stream was once
    checked against the whole response object and failed on its first event), and every event of a real stream
    fits the declared model."""
    doc = fuzz_app.openapi()
    sse = doc["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert sse["properties"]["data"]["contentSchema"]["$ref"].endswith("/ResponseStreamEvent")
    body = {"input": "hi", "stream": True, "max_output_tokens": 3}
    with httpx.stream("POST", fuzz_server + "/v1/responses", json=body, trust_env=False, timeout=60) as r:
        datas = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [d["type"] for d in datas]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    for d in datas:
        event = ResponseStreamEvent.model_validate(d)
        assert event.sequence_number == datas.index(d)
        assert (event.response is not None) == ("response" in d)


# a GET without parameters has no invalid input to generate: it gets positive examples only
FUZZ_RUNS = [(m, p, mode) for m, p in OPERATIONS for mode in MODES if m == "POST" or mode == MODES[0]]


@pytest.mark.parametrize("method,path,mode", FUZZ_RUNS, ids=[f"{m} {p} {mode.value}" for m, p, mode in FUZZ_RUNS])
def test_every_operation_answers_without_5xx(
    method: str, path: str, mode: Any, fuzz_schema: Any, fuzz_server: str, fuzz_session: requests.Session
) -> None:
    operation = fuzz_schema[path][method]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same examples every run: a failure here is reproducible
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        response = case.call_and_validate(base_url=fuzz_server, session=fuzz_session, checks=CHECKS, timeout=60)
        ANSWERS[f"{method} {path} {mode.value} {response.status_code}"] += 1

    fuzz()


# ------------------------------------------------------------------- near-valid bodies with hostile values
# schemathesis' random bodies mostly fail validation early; these pass it often, so the values reach the
# tokenizer, the sampler, the stop-string scan and the stream writer: unicode (lone surrogates included), nulls,
# numbers at the int64 / float edges, empty and huge stop lists, unknown fields holding nested junk.

INT_EDGES = [0, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1, -(2**63), -(2**63) - 1]
FLOAT_EDGES = [0.0, 5e-324, 1e-40, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 1e308, -0.0, -1e-300]
texts = st.text(st.characters(codec=None), max_size=40)



def mostly(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` about 5 times in 6: with a dozen fields, most bodies must still get through validation."""
    return st.one_of(*([valid] * 5), hostile)


ints = mostly(st.one_of(st.none(), st.integers(1, 40)), st.one_of(st.integers(-5, 99), st.sampled_from(INT_EDGES)))
floats = mostly(st.one_of(st.none(), st.floats(0.1, 1.0)), st.one_of(st.floats(-3, 3), st.sampled_from(FLOAT_EDGES)))
stops = st.one_of(
    st.none(),
    texts,
    st.lists(texts, max_size=6),
    st.builds(lambda n, s: [s + str(i) for i in range(n)], st.sampled_from([0, 64, 65, 5000]), texts),
)
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=12,
)
# the processors and constraints, near-valid: small schemas, regexes and grammars that compile, and ones that do not
SCHEMAS = [
    {"type": "object"},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "string", "maxLength": 4},
    {"enum": [1, "a", None]},
    {"type": "nonsense"},
    {"$ref": "#/nowhere"},
    {"type": "integer", "minimum": 5, "maximum": 1},
]
schema_texts = st.one_of(
    st.sampled_from(SCHEMAS).map(json.dumps),
    st.sampled_from(["", "not json", "[1, 2]", "null", '{"type": "integer"}', "[" * 5000, "[" * 50_000]),
    texts,
)
REGEXES = ["[a-z]+", "[0-9]{1,3}", "(yes|no)", "a*", ".*", "[", "(", "\\", "x{2,3}"]
GRAMMARS = ['root ::= "yes" | "no"', "root ::= [a-z]+", "root ::= ", "root ::= root", "junk"]
CHOICES = st.lists(mostly(st.sampled_from(["a", "yes", "no", "a b"]), texts), max_size=4)
structured_outputs = mostly(
    st.one_of(
        st.fixed_dictionaries({"choice": CHOICES}),
        st.fixed_dictionaries({"regex": st.sampled_from(REGEXES)}),
        st.fixed_dictionaries({"grammar": st.sampled_from(GRAMMARS)}),
        st.fixed_dictionaries(
            {"json": st.one_of(st.sampled_from(SCHEMAS), schema_texts)},
            optional={"disable_any_whitespace": st.booleans()},
        ),
    ),
    st.one_of(st.none(), junk, st.fixed_dictionaries({"choice": CHOICES, "regex": st.sampled_from(REGEXES)})),
)
response_formats = mostly(
    st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        st.builds(lambda sc: {"type": "json_schema", "json_schema": {"name": "r", "schema": sc}},
                  st.sampled_from(SCHEMAS)),
    ),
    st.one_of(st.none(), junk, st.just({"type": "json_schema"}), st.builds(lambda t: {"type": t}, texts)),
)
token_ids = mostly(st.integers(0, 49151).map(str), st.one_of(texts, st.sampled_from(INT_EDGES).map(str)))
bias_values = mostly(st.floats(-100, 100), st.sampled_from([*FLOAT_EDGES, 100.0, -100.0, 101.0]))
logit_biases = st.one_of(st.none(), st.dictionaries(token_ids, bias_values, max_size=4), st.just({"2": 100.0}))
min_tokens = mostly(st.sampled_from([0, 1, 5, 20]), st.one_of(st.integers(-2, 80), st.sampled_from(INT_EDGES)))
common = st.fixed_dictionaries(
    {},
    optional={
        "model": mostly(st.sampled_from([None, "tiny", "default"]), texts),
        "max_tokens": ints,
        "temperature": floats,
        "top_p": floats,
        "top_k": mostly(st.sampled_from([None, -1, 1, 5, 49152]), st.one_of(ints, st.just(49153))),
        "min_p": floats,
        "repetition_penalty": floats,
        "seed": ints,
        "stop": stops,
        "stop_token_ids": st.one_of(st.none(), st.lists(ints, max_size=4)),
        "stream": st.booleans(),
        "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
        "ignore_eos": st.booleans(),
        "speculative": st.booleans(),
        "n": mostly(st.sampled_from([None, 1]), st.just(2)),
        "x_junk": junk,
        "min_tokens": min_tokens,
        "logit_bias": logit_biases,
        "structured_outputs": structured_outputs,
        "response_format": response_formats,
    },
)
PARAMETERS = [None, {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}, *SCHEMAS[2:5]]
tools = st.lists(
    st.builds(
        lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
        mostly(st.sampled_from(["f", "get_x"]), texts),
        st.sampled_from(PARAMETERS),
    ),
    max_size=3,
)
tool_choices = mostly(
    st.sampled_from(["none", "required", {"type": "function", "function": {"name": "f"}}]),
    st.one_of(st.just("auto"), st.builds(lambda n: {"type": "function", "function": {"name": n}}, texts), junk),
)
chat_extras = st.fixed_dictionaries(
    {},
    optional={
        "tools": tools,
        "tool_choice": tool_choices,
        "logprobs": mostly(st.booleans(), st.none()),
        "top_logprobs": mostly(st.integers(0, 5), st.one_of(st.integers(-1, 30), st.none())),
    },
)
completion_extras = st.fixed_dictionaries(
    {},
    optional={
        "logprobs": mostly(st.integers(0, 5), st.one_of(st.integers(-1, 30), st.none())),
        "echo": st.booleans(),
    },
)
message = st.fixed_dictionaries(
    {
        "role": mostly(st.sampled_from(["system", "user", "assistant", "developer"]), st.sampled_from(["tool", "x"])),
        "content": mostly(
            texts, st.one_of(st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts})))
        ),
    }
)
chat_bodies = st.builds(
    lambda c, x, m: {**c, **x, "messages": m}, common, chat_extras, st.lists(message, min_size=1, max_size=4)
)
prompts = mostly(
    st.one_of(texts.filter(bool), st.lists(st.integers(0, 49151), min_size=1, max_size=8)),
    st.one_of(st.lists(ints, max_size=8), st.lists(texts, max_size=2)),
)
completion_bodies = st.builds(lambda c, x, p: {**c, **x, "prompt": p}, common, completion_extras, prompts)


def check_answer(response: httpx.Response, stream: bool) -> None:
    """2xx or 4xx; an error is OpenAI's error body; a success parses (a stream ends with ``data: [DONE]``)."""
    assert response.status_code in (200, 400, 404), (response.status_code, response.text[:500])
    if response.status_code != 200:
        err = response.json()["error"]
        assert set(err) == ERROR_FIELDS and err["message"], err
    elif stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_near_valid_hostile_bodies(path: str, fuzz_server: str) -> None:
    bodies = chat_bodies if "chat" in path else completion_bodies

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
              database=None)
    @given(body=bodies)
    def fuzz(body: dict[str, Any]) -> None:
        raw = json.dumps(body)  # lone surrogates go out as \ud800 escapes, as a hostile client may send them
        with httpx.Client(base_url=fuzz_server, trust_env=False, timeout=60) as http:
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        ANSWERS[f"POST {path} near-valid {r.status_code}"] += 1
        check_answer(r, bool(body.get("stream")) and r.status_code == 200)

    fuzz()


# what the fuzzers above found or the issue named, pinned: (path, body, status, error param)
EDGES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**63 - 1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -(2**63)}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4.0}, 200, None),  # an integer to JSON Schema
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": 4.0, "temperature": 1.0, "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63), "temperature": 1.0, "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**63], "max_tokens": 2}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop": [], "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(64)], "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(200_000)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 100_000, "max_tokens": 2, "stream": True}, 200, None),
    ("/v1/completions", {"prompt": "hi", "stream": None, "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e308}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 5e-324, "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "hi", "x": [[[[{"a": None}]]]], "max_tokens": 2}, 200, None),
    (
        "/v1/completions",
        {"prompt": "hi", **dict.fromkeys(["model", "max_tokens", "temperature", "top_p", "stop", "seed", "user"])},
        200,
        None,
    ),
]


@pytest.mark.parametrize("path,body,status,param", EDGES, ids=[str(i) for i in range(len(EDGES))])
def test_edge_values(path: str, body: dict[str, Any], status: int, param: str | None, fuzz_server: str) -> None:
    with httpx.Client(base_url=fuzz_server, trust_env=False, timeout=60) as http:
        r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text[:300]
    check_answer(r, bool(body.get("stream")))
    if status != 200:
        assert r.json()["error"]["param"] == param
    if "\ud800" in json.dumps(body) or "\udfff" in json.dumps(body):
        assert "lone surrogate" in r.json()["error"]["message"]


def test_server_alive_and_clean_after_fuzzing(fuzz_server: str, fuzz_llm: LLM) -> None:
    # runs after the fuzz test (file order): the server still answers, nothing is stuck, nothing leaked
    print("\nfuzz answers:", json.dumps(dict(sorted(ANSWERS.items())), indent=1))
    with httpx.Client(base_url=fuzz_server, trust_env=False, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        metrics = http.get("/metrics").text
    five = [x for x in metrics.splitlines() if x.startswith("leapdecode_requests_total") and 'status="5' in x]
    assert not five, five
    bm = fuzz_llm.engine.block_manager
    for _ in range(200):  # aborted streams free their blocks on the engine thread
        if bm.num_free_blocks == bm.num_blocks:
            break
        time.sleep(0.05)
    assert bm.num_free_blocks == bm.num_blocks
