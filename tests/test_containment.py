"""One request's failure stays its own: an error while processing a request inside an engine step (its forward,
its sampling, its grammar, drafting for it) fails that request alone, and the requests batched with it finish
token-identical to running alone; a grammar that has ended ends its sequence even below ``min_tokens``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from leapdecode import LLM, SamplingParams, StructuredOutputsParams
from leapdecode.engine.llm_engine import RequestFailedError

from .conftest import SPEC_PROMPTS, assert_no_leaks
from .poison import Exploding

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=128, max_num_seqs=8)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw})


def tokens(llm: LLM, prompt: str) -> list[int]:
    return llm.engine.tokenizer.encode(prompt)


def alone(llm: LLM, prompts: list[str]) -> list[list[int]]:
    """Each prompt's greedy tokens, run by itself."""
    out = []
    for p in prompts:
        rid = llm.engine.add_request(tokens(llm, p), greedy())
        while llm.engine.has_unfinished_requests():
            done = [o for o in llm.engine.step() if o.finished and o.request_id == rid]
        out.append(done[0].outputs[0].token_ids)
    return out


def run(llm: LLM, prompts: list[str], poison: SamplingParams, arm: Callable[[str], None]):
    """The prompts' requests and a poisoned one (``arm(its id)`` sets the trap) stepped together to the end."""
    eng = llm.engine
    ids = [eng.add_request(tokens(llm, p), greedy()) for p in prompts]
    bad = eng.add_request(tokens(llm, "Poisoned request"), poison)
    arm(bad)
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i].outputs[0].token_ids for i in ids], bad, finals, eng.take_failed()


def test_a_failing_forward_fails_only_its_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    want = alone(llm, SPEC_PROMPTS[:3])
    eng, real, seen = llm.engine, llm.engine.runner.execute, []

    def arm(bad: str) -> None:
        seq = eng.requests[bad][0]

        def execute(items):
            if any(it.block_table == seq.block_table for it in items):
                seen.append(len(items))
                if len(seen) >= 3:  # from mid-decode on, batched with the others and alone
                    raise RuntimeError("simulated forward failure")
            return real(items)

        monkeypatch.setattr(eng.runner, "execute", execute)

    got, bad, finals, failed = run(llm, SPEC_PROMPTS[:3], greedy(), arm)
    assert got == want
    assert seen[2:] == [4, 1] and set(failed) == {bad} and bad not in finals  # batched, then retried alone
    assert isinstance(failed[bad], RequestFailedError) and "simulated forward failure" in str(failed[bad])
    assert eng.failed_forwards == 0  # the others' forwards ran: the engine is healthy
    assert_no_leaks(llm)


@pytest.mark.parametrize("method,at", [("allowed_tokens", 3), ("accept", 2)])
def test_a_failing_grammar_fails_only_its_request(llm: LLM, method: str, at: int) -> None:
    pytest.importorskip("xgrammar")
    want = alone(llm, SPEC_PROMPTS[:3])
    eng = llm.engine
    # (min_tokens keeps its end token masked: it runs as long as the others unless it fails)
    so = StructuredOutputsParams(regex="[a-z ]+")
    poison = greedy(ignore_eos=False, min_tokens=MAX_TOKENS, structured_outputs=so)

    def arm(bad: str) -> None:
        seq = eng.requests[bad][0]
        seq.grammar = Exploding(seq.grammar, method, at)

    got, bad, finals, failed = run(llm, SPEC_PROMPTS[:3], poison, arm)
    assert got == want and set(failed) == {bad} and bad not in finals
    assert f"simulated failure in {method}" in str(failed[bad])
    assert_no_leaks(llm)


def test_llm_generate_raises_the_failed_requests_error(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    real = llm.engine.runner.execute

    def execute(items):
        if any(len(it.tokens) == 1 for it in items):  # every decode step
            raise RuntimeError("simulated forward failure")
        return real(items)

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    with pytest.raises(RequestFailedError, match="simulated forward failure"):
        llm.generate(SPEC_PROMPTS[:2], greedy(), use_tqdm=False)
    assert llm.engine.failed_forwards >= 1 and not llm.engine.take_failed()
    monkeypatch.undo()
    assert llm.generate(SPEC_PROMPTS[0], greedy(), use_tqdm=False)[0].finished
    assert llm.engine.failed_forwards == 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("speculative", [False, True])
def test_an_ended_grammar_ends_the_sequence_below_min_tokens(tiny_model_dir, speculative: bool) -> None:
    # the grammar accepts "a" then only its end; min_tokens=5 masks the stop token, the sampler lets the grammar's
    # end through, and the sequence must end there (it used to sample a token the ended grammar refused)
    pytest.importorskip("xgrammar")
    spec = {"method": "ngram", "num_speculative_tokens": 3} if speculative else None
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, speculative_config=spec)
    so = StructuredOutputsParams(choice=["a"])
    for temperature in (0.0, 1.0):
        p = SamplingParams(temperature=temperature, seed=3, max_tokens=8, min_tokens=5, structured_outputs=so)
        outs = llm.generate(["Say a", "Hello"], p, use_tqdm=False)
        for o in outs:
            assert (o.outputs[0].text, o.outputs[0].finish_reason) == ("a", "stop")
    # a grammar that can go on still honours min_tokens: stop tokens stay masked while it allows anything else
    p = greedy(ignore_eos=False, min_tokens=6, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    c = llm.generate("Hello", p, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 6 and c.text.isalpha()
    assert_no_leaks(llm)
