"""Grammar compiles are bounded (structured/limits.py, structured/xgrammar_backend.py): size and depth caps refuse
a constraint before anything compiles, a compile past the timeout is given up by its request, compiles run
concurrently (one slow compile never holds a small one behind it), one spec compiles once however many ask, the
compiled-grammar cache is bounded in bytes, and the tensor-parallel worker takes rank 0's compiled grammar."""

from __future__ import annotations

import json
import threading

import pytest

from leapdecode import LLM, SamplingParams, StructuredOutputsParams
from leapdecode.engine.worker import AddRequest, apply
from leapdecode.structured import GrammarLimitError, GrammarLimits
from leapdecode.structured.limits import json_depth, regex_depth

pytest.importorskip("xgrammar")


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=64)


@pytest.fixture
def backend(llm):
    return llm.engine.structured_backend()


def forbid_compiles(monkeypatch, backend) -> None:
    def refuse(params):
        raise AssertionError(f"compiled {params.kind} although it was over a limit")

    monkeypatch.setattr(backend, "_compile_now", refuse)


def test_depth_and_size_are_measured_without_recursion():
    assert json_depth(json.dumps(nested_schema(3))) == 7
    assert json_depth('{"a": "[{[{", "b": [1, {"c": "\\"{"}]}') == 3  # brackets inside strings do not count
    assert json_depth("[" * 100_000 + "]" * 100_000) == 100_000
    assert regex_depth(r"(a(b)[(((]\(c)") == 2
    with pytest.raises(ValueError, match="max_json_depth"):
        GrammarLimits(max_json_depth=0)
    with pytest.raises(ValueError, match="compile_timeout_s"):
        GrammarLimits(compile_timeout_s=0)


def test_over_limit_constraints_are_refused_before_compiling(llm, backend, monkeypatch):
    forbid_compiles(monkeypatch, backend)
    deep = StructuredOutputsParams(json=nested_schema(470))
    with pytest.raises(GrammarLimitError, match=r"nested 941 levels deep.*max_json_depth\) is 64"):
        backend.submit(deep)
    with pytest.raises(GrammarLimitError, match="max_json_depth"):  # the engine's own path refuses it too
        llm.generate("hi", SamplingParams(max_tokens=2, structured_outputs=deep), use_tqdm=False)
    with pytest.raises(GrammarLimitError, match="max_regex_depth"):
        backend.submit(StructuredOutputsParams(regex="(" * 40 + "a" + ")" * 40))
    with pytest.raises(GrammarLimitError, match=r"max_spec_bytes\) is 65536"):
        backend.submit(StructuredOutputsParams(grammar="root ::= " + " | ".join(['"x"'] * 20_000)))
    with pytest.raises(GrammarLimitError, match="max_choices"):
        backend.submit(StructuredOutputsParams(choice=[f"c{i}" for i in range(2000)]))
    assert not llm.engine.requests


def test_cache_is_bounded_in_bytes(backend):
    assert backend.cache_limit_bytes == GrammarLimits().cache_bytes > 0


def test_slow_compile_holds_nobody_and_times_out_alone(backend, monkeypatch):
    """A compile that hangs (stand-in for a pathological grammar) neither blocks another spec's compile nor is
    started twice; a request waiting on it gives up after the timeout, naming the limit."""
    real = backend._compile_now
    release, calls = threading.Event(), []

    def compile_now(params):
        calls.append(params.key())
        if params.regex == "slow+":
            assert release.wait(30)
        return real(params)

    monkeypatch.setattr(backend, "_compile_now", compile_now)
    monkeypatch.setattr(backend, "limits", GrammarLimits(compile_timeout_s=0.3))
    slow = StructuredOutputsParams(regex="slow+")
    first = backend.submit(slow)
    try:
        assert backend.submit(slow) is first  # the same spec joins the running compile
        small = backend.compile(StructuredOutputsParams(choice=["yes", "no"]))  # not behind the slow one
        assert small.handle is not None and not first.done()
        with pytest.raises(GrammarLimitError, match=r"compile time limit \(compile_timeout_s\) of 0.3 s"):
            backend.compile(slow)
    finally:
        release.set()
    assert first.result(timeout=30).key == slow.key()
    assert calls.count(slow.key()) == 1


def test_worker_takes_rank0s_compiled_grammar(llm, backend, monkeypatch):
    """The tensor-parallel worker's ``apply`` builds its matcher from rank 0's serialised grammar: it never
    compiles (so never inside a step's collectives), and the matcher is the same language."""
    so = StructuredOutputsParams(choice=["yes", "no"])
    wire = backend.to_wire(backend.compile(so))
    forbid_compiles(monkeypatch, backend)
    params = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=so)
    apply(llm.engine, AddRequest([5, 6, 7], params, "from-rank0", None, wire))
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert [o.outputs[0].text for o in outs if o.finished] in (["yes"], ["no"])
