"""Blockwise parallel decoding: exact mode is lossless at batch > 1, top-k mode keeps a superset of exact mode's
drafts, and config mistakes are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.config import SpeculativeConfig
from leapdecode.speculative.acceptance import topk_accepted, verify_greedy
from leapdecode.speculative.artifacts import save_heads
from leapdecode.speculative.block_heads import BlockHeads
from leapdecode.speculative.heads import PYRAMID, MedusaHeads
from leapdecode.speculative.methods import blockwise as B
from leapdecode.speculative.methods.blockwise import BlockwiseProposer, BlockwiseSettings
from leapdecode.speculative.proposer import Proposal, Verification
from leapdecode.speculative.speculator import Speculator

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks, save_random_block_heads

VOCAB = 49152
SHAPES = [(1, 1), (7, 1), (8, 4), (10, 4), (13, 5), (16, 16), (5, 8), (23, 3)]  # incl. ragged last blocks


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------------------------------ acceptance
def test_topk_acceptance_rule():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0],
                           [1.0, 9.0, 9.0, 2.0],  # tie at the top: both tokens rank 0
                           [0.0, 1.0, 2.0, 3.0]])
    assert topk_accepted(logits, [0, 2, 1], 1) == (2, 0)  # argmax, tied argmax, then rank 2 fails
    assert topk_accepted(logits, [1, 2, 1], 1) == (0, 0)
    assert topk_accepted(logits, [1, 2, 1], 2) == (2, 1)  # rank 1 passes (lossy), tied top passes, rank 2 stops
    assert topk_accepted(logits, [1, 2, 1], 3) == (3, 2)
    assert topk_accepted(logits, [3, 3, 0], 2, min_block=2) == (2, 2)  # first two kept regardless (both lossy)
    assert topk_accepted(logits, [], 2) == (0, 0)
    probs = torch.tensor([[0.6, 0.4, 0.0, 0.0]])  # a zero-probability token never passes, whatever its rank
    assert topk_accepted(probs, [2], 4, probs=True) == (0, 0)
    assert topk_accepted(probs, [1], 2, probs=True) == (1, 1)


def test_topk_keeps_every_draft_exact_keeps_on_random_logits():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        logits = torch.randn(5, 12, generator=g)
        drafts = torch.randint(0, 12, (4,), generator=g).tolist()
        for i in range(4):  # make long exact runs likely
            if torch.rand(1, generator=g) < 0.6:
                drafts[i] = int(logits[i].argmax())
        _, exact = verify_greedy(logits.argmax(-1).tolist(), drafts)
        for k in (1, 2, 5):
            kept, _ = topk_accepted(logits, drafts, k)
            assert kept >= exact and (k > 1 or kept == exact)


# ----------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=512)


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory) -> Path:
    """Four random block heads (large weights, so their chains are arbitrary tokens)."""
    return save_random_block_heads(tmp_path_factory.mktemp("bw_heads"), 4, seed=5)


def _spec(model: Path, **kw) -> dict:
    """Every block drafted in full (the cost model would switch random heads off)."""
    return {"method": "blockwise", "model": str(model), "use_cost_model": False, **kw}


def test_config_mistakes_are_clear_errors(plain, heads_dir, tmp_path):
    ok = LLM.from_engine_of(plain, speculative_config=_spec(heads_dir))
    prop = ok.engine.speculator.proposer
    assert isinstance(prop, BlockwiseProposer)
    assert prop.settings == BlockwiseSettings(4, "exact") and not prop.settings.lossy  # exact unless asked
    cases = [
        ({"num_speculative_tokens": 5}, "num_speculative_tokens must be an integer in \\[1, 4\\]"),
        ({"acceptance": "fuzzy"}, "acceptance must be one of"),
        ({"acceptance": "topk", "top_k": 0}, "top_k must be an integer >= 1"),
        ({"acceptance": "topk", "num_speculative_tokens": 2, "min_block": 3}, "min_block must be an integer in"),
        ({"acceptance": "topk", "min_block": -1}, "min_block must be an integer in"),
        ({"top_k": 3}, "only apply to acceptance='topk'"),
        ({"min_block": 1}, "only apply to acceptance='topk'"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            LLM.from_engine_of(plain, speculative_config=_spec(heads_dir, **kw))
    pyramid = MedusaHeads(64, PYRAMID)  # Medusa's heads are not block heads
    save_heads(tmp_path / "pyr", pyramid, None, {"vocab_size": VOCAB})
    with pytest.raises(ValueError, match="not a leapdecode.blockwise_heads artifact.*train blockwise"):
        LLM.from_engine_of(plain, speculative_config=_spec(tmp_path / "pyr"))
    with pytest.raises(FileNotFoundError, match="train blockwise"):
        LLM.from_engine_of(plain, speculative_config=_spec(tmp_path / "nothing"))
    assert_no_leaks(ok)


def test_exact_mode_sizes_its_block_by_the_cost_model(plain, heads_dir):
    """At its defaults blockwise asks the step-cost model for its block size: the longest block whose expected
    tokens per second beat plain decoding's, 0 when none does; the acceptance it expects is learned from every
    verification. Top-k mode (lossy) and ``use_cost_model: false`` draft the full block."""
    llm = LLM.from_engine_of(plain, speculative_config={"method": "blockwise", "model": str(heads_dir)})
    prop = llm.engine.speculator.proposer
    assert isinstance(prop, BlockwiseProposer) and not prop.fixed_budget
    assert llm.engine.speculator.cost is not None  # calibrated: the cost model sizes it
    prop._heads_cost = {1: 0.0, 8: 0.0}
    free, per_row = (lambda n: 1.0), (lambda n: float(n))
    assert prop.best_block(free, 1) == 4  # extra rows cost nothing: the whole block pays
    assert prop.best_block(per_row, 1) == 0 and prop.best_block(per_row, 8) == 0  # every row a full step
    assert prop.tree_budget(None, 3, None, 1)[0] == 3  # no cost model: the full block, within room
    cheap = lambda n: 1.0 + 0.05 * n  # noqa: E731
    fake = torch.zeros(5, 8)
    for _ in range(200):  # every draft rejected
        prop.on_verified(None, Verification(10, [1, 2, 3, 4], None, [], [7], fake))
    assert prop.expected_tokens(4) < 1.1 and prop.best_block(cheap, 1) == 0
    for _ in range(2000):  # every draft accepted
        prop.on_verified(None, Verification(10, [1, 2, 3, 4], None, [0, 1, 2, 3], [1, 2, 3, 4, 5], fake))
    assert prop.expected_tokens(4) > 4.5 and prop.best_block(cheap, 1) == 4
    lossy = LLM.from_engine_of(plain, speculative_config={"method": "blockwise", "model": str(heads_dir),
                                                          "acceptance": "topk"}).engine.speculator.proposer
    assert lossy.fixed_budget and lossy.tree_budget(None, 9, per_row, 8)[0] == 4
    # lossless whatever it decides
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _ids(llm.generate(PROMPTS, params, use_tqdm=False)) == _ids(plain.generate(PROMPTS, params,
                                                                                     use_tqdm=False))
    assert_no_leaks(llm)


def test_exact_greedy_is_token_identical_at_batch_and_topk1_equals_exact(plain, heads_dir):
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=(i != 1),
                             repetition_penalty=1.3 if i == 2 else 1.0) for i in range(len(PROMPTS))]
    want = _ids(plain.generate(PROMPTS, params, use_tqdm=False))
    spec = LLM.from_engine_of(plain, speculative_config=_spec(heads_dir, num_speculative_tokens=3), block_size=4)
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(outs) == want
    assert outs[1].metrics.num_draft_tokens == 0
    assert all(o.metrics.num_draft_tokens > 0 for i, o in enumerate(outs) if i != 1)
    assert all(o.metrics.num_lossy_tokens == 0 for o in outs)
    top1 = LLM.from_engine_of(plain, speculative_config=_spec(heads_dir, acceptance="topk", top_k=1), block_size=4)
    assert _ids(top1.generate(PROMPTS, params, use_tqdm=False)) == want  # top-1 is the argmax
    assert_no_leaks(spec)
    assert_no_leaks(top1)


class OracleBlocks(BlockwiseProposer):
    """Blocks from the target itself: its greedy continuation of the current text, with the third token replaced
    by the target's *second* choice there. Exact mode keeps two drafts per step; top-2 mode also keeps the third."""

    def __init__(self, plain: LLM, settings: BlockwiseSettings) -> None:
        heads = BlockHeads(64, settings.k, num_blocks=1, attn_heads=1, head_dim=8)
        super().__init__(heads, plain.engine.model.lm_head.get_weight(), None, settings, plain.engine.model)
        self.plain = plain

    def propose(self, seqs, budgets):
        from leapdecode.eval.kv_agreement import teacher_forced_logprobs

        out = []
        for seq, k in zip(seqs, budgets):
            if k <= 0:
                out.append(Proposal([]))
                continue
            ctx = list(seq.token_ids)
            fut = self.plain.generate([{"prompt_token_ids": ctx}], SamplingParams(temperature=0, max_tokens=k,
                                      ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
            if len(fut) >= 3:
                second = teacher_forced_logprobs(self.plain, [ctx], [fut])[0][2].topk(2).indices[1]
                fut = fut[:2] + [int(second)] + fut[3:]
            out.append(Proposal(fut[:k]))
        return out


def _oracle_llm(plain: LLM, settings: BlockwiseSettings) -> LLM:
    llm = LLM.from_engine_of(plain, block_size=4)
    cfg = SpeculativeConfig(method="blockwise", use_cost_model=False, num_speculative_tokens=settings.k)
    llm.engine.speculator = Speculator(llm.engine.drafting_view(), cfg, OracleBlocks(plain, settings))
    return llm


def test_topk_keeps_a_superset_of_exact_drafts_step_by_step(plain, monkeypatch):
    """Every verification of a top-2 run is also checked under exact rules on the same logits: top-k keeps at
    least the drafts exact keeps (the same tokens), and strictly more at some steps. The produced text is then
    scored by the plain model: every token is in its top 2, and the lossy counter counts the second choices."""
    from leapdecode.eval.kv_agreement import teacher_forced_logprobs

    steps: list[tuple[int, int, list[int], list[int]]] = []
    real = B.verify_block_topk

    def checked(logits, drafts, params, generator, top_k, min_block=0):
        tokens, kept, lossy = real(logits, drafts, params, generator, top_k, min_block)
        exact_tokens, exact = verify_greedy(logits.argmax(-1).tolist(), drafts)
        steps.append((exact, kept, exact_tokens, tokens))
        return tokens, kept, lossy

    monkeypatch.setattr(B, "verify_block_topk", checked)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    exact_llm = _oracle_llm(plain, BlockwiseSettings(4))
    exact_outs = exact_llm.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(exact_outs) == _ids(plain.generate(PROMPTS, params, use_tqdm=False))
    assert not steps  # exact mode never calls the lossy rule
    assert min(o.metrics.mean_accepted_tokens for o in exact_outs) > 2.0  # the oracle's two good drafts per step
    topk_llm = _oracle_llm(plain, BlockwiseSettings(4, "topk", top_k=2))
    outs = topk_llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(steps) > 10
    for exact, kept, exact_tokens, tokens in steps:
        assert kept >= exact and tokens[:exact] == exact_tokens[:exact]
        if kept == exact:  # nothing extra kept: the next token is the same argmax exact mode emits
            assert tokens == exact_tokens
    assert sum(kept > exact for exact, kept, _, _ in steps) >= len(PROMPTS)
    assert sum(k for _, k, _, _ in steps) > sum(e for e, _, _, _ in steps)
    prompts = [o.prompt_token_ids for o in outs]
    lossy = 0
    for lp, o in zip(teacher_forced_logprobs(plain, prompts, _ids(outs)), outs):
        tok = torch.tensor(o.outputs[0].token_ids)
        ranks = (lp > lp.gather(1, tok[:, None])).sum(1)
        assert int(ranks.max()) < 2
        lossy += int((ranks > 0).sum())
    assert lossy == sum(o.metrics.num_lossy_tokens for o in outs) > 0
    assert _ids(outs) != _ids(exact_outs)
    assert_no_leaks(exact_llm)
    assert_no_leaks(topk_llm)


def test_exact_sampling_reproduces_seeded_plain_sampling(plain, heads_dir):
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, seed=7 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want = _ids(plain.generate(PROMPTS, params, use_tqdm=False))
    spec = LLM.from_engine_of(plain, speculative_config=_spec(heads_dir))
    assert _ids(spec.generate(PROMPTS, params, use_tqdm=False)) == want
    # drafts the target likes, at a temperature where its samples often are its argmax: the walk accepts some
    cool = [SamplingParams(temperature=0.05, max_tokens=24, seed=3 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    oracle = _oracle_llm(plain, BlockwiseSettings(4))
    outs = oracle.generate(PROMPTS, cool, use_tqdm=False)
    assert _ids(outs) == _ids(plain.generate(PROMPTS, cool, use_tqdm=False))
    assert sum(o.metrics.num_accepted_tokens for o in outs) > len(PROMPTS)
    assert_no_leaks(spec)
    assert_no_leaks(oracle)


def test_topk_with_min_block_emits_at_least_min_block_plus_one_per_step(plain, heads_dir):
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    spec = LLM.from_engine_of(plain, speculative_config=_spec(heads_dir, num_speculative_tokens=4,
                                                              acceptance="topk", top_k=3, min_block=2))
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    for o in outs:
        m = o.metrics
        assert len(o.outputs[0].token_ids) == 25
        assert m.num_accepted_tokens >= 2 * (m.num_target_steps - 3)  # the prefill step and two short last ones aside
    assert_no_leaks(spec)


# ----------------------------------------------------------------------------------------- shipped heads
@pytest.mark.slow
def test_shipped_heads_are_lossless_and_accept_on_the_bundled_model(bundled_llm):
    convs = [[{"role": "user", "content": "What is the capital of France? Answer in two sentences."}],
             [{"role": "user", "content": "Write a short Python function that reverses a string."}]]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = _ids(bundled_llm.chat(convs, params, use_tqdm=False))
    # the cost model off: whether drafting pays depends on this machine's row costs (on a slow-rows CPU it drafts
    # nothing); this test is about the heads: lossless, and accepting more than one token per step
    spec = LLM.from_engine_of(bundled_llm, speculative_config={"method": "blockwise", "num_speculative_tokens": 4,
                                                               "use_cost_model": False})
    outs = spec.chat(convs, params, use_tqdm=False)
    assert _ids(outs) == want
    steps = sum(o.metrics.num_target_steps for o in outs)
    assert sum(len(t) for t in want) / steps > 1.0
