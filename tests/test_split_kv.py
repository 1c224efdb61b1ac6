"""Split-KV (FlashDecoding-style) attention equals plain attention: dense, paged, and through the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leapdecode.layers import split_kv
from leapdecode.layers.attention import SeqAttention, build_attention_metadata, paged_attention
from leapdecode.layers.split_kv import merge_partials, partial_attention, split_kv_attention

ATOL = 1e-5


def reference(q, k, v, scale, mask=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.fixture(params=["cpu_flash", "materialized"])
def kernel(request, monkeypatch):
    """Run every test with the fused CPU kernel and with the portable (GPU / fallback) score path."""
    if request.param == "materialized":
        monkeypatch.setattr(split_kv, "_CPU_FLASH", None)
    return request.param


@pytest.mark.parametrize("nk,chunk", [(1, 4), (37, 8), (64, 64), (100, 7), (257, 64), (300, 1000)])
@pytest.mark.parametrize("heads,kv_heads,nq", [(9, 3, 1), (4, 4, 3), (8, 2, 5)])
def test_dense_equals_plain(kernel, nk, chunk, heads, kv_heads, nq):
    torch.manual_seed(nk * 131 + heads)
    q = torch.randn(2, heads, nq, 64)
    k, v = torch.randn(2, kv_heads, nk, 64), torch.randn(2, kv_heads, nk, 64)
    got = split_kv_attention(q, k, v, 0.125, chunk=chunk)
    torch.testing.assert_close(got, reference(q, k, v, 0.125), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("chunk", [5, 16, 33])
def test_dense_with_padding_mask(kernel, chunk):
    """Sequences of different lengths padded to one: padding keys masked, whole chunks can be invisible."""
    torch.manual_seed(chunk)
    lens = [100, 23, 61]
    q = torch.randn(3, 6, 2, 32)
    k, v = torch.randn(3, 2, 100, 32), torch.randn(3, 2, 100, 32)
    mask = torch.zeros(3, 1, 2, 100, dtype=torch.bool)
    for i, n in enumerate(lens):
        mask[i, 0, 0, : n - 1] = True  # causal over the two new tokens at the end
        mask[i, 0, 1, :n] = True
    got = split_kv_attention(q, k, v, 0.2, mask=mask, chunk=chunk)
    torch.testing.assert_close(got, reference(q, k, v, 0.2, mask), atol=ATOL, rtol=ATOL)


def test_fully_masked_chunk_drops_out(kernel):
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    mask = torch.tensor([[[[False] * 4, [True, False, True, False]]]])
    o, lse = partial_attention(q, k, v, 1.0, mask)
    assert lse[0, 0, 0] == float("-inf") and torch.isfinite(lse[0, 0, 1])
    o2, lse2 = partial_attention(q, k, v, 1.0)
    merged = merge_partials(torch.stack([o, o2]), torch.stack([lse, lse2]))
    torch.testing.assert_close(merged[0, 0, 0], o2[0, 0, 0])  # row 0 comes only from the second partial


# ------------------------------------------------------------------------------------------------ paged path

BLOCK = 16


def paged_case(tables, ctxs, q_lens, heads=9, kv_heads=3, dim=64, tree=None, seed=0):
    torch.manual_seed(seed)
    num_slots = (max(max(t) for t in tables) + 1) * BLOCK
    k_cache, v_cache = torch.randn(num_slots, kv_heads, dim), torch.randn(num_slots, kv_heads, dim)
    seqs, starts = [], 0
    for t, ctx, ql in zip(tables, ctxs, q_lens, strict=True):
        seqs.append(SeqAttention(starts, ql, ctx, t, BLOCK, tree))
        starts += ql
    slot_mapping = torch.cat([s.slots()[s.ctx_len - s.q_len :] for s in seqs])
    q = torch.randn(starts, heads, dim)
    k, v = torch.randn(starts, kv_heads, dim), torch.randn(starts, kv_heads, dim)
    return seqs, slot_mapping, q, k, v, k_cache, v_cache, heads // kv_heads


def run_paged(case, split: bool, monkeypatch, chunk=48, batch_chunk=32):
    seqs, slot_mapping, q, k, v, k_cache, v_cache, group = case
    big = 1 << 60
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_CONTEXT", 0 if split else big)
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_BATCH_TOKENS", 0 if split else big)
    monkeypatch.setattr(split_kv, "SPLIT_KV_CHUNK", chunk)
    monkeypatch.setattr(split_kv, "SPLIT_KV_BATCH_CHUNK", batch_chunk)
    meta = build_attention_metadata(seqs, slot_mapping, group, torch.device("cpu"))
    small = [g for g in meta.groups if g.fold]
    assert all((g.split is not None) == split for g in small)
    return paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125), meta


CONTIG = list(range(20))
FRAG = list(range(0, 40, 2))  # every other block: the plain path gathers


@pytest.mark.parametrize("table", [CONTIG, FRAG], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize("ctx", [100, 96, 301])
@pytest.mark.parametrize("q_len", [1, 4])
def test_paged_single_sequence(kernel, monkeypatch, table, ctx, q_len):
    case = paged_case([table], [ctx], [q_len], seed=ctx + q_len)
    want, _ = run_paged(case, False, monkeypatch)
    got, meta = run_paged(case, True, monkeypatch)
    assert meta.groups[0].split.num_full == ctx // 48
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def test_paged_tree_mask(kernel, monkeypatch):
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2 is a sibling of node 1
    case = paged_case([FRAG], [200], [3], tree=tree, seed=3)
    want, _ = run_paged(case, False, monkeypatch)
    got, _ = run_paged(case, True, monkeypatch)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def test_paged_padded_batch(kernel, monkeypatch):
    """Several decoding sequences (different lengths, new-token counts, interleaved blocks) in one group."""
    tables = [list(range(j, 4 * 25, 4)) for j in range(4)]
    case = paged_case(tables, [390, 17, 250, 101], [1, 3, 2, 1], seed=7)
    want, _ = run_paged(case, False, monkeypatch)
    got, meta = run_paged(case, True, monkeypatch, batch_chunk=40)  # rounded down to whole blocks: 32
    assert meta.groups[0].split.chunked_read and meta.groups[0].split.chunk == 32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def test_prefill_groups_are_never_split(monkeypatch):
    """A long prefill chunk (compute-bound) keeps its plain call; a decode in the same step splits."""
    case = paged_case([CONTIG, FRAG], [300, 200], [40, 1], seed=1)
    want, _ = run_paged(case, False, monkeypatch)
    seqs, slot_mapping, q, k, v, k_cache, v_cache, group = case
    got, meta = run_paged(case, True, monkeypatch)
    assert [g.split is not None for g in meta.groups] == [False, True]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def test_default_thresholds(monkeypatch):
    """Defaults are the measured ones (see split_kv): one sequence never splits on CPU; a batch only when big."""
    long = [SeqAttention(0, 1, 3000, list(range(200)), BLOCK)]
    meta = build_attention_metadata(long, long[0].slots()[-1:], 3, torch.device("cpu"))
    assert split_kv.SPLIT_KV_MIN_CONTEXT is None and meta.groups[0].split is None
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_CONTEXT", 2048)
    meta = build_attention_metadata(long, long[0].slots()[-1:], 3, torch.device("cpu"))
    assert meta.groups[0].split is not None
    short = [SeqAttention(0, 1, 700, list(range(200)), BLOCK)]  # below 2 chunks: never split
    meta = build_attention_metadata(short, short[0].slots()[-1:], 3, torch.device("cpu"))
    assert meta.groups[0].split is None

    def batch(n: int, ctx: int):
        seqs = [SeqAttention(i, 1, ctx, list(range(i, n * 400, n)), BLOCK) for i in range(n)]
        slots = torch.cat([s.slots()[-1:] for s in seqs])
        return build_attention_metadata(seqs, slots, 3, torch.device("cpu")).groups[0].split

    assert batch(4, 2000) is None
    assert batch(8, 6144) is not None


def test_engine_output_unchanged_when_split(tiny_model_dir, monkeypatch):
    """Greedy generation through the whole engine is identical with split-KV forced on at tiny sizes."""
    from leapdecode import LLM, SamplingParams
    from tests.conftest import assert_no_leaks

    prompts = [
        "The history of the city begins with a small settlement on the river, " * 6,
        "Once upon a time",
        "def fibonacci(n):\n    " * 4,
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def generate() -> list[list[int]]:
        llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=128, max_num_seqs=4)
        batch = llm.generate(prompts, params, use_tqdm=False)  # decodes together: a padded group
        alone = llm.generate(prompts[:1], params, use_tqdm=False)  # one sequence
        assert_no_leaks(llm)
        return [o.outputs[0].token_ids for o in batch + alone]

    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_CONTEXT", 1 << 60)
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_BATCH_TOKENS", 1 << 60)
    want = generate()
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_CONTEXT", 32)
    monkeypatch.setattr(split_kv, "SPLIT_KV_CHUNK", 16)
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_BATCH_TOKENS", 64)
    monkeypatch.setattr(split_kv, "SPLIT_KV_BATCH_CHUNK", 16)
    calls = []
    original = split_kv.split_attention
    monkeypatch.setattr(
        split_kv, "split_attention", lambda *a: calls.append(a[5].chunked_read) or original(*a)
    )
    got = generate()
    assert got == want
    assert True in calls and False in calls  # both modes ran
