"""Speculative decoding is lossless: greedy outputs are token-identical, sampled outputs equal in distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from leapdecode import LLM, SamplingParams
from leapdecode.config import SpeculativeConfig
from leapdecode.speculative.acceptance import verify_greedy, verify_sampling
from leapdecode.speculative.methods.hybrid import HybridOptions
from leapdecode.speculative.options import DrafterOptions
from leapdecode.speculative.policy import DynamicGamma, StepCostModel, expected_tokens
from leapdecode.speculative.proposer import Proposal, Proposer
from leapdecode.speculative.registry import parse_config
from leapdecode.speculative.speculator import Speculator

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks


def _spec(method: str, **kw) -> dict:
    return {"method": method, "use_cost_model": False, **kw}


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


@pytest.mark.parametrize("method", ["ngram", "draft_model_self", "draft_model_other"])
def test_greedy_speculation_is_token_identical_at_batch(method, tiny_model_dir, make_tiny_model, plain_tiny):
    if method == "ngram":
        cfg = _spec("ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    elif method == "draft_model_self":
        cfg = _spec("draft_model", model=str(tiny_model_dir))
    else:
        cfg = _spec("draft_model", model=str(make_tiny_model(seed=1, num_hidden_layers=1)))
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=256, speculative_config=cfg, block_size=4)
    # mixed opt-outs in one batch
    params = [SamplingParams(temperature=0, max_tokens=40, speculative=(i % 2 == 0), ignore_eos=True)
              for i in range(len(PROMPTS))]
    want = _texts(plain_tiny, PROMPTS, params)
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > 0
    for i, o in enumerate(outs):
        if i % 2:
            assert o.metrics.num_draft_tokens == 0  # opted out
    if method == "draft_model_self":
        assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens for o in outs)
        assert max(o.metrics.mean_accepted_tokens for o in outs) > 2.0
    assert_no_leaks(spec)
    if method.startswith("draft_model"):
        bm = spec.engine.speculator.proposer.bm
        assert bm.num_free_blocks == bm.num_blocks


def test_speculation_honours_stop_inside_an_accepted_run(tiny_model_dir, plain_tiny):
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=256,
               speculative_config=_spec("draft_model", model=str(tiny_model_dir), num_speculative_tokens=6))
    base = plain_tiny.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[7]
    first = base.token_ids.index(stop_tok)
    p = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True)
    got = spec.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == base.token_ids[: first + 1]
    assert got.finish_reason == "stop"
    for max_tokens in (1, 5, 11):
        got = spec.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        assert got.token_ids == base.token_ids[:max_tokens]
    assert_no_leaks(spec)


def _perturbed_copy(src, tmp_path):
    """The target with noisy weights: a draft that agrees often but not always (q close to, not equal to, p)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * prm.std() * 0.5)
    out = tmp_path / "draft"
    model.save_pretrained(str(out))
    import shutil

    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_distribution_matches_plain(method, tiny_model_dir, plain_tiny, tmp_path):
    """Two-sample chi-square over the first three sampled tokens' last position, many seeds."""
    if method == "ngram":
        cfg = _spec("ngram", prompt_lookup_min=1, prompt_lookup_max=2, num_speculative_tokens=3)
    else:
        cfg = _spec("draft_model", model=str(_perturbed_copy(tiny_model_dir, tmp_path)), num_speculative_tokens=3)
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=1024, speculative_config=cfg)
    tok = plain_tiny.get_tokenizer()
    base = tok.encode("a b c a b c a b")
    # a context that holds what the model tends to sample, so prompt lookup finds matches to draft from
    warm = _texts(plain_tiny, ["a b c a b c a b"] * 24,
                  [SamplingParams(temperature=1.0, top_k=8, max_tokens=6, seed=i, ignore_eos=True) for i in range(24)])
    prompt = {"prompt_token_ids": [t for w in warm for t in w] + base}
    n = 300
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=4, seed=1000 + i, ignore_eos=True) for i in range(n)]
    plain = [t[-1] for t in _texts(plain_tiny, [prompt] * n, params)]
    params2 = [SamplingParams(temperature=1.0, top_k=8, max_tokens=4, seed=5000 + i, ignore_eos=True) for i in range(n)]
    outs = spec.generate([prompt] * n, params2, use_tqdm=False)
    specd = [o.outputs[0].token_ids[-1] for o in outs]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    vocab = sorted(set(plain) | set(specd))
    table = [[plain.count(v) for v in vocab], [specd.count(v) for v in vocab]]
    # merge rare categories so expected counts are large enough for the test
    keep = [i for i in range(len(vocab)) if table[0][i] + table[1][i] >= 10]
    rare = [i for i in range(len(vocab)) if i not in keep]
    rows = [[r[i] for i in keep] + [sum(r[i] for i in rare)] for r in table]
    rows = [[c for c, tot in zip(r, map(sum, zip(*rows))) if tot > 0] for r in rows]
    assert chi2_contingency(rows).pvalue > 1e-3, rows
    assert_no_leaks(spec)


def test_draft_model_refuses_a_different_tokenizer(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_tokens([f"<extra_{i}>" for i in range(1000)])
    # shuffle: rebuild with a vocabulary whose ids differ
    vocab = tok.get_vocab()
    assert len(vocab) > 49152
    import json

    tj = json.loads((other / "tokenizer.json").read_text())
    v = tj["model"]["vocab"]
    keys = list(v)
    v[keys[100]], v[keys[101]] = v[keys[101]], v[keys[100]]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model=str(tiny_model_dir), speculative_config={"method": "draft_model", "model": str(other)})


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
    {"method": "blockwise", "use_cost_model": False},  # the block size is the method: never the cost model's
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
        spec.engine.speculator = Speculator(spec.engine, cfg, oracle)
        outs = spec.generate(PROMPTS[:1], params, use_tqdm=False)
        assert outs[0].outputs[0].token_ids == base[0].outputs[0].token_ids
        assert oracle.budgets[: len(schedule)] == schedule, (right, oracle.budgets)
        assert_no_leaks(spec)


def test_auto_is_lossless_and_picks_among_methods(tiny_model_dir, plain_tiny):
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=256,
               speculative_config={"method": "auto", "model": str(tiny_model_dir)})
    assert set(spec.engine.speculator.proposers) == {"ngram", "draft_model"}
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
