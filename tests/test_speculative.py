"""What every speculative method shares: the acceptance rules, dynamic draft length and the step-cost model, the
option parser (every key a method does not read is refused), and the speculator's sizing through ``LLM``; each
method's own behaviour is tested in its own file (test_ngram.py, test_draft_model.py, test_eagle.py, ...)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from leapdecode import LLM, SamplingParams
from leapdecode.config import SpeculativeConfig
from leapdecode.speculative.acceptance import verify_greedy, verify_sampling
from leapdecode.speculative.methods.hybrid import HybridOptions
from leapdecode.speculative.options import DrafterOptions
from leapdecode.speculative.policy import DynamicGamma, StepCostModel, TreeRealism, expected_tokens
from leapdecode.speculative.proposer import Proposal, Proposer
from leapdecode.speculative.registry import parse_config
from leapdecode.speculative.speculator import LEARN_ROWS_WITHOUT_HEADROOM, LEARN_SHARE, Speculator
from leapdecode.speculative.state import DraftState

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks


def _texts(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# ------------------------------------------------------------------------------------------ pure functions
def test_verify_greedy_accepts_longest_matching_prefix_plus_bonus():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == ([5, 6, 7, 8], 3)
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == ([5, 9], 1)
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == ([4], 0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_first_token_is_distributed_as_p(deterministic):
    """Chi-square: the first emitted token follows p whatever q is (q = one-hot for lookup drafters)."""
    g = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.tensor([[0.05, 0.4, 0.1, 0.25, 0.15, 0.05]] * 3)
    q = torch.tensor([[0.3, 0.1, 0.3, 0.1, 0.1, 0.1]] * 2)
    n = 12000
    counts = torch.zeros(vocab)
    for _ in range(n):
        if deterministic:
            drafts, qq = [2, 3], None
        else:
            drafts = [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))]
            qq = q
        tokens, _ = verify_sampling(p, drafts, qq, g)
        counts[tokens[0]] += 1
    stat = chisquare(counts.numpy(), (p[0] * n).numpy())
    assert stat.pvalue > 1e-3, (counts / n, p[0])


def test_dynamic_gamma_rule_step_by_step():
    dg = DynamicGamma(SpeculativeConfig(method="ngram"))
    st = dg.new_state()
    assert st.gamma == 3
    for i in range(4):
        dg.update(st, 4, 4)  # 100% > 80%
        assert st.gamma == 3, i
    dg.update(st, 4, 4)
    assert st.gamma == 4  # fifth consecutive high
    dg.update(st, 4, 3)  # 75%: neither high nor low -> streaks reset
    for _ in range(4):
        dg.update(st, 4, 4)
    assert st.gamma == 4
    dg.update(st, 4, 4)
    assert st.gamma == 5
    for _ in range(2):
        dg.update(st, 4, 1)  # 25% < 50%
    assert st.gamma == 5
    dg.update(st, 4, 1)
    assert st.gamma == 4  # third consecutive low
    for _ in range(30):
        dg.update(st, 4, 0)
    assert st.gamma == 1  # floor
    for _ in range(100):
        dg.update(st, 1, 1)
    assert st.gamma == 8  # cap
    fixed = DynamicGamma(SpeculativeConfig(method="ngram", num_speculative_tokens=5))
    st = fixed.new_state()
    for _ in range(20):
        fixed.update(st, 5, 0)
    assert st.gamma == 5


def test_cost_model_turns_speculation_off_when_verification_is_expensive():
    flat = StepCostModel([(1, 1.0), (2, 1.0), (9, 1.0), (65, 8.0)])  # GPU-like: extra tokens are free
    assert flat.best_gamma(0.6, 8, 1, 1) >= 6  # long drafts when verifying is free
    steep = StepCostModel([(1, 1.0), (2, 2.0), (9, 9.0), (65, 65.0)])  # cost linear in tokens
    assert steep.best_gamma(0.9, 8, 1, 1) == 0
    cpu = StepCostModel([(1, 1.0), (2, 1.1), (5, 1.4), (9, 2.5)])
    assert cpu.best_gamma(0.1, 8, 1, 1) == 0
    assert cpu.best_gamma(0.9, 8, 1, 1) >= 3
    assert abs(expected_tokens(0.5, 3) - 1.875) < 1e-9


# --------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def plain_tiny(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=256)


def test_bad_speculative_config_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown speculative method"):
        LLM(model=str(tiny_model_dir), speculative_config={"method": "magic"})
    with pytest.raises(ValueError, match="needs"):
        LLM(model=str(tiny_model_dir), speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=str(tiny_model_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_unknown_speculative_option_is_an_error_naming_the_valid_ones(tiny_model_dir):
    """A typo must not be silently ignored: the error names the key and the options the method does read."""
    for cfg, key, valid in [
        ({"method": "eagle", "tree_node": 4}, "tree_node", "tree_nodes"),
        ({"method": "ngram", "min_draft_prob": 0.1}, "min_draft_prob", "prompt_lookup_min"),
        ({"method": "medusa", "tree_beam": 2}, "tree_beam", "typical_acceptance"),
        ({"method": "blockwise", "branches": 2}, "branches", "min_block"),
    ]:
        with pytest.raises(ValueError, match=f"unknown speculative option '{key}'.*{valid}"):
            parse_config(cfg)
    with pytest.raises(ValueError, match="unknown speculative option 'tree_node'"):
        LLM(model=str(tiny_model_dir), speculative_config={"method": "eagle", "tree_node": 4})
    # one spelling per concept: the old spellings are refused like any other unknown key
    for old in ({"method": "medusa", "topk": 4}, {"method": "eagle", "tree_topk": 3}):
        with pytest.raises(ValueError, match="unknown speculative option"):
            parse_config(old)
    cfg = parse_config({"method": "hybrid", "branches": 2, "top_k": 5, "min_draft_prob": 0.2})
    assert cfg is not None
    hybrid = cfg.options(HybridOptions)
    assert (hybrid.branches, hybrid.top_k, cfg.options(DrafterOptions).min_draft_prob) == (2, 5, 0.2)


@pytest.mark.parametrize("cfg", [
    {"method": "medusa", "num_speculative_tokens": 4},  # a tree sized by the cost model, not a chain's length
    {"method": "medusa", "prompt_lookup_max": 3},
    {"method": "ngram", "draft_linear_kernel": "packed-int8act"},  # prompt lookup runs no model
    {"method": "ngram", "verify_chunk": 2},  # chunked verification is gone
    {"method": "blockwise", "gamma_init": 3},  # blockwise sizes its block by the cost model, not dynamic gamma
    {"method": "self_spec", "draft_linear_kernel": "packed-int8act"},
    {"method": "hybrid", "tree_nodes": 4},  # the hybrid builds its own tree; its eagle trunk drafts a chain
    {"method": "auto", "use_cost_model": False},  # auto always sizes by the cost model
])
def test_every_key_a_method_does_not_read_is_refused_shared_keys_too(cfg):
    """The README's promise: a key the chosen method does not read is an error, a shared one included."""
    key = next(k for k in cfg if k != "method")
    with pytest.raises(ValueError, match=f"unknown speculative option '{key}' for method '{cfg['method']}'"):
        parse_config(cfg)


class _OracleChain(Proposer):
    """Drafts the plain-decoding continuation (every draft accepted) or a wrong token at every position (none
    accepted), recording the budget the engine grants each step."""

    def __init__(self, futures: dict[tuple[int, ...], list[int]], vocab: int, right: bool) -> None:
        self.futures, self.vocab, self.right = futures, vocab, right
        self.budgets: list[int] = []

    def propose(self, seqs, budgets):
        out = []
        for seq, k in zip(seqs, budgets):
            self.budgets.append(k)
            fut = self.futures[tuple(seq.prompt_token_ids)][seq.num_output_tokens:][:k]
            out.append(Proposal(fut if self.right else [(t + 1) % self.vocab for t in fut]))
        return out


def test_engine_drafts_the_dynamic_draft_length(plain_tiny):
    """The engine must draft what the dynamic-γ rule says, step by step: starting at gamma_init, one more after
    each fully accepted verification (raise_after=1) up to gamma_max, one fewer after each rejected one down to
    gamma_min. A fixed draft length (say 3) would draft [3, 3, 3, ...] and fail here."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = plain_tiny.generate(PROMPTS[:1], params, use_tqdm=False)
    futures = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in base}
    vocab = plain_tiny.engine.model_config.vocab_size
    cfg = SpeculativeConfig(method="ngram", use_cost_model=False, gamma_init=2, gamma_min=1, gamma_max=6,
                            raise_after=1, raise_above=0.9, lower_after=1, lower_below=0.5)
    want = {True: [2, 3, 4, 5, 6, 6], False: [2, 1, 1, 1]}
    for right, schedule in want.items():
        spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "use_cost_model": False})
        oracle = _OracleChain(futures, vocab, right)
        spec.engine.speculator = Speculator(spec.engine.drafting_view(), cfg, oracle)
        outs = spec.generate(PROMPTS[:1], params, use_tqdm=False)
        assert outs[0].outputs[0].token_ids == base[0].outputs[0].token_ids
        assert oracle.budgets[: len(schedule)] == schedule, (right, oracle.budgets)
        assert_no_leaks(spec)


def test_auto_is_lossless_and_picks_among_methods(tiny_model_dir, plain_tiny):
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=256,
               speculative_config={"method": "auto", "model": str(tiny_model_dir)})
    assert set(spec.engine.speculator.proposers) == {"ngram", "suffix", "recycling", "draft_model"}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _texts(spec, PROMPTS, params) == _texts(plain_tiny, PROMPTS, params)
    assert_no_leaks(spec)
    # "methods" narrows the candidates (to measure what one drafter adds); unusable or unknown names are errors
    only = LLM.from_engine_of(plain_tiny, speculative_config={"method": "auto", "model": str(tiny_model_dir),
                                                              "methods": ["draft_model"]})
    assert set(only.engine.speculator.proposers) == {"draft_model"}
    with pytest.raises(ValueError, match="cannot use"):
        LLM.from_engine_of(plain_tiny, speculative_config={"method": "auto", "methods": ["ngram", "medusa"]})
    with pytest.raises(ValueError, match="non-empty list"):
        LLM.from_engine_of(plain_tiny, speculative_config={"method": "auto", "methods": "ngram"})


def test_measured_speculation_overhead_enters_the_decision(tiny_model_dir, plain_tiny):
    """The step-cost model times target forwards only; the speculator also measures its own proposing and
    verifying time per drafting sequence. When that overhead exceeds anything drafting could save, the engine
    decodes plainly (and still losslessly)."""
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "use_cost_model": True})
    sp = spec.engine.speculator
    # verification as cheap as a plain step (the calibrated curve of a fast machine can say drafting never pays
    # for the tiny model, and then no overhead is ever measured): only the measured overhead can turn it off
    sp.cost = StepCostModel([(1, 1.0), (65, 1.0)])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec.generate(PROMPTS, params, use_tqdm=False)
    assert sp.verify_s > 0 and sp.propose_s["ngram"] > 0  # measured while drafting on repetitive prompts
    sp.verify_s = 10.0  # pretend verifying costs 10 s per sequence
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.metrics.num_draft_tokens == 0 and o.metrics.mean_accepted_tokens == 1.0 for o in outs)
    assert _texts(spec, PROMPTS, params) == _texts(plain_tiny, PROMPTS, params)


def test_a_calibrated_step_cost_model_learns_from_live_steps(plain_tiny):
    """A model given by hand stays as given. A calibrated one scales its points by the live steps' measured /
    calibrated times: a level shift seen on one size moves the whole curve (its shape, what an extra row costs,
    kept) until other sizes are measured themselves; it stays non-decreasing and ignores steps past its sizes."""
    hand = StepCostModel([(1, 1.0), (9, 2.0)])
    hand.observe(5, 10.0)
    assert hand(5) == 1.5
    live = StepCostModel([(1, 1.0), (5, 2.0), (9, 4.0)], online=True)
    for _ in range(5):
        live.observe(4, 3.0)  # nearest calibrated size 5, calibrated 1.75 there: ratio 12/7
    ratio = 3.0 / 1.75
    assert [y for _, y in live.points] == pytest.approx([ratio, 2.0 * ratio, 4.0 * ratio])
    for _ in range(300):
        live.observe(9, 2.0)  # the largest size measures cheaper than calibrated: its own ratio, then monotone
    assert live(9) == pytest.approx(live(5), rel=1e-3) and live(1) == pytest.approx(ratio)
    before = list(live.points)
    live.observe(100, 50.0)
    assert live.points == before
    # an engine's speculator hands its target steps to its calibrated model
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "use_cost_model": True})
    sp = spec.engine.speculator
    assert sp.cost.online
    before = list(sp.cost.points)
    spec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert sp.cost.points != before


def test_a_drafter_with_nothing_to_draft_pauses_in_a_batch_and_never_at_batch_one() -> None:
    # asking a drafter each step costs a batched step; its pause doubles to 8 steps, ends when it drafts or the
    # batch shrinks, and batch 1 always asks
    st = DraftState()
    asked = []
    for step in range(40):
        if not st.paused("suffix", 8):
            asked.append(step)
            st.said_no("suffix", 8)
    assert asked[:5] == [0, 2, 5, 10, 19] and all(b - a == 9 for a, b in zip(asked[4:], asked[5:]))
    assert st.paused("suffix", 8)  # mid-pause
    assert not st.paused("suffix", 4)  # the batch shrank: asked again, the pause starts over
    st.said_no("suffix", 4)
    assert st.idle["suffix"].pause == 1
    for _ in range(20):
        st.said_no("ngram", 1)
        assert not st.paused("ngram", 1)
    assert "ngram" not in st.idle


def test_under_auto_a_drafter_with_nothing_to_draft_pauses_at_batch_one_too_at_most_four_steps() -> None:
    # auto asks six drafters a step, ~0.5 ms of a one-row step: there a drafter that said no pauses at batch 1
    # too, 1, 2, then 4 steps at most (a missed copy costs most at batch 1)
    st = DraftState()
    asked = []
    for step in range(27):
        if not st.paused("suffix", 1, pause_alone=True):
            asked.append(step)
            st.said_no("suffix", 1, pause_alone=True)
    assert asked[:4] == [0, 2, 5, 10] and all(b - a == 5 for a, b in zip(asked[3:], asked[4:]))
    assert st.paused("suffix", 1, pause_alone=True)  # mid-pause
    assert not st.paused("suffix", 1)  # without auto, batch 1 is asked every step: the pause is dropped
    assert st.idle["suffix"].pause == 0


def test_tree_realism_scales_promises_by_what_trees_delivered_and_fades_back() -> None:
    r = TreeRealism()
    assert r.ratio("suffix") == 1.0  # no history: the drafter's own estimate stands
    r.record("suffix", 3.0, 0)
    assert r.ratio("suffix") > 0.65  # one failed tree moves it little (the prior)
    for _ in range(60):
        r.record("suffix", 1.0, 0)  # promised one accepted node, got none
    low = r.ratio("suffix")
    assert low < 0.15
    for _ in range(2000):
        r.fade("suffix")
    assert low < r.ratio("suffix") < 1.0  # declining drifts it back toward 1, slowly
    for _ in range(200):
        r.record("recycling", 0.5, 2)  # under-promises: capped at twice its estimate
    assert r.ratio("recycling") == 2.0
    assert r.ratio("ngram") == 1.0  # per method


class DecoyTrees(Proposer):
    """Trees that promise two accepted tokens and hold only tokens the target never emits next."""

    name = "decoy"

    def __init__(self, futures: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.futures, self.vocab = futures, vocab

    def tree_budget(self, seq, room, cost, batch):
        return min(4, room), 3.0

    def propose(self, seqs, budgets):
        out = []
        for seq, k in zip(seqs, budgets):
            nxt = self.futures[tuple(seq.prompt_token_ids)][seq.num_output_tokens]
            out.append(Proposal([(nxt + 1 + j) % self.vocab for j in range(k)], None, [-1] * k))
        return out


def test_a_tree_drafter_that_over_promises_stops_drafting_and_stays_lossless(plain_tiny):
    """Verification rows that cost something (a hand-set curve) and trees that promise 2 accepted tokens but never
    hold the target's next token: without the realism scale every step would draft; with it drafting stops after
    a few trees and comes back only rarely. The tokens are plain decoding's either way."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = plain_tiny.generate(PROMPTS, params, use_tqdm=False)
    futures = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in base}
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "use_cost_model": False})
    eng = spec.engine
    decoys = DecoyTrees(futures, eng.model_config.vocab_size)
    eng.speculator = sp = Speculator(eng.drafting_view(), SpeculativeConfig(method="ngram", use_cost_model=False),
                                     decoys)
    sp.cost = StepCostModel([(1, 1.0), (5, 1.5), (65, 3.0)])  # four extra rows: half a step
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    drafts = sum(o.metrics.num_drafts for o in outs)
    steps = sum(o.metrics.num_target_steps for o in outs)
    assert 0 < drafts <= 0.1 * steps, (drafts, steps)
    assert sp.realism.ratio("ngram") < 0.3  # the proposer drafts under the configured method's name
    assert_no_leaks(spec)


def test_headroom_is_what_perfect_drafts_could_gain_at_a_batch() -> None:
    cheap = StepCostModel([(1, 1.0), (9, 1.2), (65, 4.0)])  # rows nearly free up to 9
    assert cheap.headroom(1, 8) == pytest.approx(9 / 1.2)
    linear = StepCostModel([(1, 1.0), (65, 65.0)])  # every row costs a whole step
    assert linear.headroom(8, 8) == pytest.approx(1.0)
    assert linear.headroom(8, 0) == pytest.approx(1.0)


class CountingDrafter(Proposer):
    """Counts how often the speculator asks it; drafts nothing."""

    name = "counting"

    def __init__(self) -> None:
        self.asked = 0

    def has_draft(self, seq):
        self.asked += 1
        return False

    def propose(self, seqs, budgets):
        return [Proposal([]) for _ in seqs]


def test_drafters_are_not_asked_in_a_batch_where_no_draft_could_pay(plain_tiny):
    """Where the measured rows cost their count (no headroom at this batch), the drafters are not asked at all
    (a suffix drafter would index every prompt for nothing); at batch 1 and where rows are cheap they are."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "use_cost_model": False})
    eng = spec.engine
    drafter = CountingDrafter()
    eng.speculator = sp = Speculator(eng.drafting_view(), SpeculativeConfig(method="ngram", use_cost_model=False),
                                     drafter)
    sp.cost = StepCostModel([(1, 1.0), (65, 65.0)])
    spec.generate(PROMPTS, params, use_tqdm=False)  # a batch of len(PROMPTS) > 1 sequences
    assert drafter.asked <= len(PROMPTS)  # only once the batch has shrunk to one
    spec.generate(PROMPTS[:1], params, use_tqdm=False)
    assert drafter.asked >= 6  # batch 1: asked every step that has room for a draft
    sp.cost = StepCostModel([(1, 1.0), (9, 1.2), (65, 4.0)])
    before = drafter.asked
    spec.generate(PROMPTS, params, use_tqdm=False)
    assert drafter.asked - before >= 2 * len(PROMPTS)  # rows cheap: asked in the batch too


def test_row_observers_learn_from_a_few_rows_in_turn_where_no_draft_could_pay(plain_tiny):
    """Recycling learns from every row at batch 1 and where rows are cheap; in a batch without headroom from
    LEARN_ROWS_WITHOUT_HEADROOM rows a step, taken in turn so that every sequence's rows are learned from."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "recycling"})
    sp = spec.engine.speculator
    prop = sp.proposers["recycling"]
    seen: list[list[int]] = []
    learn = prop.observe_rows
    prop.observe_rows = lambda tokens, logits: (seen.append(list(tokens)), learn(tokens, logits))[1]
    sp.cost = StepCostModel([(1, 1.0), (65, 65.0)])  # rows cost their count: no headroom in a batch
    spec.generate(PROMPTS, params, use_tqdm=False)
    batched = seen[1:]  # (the prompts' step: nothing was running when its limits were set)
    assert batched and max(len(t) for t in batched) == LEARN_ROWS_WITHOUT_HEADROOM
    assert len({tok for t in batched for tok in t}) > LEARN_ROWS_WITHOUT_HEADROOM  # different rows in turn
    seen.clear()
    sp.cost = StepCostModel([(1, 1.0), (9, 1.2), (65, 4.0)])  # cheap rows: every row
    spec.generate(PROMPTS, params, use_tqdm=False)
    assert max(len(t) for t in seen) > LEARN_ROWS_WITHOUT_HEADROOM  # every row (and verified trees' rows)


def test_batched_steps_learn_from_as_many_rows_as_fit_a_share_of_the_step(plain_tiny):
    """In a batched step that may draft, the row observers learn from as many plain rows as their measured time per
    row fits in LEARN_SHARE of the modelled step (at least LEARN_ROWS_WITHOUT_HEADROOM; None: all), and that time
    is measured as they learn."""
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "recycling"})
    sp = spec.engine.speculator
    sp.cost = StepCostModel([(1, 0.010), (16, 0.030), (65, 0.120)])
    assert sp._learn_budget(16) is None  # nothing measured yet: every row
    sp.learn_row_s = 140e-6  # a 262,144-wide row's top-k: 1% of a 30 ms step fits two
    assert sp._learn_budget(16) == LEARN_ROWS_WITHOUT_HEADROOM
    sp.learn_row_s = 40e-6
    assert sp._learn_budget(16) == int(LEARN_SHARE * 0.030 / 40e-6) == 7
    sp.learn_row_s = 1e-6
    assert sp._learn_budget(16) is None  # all fit
    sp.learn_row_s = 0.0
    sp.cost = StepCostModel([(1, 1.0), (9, 1.2), (65, 4.0)])  # cheap rows: batched steps may draft
    spec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert 0.0 < sp.learn_row_s < 0.1  # measured from the plain rows it learnt from


class EagerTrees(Proposer):
    """Promises two accepted tokens from a 4-node tree for every sequence; drafts nothing when asked."""

    name = "eager"

    def tree_budget(self, seq, room, cost, batch):
        return min(4, room), 3.0

    def propose(self, seqs, budgets):
        return [Proposal([]) for _ in seqs]


def test_a_batchs_drafts_are_sized_against_the_step_earlier_grants_left(plain_tiny):
    """Rows nearly free up to 8, then each costing a whole step: a sequence alone would draft 4 nodes, and in a
    batch of 4 each one would if sized as the only drafter (16 extra rows); sized against the step as the earlier
    grants left it, one sequence per step gets its tree."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    spec = LLM.from_engine_of(plain_tiny, speculative_config={"method": "ngram", "use_cost_model": False})
    eng = spec.engine
    eng.speculator = sp = Speculator(eng.drafting_view(), SpeculativeConfig(method="ngram", use_cost_model=False),
                                     EagerTrees())
    sp.cost = StepCostModel([(1, 1.0), (8, 1.05), (65, 60.0)])
    granted: list[int] = []
    limits = sp.draft_limits
    sp.draft_limits = lambda decoding, n: (lambda got: (granted.append(len(got)), got)[1])(limits(decoding, n))
    spec.generate(PROMPTS, params, use_tqdm=False)
    assert len(PROMPTS) == 4 and max(granted) == 1, granted
    granted.clear()
    spec.generate(PROMPTS[:1], params, use_tqdm=False)
    assert max(granted) == 1  # alone, it drafts
