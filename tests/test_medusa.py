"""Medusa heads: layout, candidates, lossless tree decoding in the engine, and the training recipe on a tiny
model (loss goes down, checkpoints load and resume, the schedules do what their config says)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from leapdecode import LLM, SamplingParams
from leapdecode.config import SpeculativeConfig
from leapdecode.speculative.artifacts import load_heads, save_heads
from leapdecode.speculative.heads import (
    ONE_PER_OFFSET,
    PYRAMID,
    MedusaHeads,
    masked_argmax_chain,
    parse_layout,
    ranked_candidates,
)
from leapdecode.speculative.proposer import Proposal, Proposer
from leapdecode.speculative.speculator import Speculator
from leapdecode.train.medusa import MedusaTrainConfig, MedusaTrainer, per_offset
from leapdecode.train.medusa_loss import TrainableHeads, head_losses, weighted_loss
from leapdecode.train.medusa_schedules import CurriculumSampler, CurriculumSchedule, ProgressiveSchedule

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks, save_random_heads

VOCAB = 49152


def _spec(model: str, **kw) -> dict:
    return {"method": "medusa", "model": model, "use_cost_model": False, **kw}


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=512)


@pytest.fixture(scope="module")
def random_heads(tmp_path_factory) -> Path:
    """Untrained pyramid heads with large random weights, so their candidates are arbitrary."""
    return save_random_heads(tmp_path_factory.mktemp("heads"), PYRAMID, seed=3, first_head_seed=9)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# --------------------------------------------------------------------------------------------- the heads
def test_layouts_and_parameter_count():
    assert parse_layout("pyramid") == list(PYRAMID) and len(PYRAMID) == 10
    assert parse_layout("one-per-offset") == [1, 2, 3, 4] == list(ONE_PER_OFFSET)
    assert parse_layout("1,2,2,3") == [1, 2, 2, 3]
    with pytest.raises(ValueError, match="skips"):
        parse_layout("1,3")
    heads = MedusaHeads(576, PYRAMID)  # SmolLM2-135M's hidden size
    per_head = sum(p.numel() for p in heads.parameters()) / heads.num_heads
    assert per_head == 576 * 576 + 576  # ~0.33M; the LM head is the target's own
    assert heads.groups == {1: [0], 2: [1, 2], 3: [3, 4, 5], 4: [6, 7, 8, 9]}
    heads.init_weights(seed=0)
    assert heads.weight[0].abs().sum() == 0 and heads.weight[1].abs().sum() == 0  # first of each offset: identity
    assert not torch.equal(heads.weight[2], heads.weight[4])  # the others start apart
    h = torch.randn(3, 576)
    assert torch.allclose(heads(h)[:, 0], h + F.silu(heads.bias[0]))


def test_candidates_are_distinct_masked_argmaxes_then_first_heads_ranking():
    heads = MedusaHeads(8, PYRAMID)
    logits = torch.randn(5, 10, 50)
    cand = ranked_candidates(logits, heads, 6)
    assert cand.shape == (5, 4, 6)
    for b in range(5):
        for d in range(4):
            assert len(set(cand[b, d].tolist())) == 6
    # offset 3 (heads 3,4,5): masked argmax chain, then head 3's ranking without those
    picks = masked_argmax_chain(logits[:, [3, 4, 5]])
    assert torch.equal(cand[:, 2, :3], picks)
    assert picks[:, 0].tolist() == logits[:, 3].argmax(-1).tolist()
    for b in range(5):
        rest = [t for t in logits[b, 3].argsort(descending=True).tolist() if t not in picks[b].tolist()][:3]
        assert cand[b, 2, 3:].tolist() == rest
    ens = MedusaHeads(8, PYRAMID, diversity="ensemble")
    cand = ranked_candidates(logits, ens, 4)
    p = logits[:, [1, 2]].softmax(-1).mean(1)
    assert torch.equal(cand[:, 1], p.topk(4).indices)


def test_artifact_round_trip_and_model_checks(tmp_path, random_heads, tiny_model_dir, plain):
    heads, subset, meta = load_heads(random_heads)
    assert subset is None and meta["offsets"] == list(PYRAMID)
    ref = MedusaHeads(64, PYRAMID)
    ref.init_weights(seed=3, std=0.5)
    assert torch.allclose(heads.weight[2], ref.weight[2].half().float()) and heads.weight[2].abs().sum() > 0
    other = MedusaHeads(32, ONE_PER_OFFSET)
    save_heads(tmp_path / "h32", other, None, {"vocab_size": VOCAB})
    with pytest.raises(ValueError, match="hidden size"):
        LLM.from_engine_of(plain, speculative_config=_spec(str(tmp_path / "h32")))
    with pytest.raises(FileNotFoundError, match="train medusa"):
        LLM.from_engine_of(plain, speculative_config=_spec(str(tmp_path / "nothing")))
    # the default ({"method": "medusa"}) loads the shipped heads, which are for the bundled model's hidden size
    from leapdecode.speculative.artifacts import MEDUSA_DIR as DEFAULT_HEADS_DIR

    with pytest.raises((ValueError, FileNotFoundError), match="hidden size|train medusa"):
        LLM.from_engine_of(plain, speculative_config={"method": "medusa", "use_cost_model": False})
    assert DEFAULT_HEADS_DIR.name == "medusa"


# ----------------------------------------------------------------------------------------------- engine
def test_greedy_medusa_is_token_identical_at_batch(plain, random_heads):
    spec = LLM.from_engine_of(plain, speculative_config=_spec(str(random_heads), tree_nodes=12), block_size=4)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculative=(i != 1),
                             repetition_penalty=1.3 if i == 2 else 1.0) for i in range(len(PROMPTS))]
    want = _ids(plain.generate(PROMPTS, params, use_tqdm=False))
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(outs) == want
    assert outs[1].metrics.num_draft_tokens == 0
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert_no_leaks(spec)


def test_sampled_medusa_reproduces_seeded_plain_sampling_and_typical_is_opt_in(plain, random_heads):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want = _ids(plain.generate(PROMPTS, params, use_tqdm=False))
    spec = LLM.from_engine_of(plain, speculative_config=_spec(str(random_heads), tree_nodes=8))
    assert spec.engine.speculator.proposer.typical is None  # lossless unless asked
    assert _ids(spec.generate(PROMPTS, params, use_tqdm=False)) == want
    typ = LLM.from_engine_of(plain, speculative_config=_spec(str(random_heads), tree_nodes=8,
                                                             typical_acceptance=True, posterior_threshold=0.3))
    assert typ.engine.speculator.proposer.typical == (0.3, 0.3)
    outs = typ.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert_no_leaks(spec)
    assert_no_leaks(typ)


class OracleTrees(Proposer):
    """Trees that contain the true continuation behind decoys: node order puts accepted nodes in
    non-sequential slots, so every accepted step after the first depth needs the K/V compaction."""

    name = "oracle"

    def __init__(self, futures: dict[tuple[int, ...], list[int]]) -> None:
        self.futures = futures

    def tree_budget(self, seq, room, cost, batch):
        return min(5, room), 3.0

    def propose(self, seqs, budgets):
        out = []
        for seq, k in zip(seqs, budgets):
            fut = self.futures[tuple(seq.prompt_token_ids)][seq.num_output_tokens :][:3]
            if k <= 0 or not fut:
                out.append(Proposal([]))
                continue
            tokens, parents = [(fut[0] + 11) % VOCAB, fut[0]], [-1, -1]
            if len(fut) > 1:
                tokens += [(fut[1] + 5) % VOCAB, fut[1]]
                parents += [1, 1]
            if len(fut) > 2:
                tokens.append(fut[2])
                parents.append(3)
            out.append(Proposal(tokens[:k], None, parents[:k]))
        return out


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_oracle_trees_are_lossless_with_kv_compaction(plain, tiny_model_dir, mode):
    """Greedy: identical tokens. Sampling: the tree walk draws one token per emitted position from the target
    distribution with the request's generator, so a seeded request reproduces plain seeded sampling exactly."""
    def params(i: int) -> SamplingParams:
        if mode == "greedy":
            return SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        return SamplingParams(temperature=1.0, top_k=20, max_tokens=30, seed=100 + i, ignore_eos=True)

    plist = [params(i) for i in range(len(PROMPTS))]
    base = plain.generate(PROMPTS, plist, use_tqdm=False)
    futures = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in base}
    spec = LLM.from_engine_of(plain, speculative_config={"method": "ngram", "use_cost_model": False},
                              block_size=4)
    eng = spec.engine
    eng.speculator = Speculator(eng.drafting_view(), SpeculativeConfig(method="ngram", use_cost_model=False),
                                OracleTrees(futures))
    outs = spec.generate(PROMPTS, plist, use_tqdm=False)
    assert _ids(outs) == _ids(base)
    assert min(o.metrics.mean_accepted_tokens for o in outs) > 2.0
    assert_no_leaks(spec)


# ----------------------------------------------------------------------------------------------- schedules
def test_loss_weights_and_temperatures_by_offset():
    assert per_offset([1.0, 0.8, 0.6, 0.4], 4, "decay") == [1.0, 0.8, 0.6, 0.4]
    assert per_offset([1.0, 0.8], 3, "decay") == pytest.approx([1.0, 0.8, 0.64])
    assert per_offset([1.0, 1.2], 4, "grow") == pytest.approx([1.0, 1.2, 1.4, 1.6])
    torch.manual_seed(0)
    base = MedusaHeads(16, [1, 2, 2], diversity="exclude")
    base.init_weights(seed=1, std=0.3)
    heads = TrainableHeads(base)
    lm = torch.randn(40, 16)
    h = torch.randn(32, 16)
    tg = torch.randint(0, 40, (32, 2))
    tg[0, 1] = -1
    temps = [1.0, 2.0]
    losses = head_losses(heads, lm, h, tg, [1, 2], temps)
    z = heads(h, [0, 1, 2])
    lg = F.linear(z, lm)
    assert torch.allclose(losses[0], F.cross_entropy(lg[:, 0] / 1.0, tg[:, 0]))
    assert torch.allclose(losses[1], F.cross_entropy(lg[:, 1] / 2.0, tg[:, 1], ignore_index=-1))
    # head 2 (second on offset 2): head 1's pick masked out, rows where head 1 was right do not train it
    pick = lg[:, 1].argmax(-1)
    masked = lg[:, 2].scatter(1, pick[:, None], float("-inf"))
    t2 = torch.where(tg[:, 1] == pick, -1, tg[:, 1])
    assert torch.allclose(losses[2], F.cross_entropy(masked / 2.0, t2, ignore_index=-1))
    ckpt = head_losses(heads, lm, h, tg, [1, 2], temps, grad_checkpoint=True)
    assert all(torch.allclose(ckpt[i], losses[i]) for i in losses)
    # the total: w by offset (1.0, 0.8, 0.6, 0.4) times each head's loss
    ones = {i: torch.tensor(1.0) for i in range(10)}
    assert float(weighted_loss(ones, PYRAMID, [1.0, 0.8, 0.6, 0.4])) == pytest.approx(1 + 2 * 0.8 + 3 * 0.6 + 4 * 0.4)
    assert float(weighted_loss({0: torch.tensor(2.0), 3: torch.tensor(1.0)}, PYRAMID, [1.0, 0.8, 0.6, 0.4])) \
        == pytest.approx(2.6)


def test_progressive_schedule_follows_its_config():
    s = ProgressiveSchedule(max_offset=4, min_steps=10, max_steps=30, tol=0.01, window=5)
    added = [step for step in range(100) if s.update(step, 5.0)]  # flat loss: stable as soon as allowed
    assert added == [9, 19, 29] and s.offset == 4 and s.transitions == [10, 20, 30]
    s = ProgressiveSchedule(max_offset=3, min_steps=10, max_steps=30, tol=0.01, window=5)
    added = [step for step in range(100) if s.update(step, 100.0 * 0.9**step)]  # still improving: cap
    assert added == [29, 59]
    assert s.active_offsets() == [1, 2, 3]
    assert ProgressiveSchedule(max_offset=4, enabled=False).active_offsets() == [1, 2, 3, 4]


def test_curriculum_schedule_and_sampler_follow_their_config():
    c = CurriculumSchedule(end_len=1000, start_len=100, ramp_frac=0.5)
    assert [c.max_len(p) for p in (0.0, 0.25, 0.5, 0.9)] == [100, 550, 1000, 1000]
    assert CurriculumSchedule(end_len=1000, enabled=False).max_len(0.0) == 1000
    pos = np.random.default_rng(0).integers(0, 1000, 5000)
    sampler = CurriculumSampler(pos, 64, torch.Generator().manual_seed(0))
    for limit in (50, 300, 1000):
        rows = sampler.sample(limit)
        assert pos[rows].max() <= limit
    assert len(set(sampler.sample(1000).tolist())) > 50
    small = CurriculumSampler(np.array([5, 900, 7]), 2, torch.Generator().manual_seed(0))
    assert set(small.sample(0).tolist()) <= {0, 2}  # too few eligible: the shortest rows


# ------------------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def distill_dir(plain, tmp_path_factory) -> Path:
    """A small self-distillation set from the tiny model (greedy answers, the format distill-data writes)."""
    g = random.Random(0)
    words = "alpha beta gamma delta one two three red green blue cat dog sun moon".split()
    prompts = [" ".join(g.choice(words) for _ in range(6 + i % 5)) for i in range(30)]
    outs = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    d = tmp_path_factory.mktemp("distill")
    with open(d / "samples.jsonl", "w") as f:
        for i, o in enumerate(outs):
            f.write(json.dumps({"id": f"t:{i}", "mode": "greedy", "prompt_token_ids": o.prompt_token_ids,
                                "output_token_ids": o.outputs[0].token_ids}) + "\n")
    (d / "manifest.json").write_text(json.dumps({"note": "tiny test data"}))
    return d


def _cfg(distill_dir: Path, work: Path, out: Path, **kw) -> MedusaTrainConfig:
    base = dict(data=str(distill_dir), out=str(out), work_dir=str(work), cache_dir=str(work / "cache"), max_steps=40,
                batch_size=64, vocab_subset=1024, lr=1e-2, val_frac=0.2, save_every=10, stage_max_frac=0.25,
                stable_tol=-1.0, curriculum_start=20, seed=0)
    base.update(kw)
    return MedusaTrainConfig(**base)


def test_short_training_run_lowers_loss_and_writes_a_loadable_resumable_checkpoint(plain, distill_dir, tmp_path):
    cfg = _cfg(distill_dir, tmp_path / "work", tmp_path / "heads")
    tr = MedusaTrainer(cfg, llm=plain, log=lambda *a: None)
    assert tr.data.hidden.shape[1] == 64 and len(tr.data.val_rows) > 0
    # the cached hidden state of a row predicts, through the target's own LM head, that row's token
    rows = tr.data.train_rows[:200]
    h = torch.from_numpy(np.asarray(tr.data.hidden[rows], dtype=np.float32))
    agree = (F.linear(h, tr.full_w).argmax(-1).numpy() == tr.data.tokens[rows]).mean()
    assert agree > 0.95
    # progressive stage 1: only offset 1 learns
    before = [p.detach().clone() for p in tr.heads.w]
    tr.train_step(tr.sampler.sample(10_000), [1])
    assert not torch.equal(before[0], tr.heads.w[0].detach())
    assert all(torch.equal(before[i], tr.heads.w[i].detach()) and tr.heads.w[i].grad is None for i in range(1, 10))
    tr = MedusaTrainer(_cfg(distill_dir, tmp_path / "work", tmp_path / "heads", restart=True), llm=plain,
                       log=lambda *a: None)
    tr.train(max_new_steps=20)  # "interrupted" half way; the checkpoint holds step 20
    assert tr.step == 20
    resumed = MedusaTrainer(cfg, llm=plain, log=lambda *a: None)
    assert resumed.step == 20
    resumed.train()
    # schedules as configured: offsets join every 10 steps; the curriculum's context limit grows
    hist = resumed.history
    assert [hh["offsets"] for hh in hist[::10]] == [1, 2, 3, 4]
    assert all(len(hh["loss"]) == [1, 3, 6, 10][hh["offsets"] - 1] for hh in hist)
    lens = [hh["max_len"] for hh in hist]
    assert lens[0] < lens[-1] and lens == sorted(lens)
    first = np.mean([hh["loss"][0] for hh in hist[:5]])
    last = np.mean([hh["loss"][0] for hh in hist[-5:]])
    assert last < first - 0.3, (first, last)
    # an uninterrupted run reaches the same weights
    straight = MedusaTrainer(_cfg(distill_dir, tmp_path / "work2", tmp_path / "heads2"), llm=plain,
                             log=lambda *a: None)
    straight.train()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(straight.heads.parameters(),
                                                                resumed.heads.parameters()))
    out = resumed.export(cfg.out, "pytest")
    meta = json.loads((out / "config.json").read_text())
    assert len(meta["validation"]["head_top1"]) == 10 and meta["tree"]["paths"]
    assert json.loads((out / "record.json").read_text())["seed"] == 0
    # the trained heads load, propose trees and decode losslessly. (Acceptance is not asserted here: a random tiny
    # model's text is barely predictable, ~3% top-1 after 40 steps; test_bundled_model checks the shipped heads.)
    # a fixed tree size: the exported default is sized from timings of this machine and may be 0 (no tree)
    spec = LLM.from_engine_of(plain, speculative_config=_spec(str(out), tree_nodes=4), block_size=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(outs) == _ids(plain.generate(PROMPTS, params, use_tqdm=False))
    assert all(o.metrics.num_draft_tokens > 0 for o in outs)
    assert_no_leaks(spec)


def test_cli_trains_exports_and_retunes_the_tree(distill_dir, tiny_model_dir, tmp_path, capsys):
    from leapdecode.cli import main

    out = tmp_path / "heads"
    rc = main(["train", "medusa", "--data", str(distill_dir), "--out", str(out), "--model", str(tiny_model_dir),
               "--work-dir", str(tmp_path / "w"), "--layout", "one-per-offset", "--max-steps", "6",
               "--batch-size", "32", "--vocab-subset", "512", "--val-frac", "0.2",
               "--cache-dir", str(tmp_path / "c"), "--cache-precision", "bf16"])
    assert rc == 0 and "wrote Medusa heads" in capsys.readouterr().out
    recipe = json.loads((out / "record.json").read_text())
    assert recipe["command"].startswith("leapdecode ") and recipe["data"]["sha256_16"]
    heads, subset, meta = load_heads(out)
    assert heads.offsets == [1, 2, 3, 4] and len(subset) == 512 and meta["vocab_subset_size"] == 512
    prompts = tmp_path / "dev.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]))
    rc = main(["train", "medusa-tree", "--heads", str(out), "--model", str(tiny_model_dir), "--prompts",
               str(prompts), "--num-prompts", "2", "--max-tokens", "12"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tree"]["source"] == "2 development prompts" and "tree_validation" in cfg
    assert cfg["tree"]["default_nodes"] >= 0


def test_time_budget_caps_steps_and_keeps_the_initial_weights(plain, distill_dir, tmp_path):
    cfg = _cfg(distill_dir, tmp_path / "work", tmp_path / "heads", max_steps=None, epochs=50, time_budget_min=1e-4)
    tr = MedusaTrainer(cfg, llm=plain, log=lambda *a: None)
    assert tr.total_steps == 1
    fresh = MedusaTrainer(_cfg(distill_dir, tmp_path / "work", tmp_path / "heads", restart=True), llm=plain,
                          log=lambda *a: None)
    assert all(torch.equal(a, b) for a, b in zip(tr.heads.parameters(), fresh.heads.parameters()))
    assert tr.progressive.max_steps == 1
