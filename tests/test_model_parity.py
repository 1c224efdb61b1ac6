"""Logit parity with HF transformers on tiny random models, through the paged KV cache.

Our model is driven the way the engine drives it (``ModelRunner`` over a ``KVCache`` whose block tables come
from a ``BlockManager``) and every returned logit row is compared with HF's full forward over the same tokens.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ModelRunner
from leapdecode.engine.sequence import Sequence
from leapdecode.kernels import extension
from leapdecode.models import kernel_plan
from leapdecode.models.loader import load_model
from leapdecode.sampling_params import SamplingParams
from tests.conftest import TINY_DEFAULTS

TOL = 1e-4
VOCAB = 512  # small vocabulary: parity does not need real text, and the LM head stays cheap

# the suite's tiny Llama (conftest), with a small vocabulary and context
BASE: dict[str, Any] = {**TINY_DEFAULTS, "vocab_size": VOCAB, "max_position_embeddings": 512}


def _build_hf(arch: str, seed: int, overrides: dict[str, Any]) -> torch.nn.Module:
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    cfg = cfg_cls(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # widen the tiny init so that logits are far from uniform
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(4.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)  # Qwen2's QKV bias initialises to zero: make it matter
    return model


@dataclass
class Pair:
    """Our model (with a fresh KV pool per call of :meth:`runner`) and HF's, loaded from the same folder."""

    path: Path
    ours: torch.nn.Module
    hf: torch.nn.Module

    def runner(self, num_blocks: int, block_size: int) -> tuple[ModelRunner, BlockManager]:
        cfg = self.ours.config
        kv = KVCache(cfg, num_blocks, block_size, torch.float32, torch.device("cpu"))
        bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        return ModelRunner(self.ours, kv, block_size, torch.device("cpu")), bm

    @torch.no_grad()
    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([tokens])).logits[0].float()


MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gqa_4_2": ("llama", {}),
    "mqa_4_1": ("llama", {"num_key_value_heads": 1}),
    "mha_4_4": ("llama", {"num_key_value_heads": 4, "rope_theta": 500.0}),
    "tied": ("llama", {"tie_word_embeddings": True}),
    "llama3_rope": (
        "llama",
        {
            "rope_theta": 5000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "qwen2_bias": ("qwen2", {"rope_theta": 20000.0}),
    "mistral_window": ("mistral", {"sliding_window": 8, "rope_theta": 10000.0}),  # prompts here cross it
}


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory) -> Callable[[str], Pair]:
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[str, bool], Pair] = {}

    def get(name: str, kernels: bool = False) -> Pair:
        """``kernels``: our model runs the CPU kernels (packed linears, C++ norm and few-row attention)."""
        if (name, False) not in cache:
            arch, overrides = MODELS[name]
            d = tmp_path_factory.mktemp(f"parity_{name}")
            _build_hf(arch, seed=list(MODELS).index(name) + 1, overrides=overrides).save_pretrained(str(d))
            ours, _ = load_model(d)
            hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
            cache[name, False] = Pair(d, ours, hf)
        if kernels and (name, True) not in cache:
            if extension.load_kernel() is None:
                pytest.skip("no C++ toolchain to build the kernels")
            base = cache[name, False]
            ours, _ = load_model(base.path)
            assert kernel_plan.use_kernels(ours) > 0
            cache[name, True] = Pair(base.path, ours, base.hf)
        return cache[name, kernels]

    return get


def _tokens(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, VOCAB) for _ in range(n)]


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("s", tokens, SamplingParams())


def _run_schedule(
    runner: ModelRunner,
    bm: BlockManager,
    token_lists: list[list[int]],
    steps: list[list[int]],
) -> list[torch.Tensor]:
    """Feed each sequence's tokens in chunks; ``steps[k][i]`` is how many new tokens sequence i runs in flat
    batch k (0 = sits out). Every sequence's logits of every position are returned, in position order."""
    seqs = [_seq(t) for t in token_lists]
    done = [0] * len(seqs)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for counts in steps:
        items, who = [], []
        for i, n in enumerate(counts):
            if n == 0:
                continue
            s = seqs[i]
            bm.allocate(s, done[i] + n)
            items.append(
                ForwardItem(s.block_table, done[i], s.token_ids[done[i] : done[i] + n], list(range(n)))
            )
            who.append(i)
        for i, res in zip(who, runner.execute(items), strict=False):
            assert res.logits.shape == (counts[i], VOCAB)
            got[i].append(res.logits)
            done[i] += counts[i]
    assert done == [len(t) for t in token_lists], "schedule does not cover every token"
    free_before = bm.num_free_blocks + sum(len(s.block_table) for s in seqs)
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == free_before
    return [torch.cat(g) for g in got]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, what
    assert ref.abs().max() > 1.0, "reference logits are too flat to be a meaningful check"
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"{what}: max |logit diff| {diff:.3g} > {TOL}"


def _scramble(bm: BlockManager, seed: int) -> list[int]:
    """Hold every odd block and shuffle the free list, so that no two blocks a table gets are adjacent (which
    defeats contiguous-first allocation) and tables are not sorted. Returns the new free order."""
    holder = _seq([0])
    for bid in range(1, bm.num_blocks, 2):
        bm._take(bid)
        holder.block_table.append(bid)
    order = list(bm.free_ids)
    random.Random(seed).shuffle(order)
    bm.free_ids = OrderedDict((i, None) for i in order)
    return order


# ------------------------------------------------------------------------------------------------ prefill


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_matches_hf(model_pair, name: str) -> None:
    pair = model_pair(name)
    tokens = _tokens(45, seed=1)
    ref = pair.hf_logits(tokens)
    runner, bm = pair.runner(num_blocks=16, block_size=4)  # 45 tokens span 12 blocks
    (ours,) = _run_schedule(runner, bm, [tokens], [[45]])
    _assert_close(ours, ref, f"{name} prefill")


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_chunked_prefill_then_decode_matches_hf(model_pair, name: str, kernels: bool) -> None:
    """Prefill in uneven chunks (large and small query groups), then decode one token at a time across block
    boundaries of a scrambled (non-contiguous) table."""
    pair = model_pair(name, kernels)
    tokens = _tokens(50, seed=2)
    ref = pair.hf_logits(tokens)
    runner, bm = pair.runner(num_blocks=30, block_size=4)
    _scramble(bm, seed=3)
    steps = [[20], [3], [9], [1], [5]] + [[1]] * 12
    (ours,) = _run_schedule(runner, bm, [tokens], steps)
    _assert_close(ours, ref, f"{name} chunked prefill + decode")


# --------------------------------------------------------------------------------------------- block tables


@pytest.mark.parametrize("block_size", [4, 16])
def test_non_contiguous_tables_match_contiguous(model_pair, block_size: int) -> None:
    pair = model_pair("gqa_4_2")
    tokens = _tokens(90, seed=4)
    ref = pair.hf_logits(tokens)
    steps = [[33], [16], [1], [1], [2], [17], [20]]
    runner, bm = pair.runner(num_blocks=40, block_size=block_size)
    (contig,) = _run_schedule(runner, bm, [tokens], steps)
    runner, bm = pair.runner(num_blocks=2 * -(-90 // block_size) + 2, block_size=block_size)
    order = _scramble(bm, seed=5)
    s = _seq(tokens)
    bm.allocate(s, len(tokens))
    assert s.block_table == order[: len(s.block_table)]  # really scrambled: the shuffled free order
    assert any(b != a + 1 for a, b in zip(s.block_table, s.block_table[1:], strict=False))
    bm.free(s)
    bm.free_ids = OrderedDict((i, None) for i in order)
    (scrambled,) = _run_schedule(runner, bm, [tokens], steps)
    _assert_close(contig, ref, f"contiguous table, block_size {block_size}")
    _assert_close(scrambled, ref, f"scrambled table, block_size {block_size}")


def test_interleaved_growth_gives_non_contiguous_tables(model_pair) -> None:
    """Two sequences that grow in turn end up with interleaved blocks (A: 0 2 4 ..., B: 1 3 5 ...)."""
    pair = model_pair("gqa_4_2")
    a, b = _tokens(30, seed=6), _tokens(30, seed=7)
    runner, bm = pair.runner(num_blocks=20, block_size=4)
    seqs = [_seq(a), _seq(b)]
    for n in range(4, 33, 4):
        for s in seqs:
            bm.allocate(s, n)
    assert seqs[0].block_table[:3] == [0, 2, 4] and seqs[1].block_table[:3] == [1, 3, 5]
    tables = [list(s.block_table) for s in seqs]
    for s in seqs:
        bm.free(s)
    # replay the same interleaved tables through the runner: 4 tokens per sequence per flat batch
    results: list[list[torch.Tensor]] = [[], []]
    for start in range(0, 30, 4):
        n = min(4, 30 - start)
        items = [
            ForwardItem(tables[i], start, t[start : start + n], list(range(n))) for i, t in enumerate((a, b))
        ]
        for i, res in enumerate(runner.execute(items)):
            results[i].append(res.logits)
    _assert_close(torch.cat(results[0]), pair.hf_logits(a), "interleaved table A")
    _assert_close(torch.cat(results[1]), pair.hf_logits(b), "interleaved table B")


# ----------------------------------------------------------------------------------------- mixed flat batches


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("name", ["gqa_4_2", "mqa_4_1", "mha_4_4", "qwen2_bias", "mistral_window"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_flat_batches_match_hf(model_pair, name: str, block_size: int, kernels: bool) -> None:
    """Prefills (long and short), chunk continuations and decode rows of several sequences, one flat batch."""
    pair = model_pair(name, kernels)
    lens = [60, 23, 9, 40]
    token_lists = [_tokens(n, seed=10 + i) for i, n in enumerate(lens)]
    refs = [pair.hf_logits(t) for t in token_lists]
    steps = [
        [30, 12, 0, 0],  # two prefill chunks: one large (own attention call), one small
        [1, 11, 9, 0],  # A: chunk of 1 (decode-like), B finishes its prompt, C whole prompt
        [29, 0, 0, 18],  # A's second large chunk next to D's first
        [0, 0, 0, 22],
    ]
    runner, bm = pair.runner(num_blocks=80, block_size=block_size)
    _scramble(bm, seed=block_size)
    outs = _run_schedule(runner, bm, token_lists, steps)
    for i, (o, r) in enumerate(zip(outs, refs, strict=False)):
        _assert_close(o, r, f"{name} bs={block_size} sequence {i}")


@pytest.mark.parametrize("kernels", [False, True])
def test_decode_batch_with_prefill_matches_hf(model_pair, kernels: bool) -> None:
    """Many decode rows of different context lengths padded into one call, next to a prefill."""
    pair = model_pair("gqa_4_2", kernels)
    lens = [37, 5, 18, 26, 50]
    token_lists = [_tokens(n, seed=20 + i) for i, n in enumerate(lens)]
    refs = [pair.hf_logits(t) for t in token_lists]
    # prefill all but the last 4 tokens of the first four, then decode them together while the 5th prefills
    prefix = [n - 4 for n in lens[:4]]
    steps = [prefix + [0]] + [[1, 1, 1, 1, 0]] * 2 + [[1, 1, 1, 1, 40], [1, 1, 1, 1, 10]]
    runner, bm = pair.runner(num_blocks=80, block_size=4)
    _scramble(bm, seed=9)
    outs = _run_schedule(runner, bm, token_lists, steps)
    for i, (o, r) in enumerate(zip(outs, refs, strict=False)):
        _assert_close(o, r, f"sequence {i}")


def test_logit_rows_select_only_requested_positions(model_pair) -> None:
    pair = model_pair("gqa_4_2")
    tokens = _tokens(25, seed=30)
    ref = pair.hf_logits(tokens)
    runner, bm = pair.runner(num_blocks=8, block_size=4)
    s = _seq(tokens)
    bm.allocate(s, 25)
    res = runner.execute([ForwardItem(s.block_table, 0, tokens, [24]), ForwardItem([7], 0, tokens[:3], [])])
    assert res[0].logits.shape == (1, VOCAB) and res[1].logits.shape[0] == 0
    _assert_close(res[0].logits, ref[24:25], "last row")


# --------------------------------------------------------------------------------------------- config reading


def test_config_reads_rope_and_tying(model_pair) -> None:
    """The config fields parity depends on, so that a silent default cannot hide behind random weights."""
    cfg = model_pair("llama3_rope").ours.config
    assert cfg.rope_theta == 5000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["factor"] == 4.0
    tied = model_pair("tied").ours
    assert tied.config.tie_word_embeddings
    assert tied.lm_head.get_weight() is tied.embed_tokens.weight
    q = model_pair("qwen2_bias").ours.config
    assert q.attention_bias and q.rope_theta == 20000.0


# ------------------------------------------------------------------------------------ bit-identical kernels


@pytest.mark.parametrize("name", ["gqa_4_2", "tied", "mistral_window"])
def test_kernel_rows_are_bit_identical_alone_batched_and_as_drafts(model_pair, name: str) -> None:
    """With the CPU kernels every row is computed on its own: a token's logits are bitwise the same decoded
    alone, decoded in a batch with another sequence, and verified as part of a draft chain, which is what makes
    greedy speculative decoding token-identical to plain decoding by construction."""
    pair = model_pair(name, kernels=True)
    a, b = _tokens(30, seed=40), _tokens(21, seed=41)
    alone = _run_schedule(*pair.runner(num_blocks=40, block_size=4), [a], [[26], [1], [1], [1], [1]])[0]
    chain = _run_schedule(*pair.runner(num_blocks=40, block_size=4), [a], [[26], [4]])[0]
    batched = _run_schedule(
        *pair.runner(num_blocks=40, block_size=4), [a, b], [[26, 17], [1, 1], [1, 1], [1, 1], [1, 1]]
    )[0]
    # next to another sequence's prefill chunk a step runs op by op (not the fused C++ layer): still bitwise equal
    mixed = _run_schedule(
        *pair.runner(num_blocks=40, block_size=4), [a, b], [[26, 0], [1, 17], [1, 4], [1, 0], [1, 0]]
    )[0]
    assert torch.equal(chain[26:], alone[26:])
    assert torch.equal(batched[26:], alone[26:])
    assert torch.equal(mixed[26:], alone[26:])
    _assert_close(alone, pair.hf_logits(a), f"{name} with kernels")
