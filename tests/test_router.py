"""The strategy router behind ``auto`` (speculative/router.py): task classifier, decision-tree branches, the per-step
pick, per-task acceptance, the copy detector, typed constraints, and the route an engine run reports."""

from __future__ import annotations

import time

import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.bench.rows import Row, explain_rows
from leapdecode.cli import main
from leapdecode.engine.sequence import Sequence
from leapdecode.outputs import RequestMetrics
from leapdecode.speculative.methods.blockwise import lossy_blockwise
from leapdecode.speculative.policy import StepCostModel
from leapdecode.speculative.registry import METHODS, parse_config
from leapdecode.speculative.router import (
    MIN_TASK_DRAFTS,
    AutoOptions,
    DomainDetector,
    DrafterFacts,
    Router,
    TaskAcceptance,
    classify_task,
    pick,
    plan_route,
)
from leapdecode.speculative.state import DraftState, GammaState, Route

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks


@pytest.fixture(scope="module")
def plain_tiny(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


ALL = [DrafterFacts(n, mb, METHODS[n].auto.branch, METHODS[n].auto.rank)  # type: ignore[union-attr]
       for n, mb in (("ngram", 0), ("draft_model", 40), ("self_spec", 12), ("eagle", 30), ("medusa", 20),
                     ("blockwise", 20))]


@pytest.mark.parametrize("text,task", [
    ("Write a Python function that returns the n-th Fibonacci number.", "code"),
    ("def add(a, b):\n    \"\"\"Return the sum of a and b.\n    >>> add(1, 2)\n    3\n    \"\"\"\n", "code"),
    ("Solve for x: 3x + 5 = 20. Show your steps.", "math"),
    ("What is the probability of rolling two sixes with two dice?", "math"),
    ("Read the following passage and extract every date it mentions:\nOn 4 May the council met...", "grounded"),
    ("Summarize the article below in three bullet points.\n\n" + "The council met again. " * 40, "grounded"),
    ("Translate this sentence into French: the cat sleeps on the warm roof.", "translation"),
    ("What are some good ways to spend a rainy Sunday?", "chat"),
    ("Write a short poem about the sea at night.", "chat"),
])
def test_classifier_reads_the_task_from_the_prompt(text, task):
    assert classify_task(text) == task


def test_tree_branches_for_given_constraints():
    # lossless, change allowed (default): the Medusa family first, then the separate drafters
    r = plan_route("chat", AutoOptions(), ALL)
    assert r.branch == ["lossless", "change allowed: Medusa"]
    assert r.candidates == ("medusa", "eagle", "self_spec", "draft_model", "ngram") and not r.departures
    # lossless with minimal change: speculative decoding with a separate drafter only
    r = plan_route("code", AutoOptions(minimal_change=True), ALL)
    assert r.candidates == ("draft_model", "ngram") and r.branch[-1] == "minimal change: speculative decoding"
    # lossy allowed: block-parallel decoding, or non-autoregressive blocks under an extreme latency target
    r = plan_route("chat", AutoOptions(lossless=False, latency_slo_ms=50), ALL)
    assert r.candidates == ("blockwise",) and r.branch[-1] == "block-parallel decoding"
    r = plan_route("chat", AutoOptions(lossless=False, latency_slo_ms=5), ALL)
    assert r.candidates == ("blockwise",) and "non-autoregressive" in r.branch[-1]
    # lossy allowed but the target must stay untouched: blockwise heads read its hidden states, so prompt lookup
    # and the draft model, and the route says why
    r = plan_route("chat", AutoOptions(lossless=False, minimal_change=True), ALL)
    assert r.candidates == ("draft_model", "ngram") and "minimal change rules out blockwise" in r.departures[0]
    # lossy without blockwise heads: the lossless branch, and the route says why
    r = plan_route("chat", AutoOptions(lossless=False), [f for f in ALL if f.name != "blockwise"])
    assert r.candidates[0] == "medusa" and "no lossy drafter fits" in r.departures[0]
    # a memory budget leaves out the drafters over it, each named
    r = plan_route("chat", AutoOptions(memory_budget_mb=25), ALL)
    assert r.candidates == ("medusa", "self_spec", "ngram")
    assert {d.split(" ")[0] for d in r.departures} == {"draft_model", "eagle"}
    # no drafter of the Medusa family here: speculative decoding instead, said so
    r = plan_route("chat", AutoOptions(), [f for f in ALL if f.name in ("ngram", "draft_model")])
    assert r.candidates == ("draft_model", "ngram") and "speculative decoding instead" in r.departures[0]
    assert "task=chat; lossless -> change allowed: Medusa [draft_model, ngram]; departs: no drafter" in r.explain()


def test_lossy_settings_follow_the_latency_target():
    assert lossy_blockwise(AutoOptions(lossless=False), 8) == lossy_blockwise(AutoOptions(lossless=False,
                                                                                          latency_slo_ms=40), 8)
    s = lossy_blockwise(AutoOptions(lossless=False, latency_slo_ms=5), 8)
    assert (s.k, s.acceptance, s.min_block, s.lossy) == (8, "topk", 8, True)
    assert lossy_blockwise(AutoOptions(lossless=False), 6).min_block == 0


def test_pick_follows_the_tree_unless_measurement_disagrees():
    route = Route("chat", ["lossless"], ("medusa", "eagle", "ngram"))
    assert pick(route, {}) == (None, 0, None)
    # within 5% of the best: the tree's choice stands
    assert pick(route, {"medusa": (4, 97.0), "eagle": (3, 100.0)}) == ("medusa", 4, None)
    # clearly slower: the best instead, with both rates
    name, k, note = pick(route, {"medusa": (4, 60.0), "eagle": (3, 100.0), "ngram": (2, 99.0)})
    assert (name, k) == ("eagle", 3) and note == "medusa -> eagle: medusa measured 60.0 tok/s < 100.0"
    # the tree's first choice does not draft at all here
    name, _, note = pick(route, {"ngram": (2, 50.0)})
    assert name == "ngram" and "does not beat plain decoding" in note


def test_task_acceptance_is_measured_before_it_is_used():
    t = TaskAcceptance()
    t.record("code", "ngram", MIN_TASK_DRAFTS - 1, 30)
    assert t.acceptance("code", "ngram") is None
    t.record("code", "ngram", 1, 0)
    assert t.acceptance("code", "ngram") == pytest.approx(30 / MIN_TASK_DRAFTS)
    assert t.acceptance("chat", "ngram") is None


class _Seq:
    """The few fields of a Sequence the copy detector reads."""

    def __init__(self, prompt: list[int]) -> None:
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.request_id = f"seq{id(self)}"
        self.draft_state = DraftState()  # what the speculator would keep for it


def test_copy_detector_switches_from_copying_to_writing_and_back():
    prompt = list(range(100, 160))
    seq, det = _Seq(prompt), DomainDetector()
    events = []
    stream = prompt[:40] + list(range(1000, 1040)) + prompt[:40]  # copy, write fresh text, copy again
    for i, tok in enumerate(stream):
        seq.token_ids.append(tok)
        new = det.update(seq, seq.draft_state.domain)  # type: ignore[arg-type]
        if new:
            events.append((i, new))
    assert [e[1] for e in events] == ["writing", "copying"]
    assert 40 < events[0][0] < 50 and 80 < events[1][0] < 90  # within a few tokens of each change
    # tokens are indexed once: feeding nothing new changes nothing
    st = seq.draft_state.domain
    before = (st.seen, st.hit_rate)
    assert det.update(seq, st) is None and (st.seen, st.hit_rate) == before  # type: ignore[arg-type]


def test_auto_constraints_are_typed_options():
    cfg = parse_config({"method": "auto", "lossless": False, "latency_slo_ms": 8,
                        "memory_budget_mb": 64, "minimal_change": True})
    assert cfg is not None
    assert cfg.options(AutoOptions) == AutoOptions(lossless=False, minimal_change=True, latency_slo_ms=8,
                                                   memory_budget_mb=64)
    with pytest.raises(ValueError, match="unknown speculative option 'lossles'.*latency_slo_ms"):
        parse_config({"method": "auto", "lossles": False})
    with pytest.raises(ValueError, match="lossless must be true or false"):
        parse_config({"method": "auto", "lossless": "no"})
    with pytest.raises(ValueError, match="latency_slo_ms must be a positive number"):
        parse_config({"method": "auto", "latency_slo_ms": -1})
    with pytest.raises(ValueError, match="unknown speculative option 'memory_budget_mb'"):
        parse_config({"method": "ngram", "memory_budget_mb": 10})


def test_auto_reports_its_route_per_request_and_stays_lossless(tiny_model_dir, plain_tiny):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "auto", "model": str(tiny_model_dir),
                                                                "methods": ["ngram", "draft_model"]})
    # verification as cheap as a plain step, so drafting pays whatever this machine's timing
    spec.engine.speculator.cost = StepCostModel([(1, 1.0), (65, 1.0)])
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    base = plain_tiny.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    for o in outs:
        m = o.metrics
        # no drafter of the Medusa family on this tiny model: speculative decoding with the draft model
        assert m.route.startswith("task=") and "[draft_model, ngram]" in m.route
        assert sum(m.draft_methods.values()) > 0 and set(m.draft_methods) <= {"ngram", "draft_model"}
        assert m.to_dict()["route"] == m.route
    assert_no_leaks(spec)
    # a memory budget below the draft model's size leaves it out, and the route says so
    small = LLM.from_engine_of(plain_tiny, speculative_config={"method": "auto", "model": str(tiny_model_dir),
                                                               "memory_budget_mb": 0.5,
                                                               "methods": ["ngram", "draft_model"]})
    small.engine.speculator.cost = StepCostModel([(1, 1.0), (65, 1.0)])
    m = small.generate(PROMPTS[:1], params, use_tqdm=False)[0].metrics
    assert "[ngram]" in m.route and "draft_model holds" in m.route and set(m.draft_methods) <= {"ngram"}


def test_a_switch_restarts_the_drafter_estimates(tiny_model_dir, plain_tiny):
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "auto", "model": str(tiny_model_dir),
                                                                "methods": ["ngram", "draft_model"]})
    sp = spec.engine.speculator
    seq = _Seq([5, 6, 7])
    seq.metrics = type("M", (), {"route": None})()  # type: ignore[attr-defined]
    seq.prompt_token_ids = seq.token_ids  # type: ignore[attr-defined]
    for name in ("ngram", "draft_model"):
        sp.state(seq, name).acceptance_ema = 0.05  # type: ignore[arg-type]
    sp.draft_state(seq).domain.hit_rate = 0.9  # type: ignore[arg-type]
    sp._restart_estimates(seq)  # type: ignore[arg-type]
    assert sp.state(seq, "ngram").acceptance_ema == 0.9  # type: ignore[arg-type]
    prior = sp.proposers["draft_model"].acceptance_prior()
    assert sp.state(seq, "draft_model").acceptance_ema == prior  # type: ignore[arg-type]


def test_a_drafter_with_nothing_to_propose_sits_the_step_out_unpenalised(tiny_model_dir, plain_tiny):
    """Prompt lookup without a match is no candidate for the step (the next drafter takes it, or nobody), and its
    acceptance estimate stays where it was, so it drafts again at the next match."""
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "auto", "model": str(tiny_model_dir),
                                                                "methods": ["ngram", "draft_model"]})
    sp = spec.engine.speculator
    sp.cost = StepCostModel([(1, 1.0), (65, 1.0)])  # verification as cheap as a plain step: drafting pays
    sp.proposers["draft_model"].step_cost_fn = lambda n: 0.0
    params = SamplingParams(temperature=0, max_tokens=24)
    fresh = Sequence("fresh", [3, 4, 5, 6, 7, 8], params)  # no n-gram occurs twice: nothing to look up
    repeat = Sequence("repeat", [3, 4, 5, 6, 3, 4], params)  # (3, 4) occurred before: lookup proposes 5, 6
    for seq in (fresh, repeat):
        sp.state(seq, "ngram").acceptance_ema = 0.9
        sp.state(seq, "draft_model").acceptance_ema = 0.3
    assert not sp.proposers["ngram"].has_draft(fresh) and sp.proposers["ngram"].has_draft(repeat)
    limits = sp.draft_limits([fresh, repeat], 1)
    assert limits["fresh"] > 0 and sp.draft_state(fresh).method == "draft_model"
    assert limits["repeat"] > 0 and sp.draft_state(repeat).method == "ngram"
    assert sp.state(fresh, "ngram").acceptance_ema == 0.9


@pytest.mark.parametrize("slow", [False, True])
def test_drafting_time_its_model_does_not_predict_counts_against_a_drafter(tiny_model_dir, plain_tiny, slow):
    """The drafter's step-cost model says drafting is free, and the target drafts for itself (every draft is
    accepted), so drafting pays; unless proposing really takes 50 ms a call (5 target steps): that measured time
    beyond the model enters the drafter's rate after its first call, and it stops drafting (the measurement fades
    while it sits out, so it would try again much later)."""
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "draft_model", "model": str(tiny_model_dir)})
    sp = spec.engine.speculator
    sp.cost = StepCostModel([(1, 0.01), (65, 0.01)])
    prop = sp.proposer
    prop.step_cost_fn = lambda n: 0.0
    propose = prop.propose

    def timed(seqs, budgets):  # type: ignore[no-untyped-def]
        if slow:
            time.sleep(0.05)
        return propose(seqs, budgets)

    prop.propose = timed  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = spec.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    drafted = sum(out.metrics.draft_methods.values())
    if slow:
        # measured once (50 ms beyond the model), then fading 2% a step while it sits out: still far over a step
        assert sp.propose_s["draft_model"] > 0.02 and drafted <= 2, (sp.propose_s, drafted)
    else:
        assert drafted >= 4 and sp.propose_s["draft_model"] < 0.04
    assert out.outputs[0].token_ids == plain_tiny.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_task_starts_where_its_earlier_requests_measured():
    router = Router(AutoOptions(), ALL, lambda ids: "Write a Python function that sorts a list." if ids[0] == 1
                    else "Tell me about the sea.", {"medusa": 0.1})
    code, chat = _Seq([1, 2, 3]), _Seq([7, 8, 9])
    for s in (code, chat):
        s.prompt_token_ids = s.token_ids  # type: ignore[attr-defined]
        s.metrics = RequestMetrics()  # type: ignore[attr-defined]
    assert router.route(code, code.draft_state).task == "code"  # type: ignore[arg-type]
    assert router.route(chat, chat.draft_state).task == "chat"  # type: ignore[arg-type]
    assert "medusa left out: its measured acceptance 0.10" in code.metrics.route  # type: ignore[attr-defined]
    assert router.prior(code, code.draft_state, "ngram", 0.7) == 0.7  # type: ignore[arg-type]
    code.draft_state.gamma["ngram"] = GammaState(3, drafted=MIN_TASK_DRAFTS, accepted=MIN_TASK_DRAFTS // 4)
    router.finish(code.draft_state)
    later = _Seq([1, 5])
    later.prompt_token_ids = later.token_ids  # type: ignore[attr-defined]
    later.metrics = RequestMetrics()  # type: ignore[attr-defined]
    assert router.prior(later, later.draft_state, "ngram", 0.7) == 0.25  # type: ignore[arg-type]
    assert router.prior(chat, chat.draft_state, "ngram", 0.7) == 0.7  # type: ignore[arg-type]  # another task: not measured yet


def test_generate_explain_prints_the_route(tiny_model_dir, capsys):
    assert main(["generate", "a b c a b c a b", "--model", str(tiny_model_dir), "--max-tokens", "6",
                 "--speculative-config", '{"method": "auto", "methods": ["ngram"]}', "--explain"]) == 0
    err = capsys.readouterr().err
    assert "[route: task=chat; lossless -> change allowed: Medusa [ngram]" in err and "domain switches: 0" in err
    rows = [Row("leapdecode", "auto", 1, 2, 10, 1.0, 1.0, 1.0, routes={"task=chat; x": 2},
                draft_methods={"ngram": 3})]
    assert explain_rows(rows) == ["- auto at batch 1: steps drafted by method: ngram 3",
                                  "  - 2 request(s): task=chat; x"]
