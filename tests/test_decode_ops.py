"""The decode-step C++ ops (kernels/layer_ops.cpp, attention_rows.cpp): RMSNorm and paged attention equal torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leapdecode.kernels import extension
from leapdecode.layers import attention_rows, int8_kv, layer_ops

ext = extension.load_kernel()
pytestmark = pytest.mark.skipif(ext is None, reason="no C++ toolchain to build the kernels")


@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 40), (100, 64)])  # 100 rows: the threaded (prefill) path
def test_rms_norm_matches_torch_and_rows_are_independent(rows: int, dim: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    y = layer_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, F.rms_norm(x, (dim,), w, 1e-5), rtol=1e-5, atol=1e-6)
    assert torch.equal(layer_ops.rms_norm(x[-1:].contiguous(), w, 1e-5), y[-1:])
    xg = x.clone().requires_grad_()  # training keeps torch's differentiable op
    layer_ops.rms_norm(xg, w, 1e-5).sum().backward()
    assert xg.grad is not None


def _slot_lists(lengths: list[int], num_slots: int, g: torch.Generator) -> list[torch.Tensor]:
    """The first row's slots random, every later row's a prefix of one shared list, as a tree's rows share their
    sequence's context (the kernel orders such neighbouring rows' tasks by KV head)."""
    shared = torch.randperm(num_slots, generator=g)
    return [shared[:n] if i else torch.randperm(num_slots, generator=g)[:n] for i, n in enumerate(lengths)]


def _reference(q, k_cache, v_cache, slots: torch.Tensor, scale: float, group: int) -> torch.Tensor:
    """One row [H, D] over the listed slots with torch's SDPA."""
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    kg, vg = k_cache[slots].transpose(0, 1).unsqueeze(0), v_cache[slots].transpose(0, 1).unsqueeze(0)
    return F.scaled_dot_product_attention(q.view(1, hkv, group, d), kg, vg, scale=scale).view(-1, d)


def _cache_pair(kind: str, num_slots: int, hkv: int, d: int, g: torch.Generator):
    """K and V caches of random rows: float32 tensors, or kv_quant's int8 planes. Returns the rows kernel that reads
    them (attention_rows or attention_rows_i8, same signature) and the float32 values they hold (the reference's)."""
    k, v = torch.randn(num_slots, hkv, d, generator=g), torch.randn(num_slots, hkv, d, generator=g)
    if kind == "float32":
        return attention_rows.attention_rows, k, v, k, v
    from leapdecode.layers.kv_quant import QuantizedKV

    planes = []
    for x in (k, v):
        plane = QuantizedKV(torch.zeros(num_slots, hkv, d, dtype=torch.int8),
                            torch.zeros(num_slots, hkv, d // 16, dtype=torch.float16))  # fmt: skip
        plane.write(torch.arange(num_slots), x)
        planes.append(plane)
    deq = [p.read_range(0, num_slots, torch.float32) for p in planes]
    return attention_rows.attention_rows_i8, planes[0], planes[1], deq[0], deq[1]


# 3000 x 9 heads: the threaded path; rows over 512 positions are attended in even chunks of at most 512 slots and
# merged (513: two chunks; 1025: three; 512: still one piece)
@pytest.mark.parametrize("lengths", [[1], [15, 17, 200], [3000, 5], [1025, 2048, 512, 513]])
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: a vector plus a scalar tail
@pytest.mark.parametrize("group", [3, 2, 1])  # query heads per KV head: 3 and 2 have their own V loop at D = 64
def test_attention_rows_match_sdpa_and_do_not_depend_on_each_other(
    lengths: list[int], head_dim: int, group: int
) -> None:
    g = torch.Generator().manual_seed(sum(lengths) + head_dim)
    hkv, num_slots = 3, 4096
    k_cache = torch.randn(num_slots, hkv, head_dim, generator=g)
    v_cache = torch.randn(num_slots, hkv, head_dim, generator=g)
    t = len(lengths) + 2  # two rows of q are left to other kernels: their output rows stay untouched
    q = torch.randn(t, hkv * group, head_dim, generator=g) * 2
    rows = torch.randperm(t, generator=g)[: len(lengths)]
    lists = _slot_lists(lengths, num_slots, g)
    ends = torch.tensor(lengths).cumsum(0)
    spans = torch.stack([ends - torch.tensor(lengths), ends], dim=1)
    scale = head_dim**-0.5
    out = torch.full_like(q, 7.0)
    attention_rows.attention_rows(q, k_cache, v_cache, rows, spans, torch.cat(lists), scale, out)
    for r, slots in zip(rows.tolist(), lists, strict=True):
        torch.testing.assert_close(out[r], _reference(q[r], k_cache, v_cache, slots, scale, group), rtol=1e-5,
                                   atol=2e-6)
        alone = torch.empty_like(q)
        attention_rows.attention_rows(q, k_cache, v_cache, torch.tensor([r]), torch.tensor([[0, len(slots)]]), slots,
                                  scale, alone)
        assert torch.equal(alone[r], out[r])
    untouched = sorted(set(range(t)) - set(rows.tolist()))
    assert (out[untouched] == 7.0).all()


@pytest.mark.parametrize("context", [100, 700, 1030])  # one piece; two chunks; three chunks
@pytest.mark.parametrize("head_dim,group,cache", [(64, 3, "float32"), (64, 2, "float32"), (64, 4, "float32"),
                                                  (24, 3, "float32"), (64, 3, "int8"), (128, 2, "int8"),
                                                  (32, 2, "int8")])
def test_tree_rows_share_their_context_and_each_matches_its_row_alone(context: int, head_dim: int, group: int,
                                                                      cache: str) -> None:
    """A tree's rows (each: the sequence's context, then its ancestors and itself) read the shared context once for
    all of them, block by block (the int8 cache's dequantised once); each row's result is still the bits it gets
    alone, and SDPA's values. Beside them in the same call: another sequence's decode row and a tree row whose
    length chunks differently."""
    g = torch.Generator().manual_seed(context + head_dim + group)
    hkv, num_slots, nodes = 3, 4096, 11  # odd: the rows go two by two, and one alone
    kernel, k_cache, v_cache, k_ref, v_ref = _cache_pair(cache, num_slots, hkv, head_dim, g)
    perm = torch.randperm(num_slots, generator=g)
    ctx, node_slots, other = perm[:context], perm[context : context + nodes], perm[context + nodes :][:333]
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, nodes)]
    lists = [other]
    for i in range(nodes):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        lists.append(torch.cat([ctx, node_slots[path[::-1]]]))
    lists.append(torch.cat([ctx, perm[-600:]]))  # same first slot, longer: chunked otherwise
    lengths = [len(x) for x in lists]
    q = torch.randn(len(lists), hkv * group, head_dim, generator=g)
    ends = torch.tensor(lengths).cumsum(0)
    spans = torch.stack([ends - torch.tensor(lengths), ends], dim=1)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    kernel(q, k_cache, v_cache, torch.arange(len(lists)), spans, torch.cat(lists), scale, out)
    for r, slots in enumerate(lists):
        torch.testing.assert_close(out[r], _reference(q[r], k_ref, v_ref, slots, scale, group), rtol=1e-5, atol=2e-6)
        alone = torch.empty_like(q)
        kernel(q, k_cache, v_cache, torch.tensor([r]), torch.tensor([[0, len(slots)]]), slots, scale, alone)
        assert torch.equal(alone[r], out[r]), r


@pytest.mark.parametrize("lengths", [[1, 37], [3000, 200, 1025, 1030, 513]])
def test_int8_attention_rows_match_sdpa_over_the_dequantized_cache(lengths: list[int]) -> None:
    """The int8 rows kernel dequantizes what kv_quant stores, chunk by chunk; short rows and long (merged) ones."""
    from leapdecode.layers.kv_quant import QuantizedKV

    g = torch.Generator().manual_seed(sum(lengths))
    hkv, group, d, num_slots = 3, 3, 64, 4096

    def plane() -> QuantizedKV:
        return QuantizedKV(torch.zeros(num_slots, hkv, d, dtype=torch.int8), torch.zeros(num_slots, hkv, 4,
                                                                                           dtype=torch.float16))

    k_plane, v_plane = plane(), plane()
    k_plane.write(torch.arange(num_slots), torch.randn(num_slots, hkv, d, generator=g) * 2)
    v_plane.write(torch.arange(num_slots), torch.randn(num_slots, hkv, d, generator=g))
    k_deq, v_deq = (p.read_range(0, num_slots, torch.float32) for p in (k_plane, v_plane))
    q = torch.randn(len(lengths), hkv * group, d, generator=g)
    lists = _slot_lists(lengths, num_slots, g)
    ends = torch.tensor(lengths).cumsum(0)
    spans = torch.stack([ends - torch.tensor(lengths), ends], dim=1)
    out = torch.empty_like(q)
    attention_rows.attention_rows_i8(q, k_plane, v_plane, torch.arange(len(lengths)), spans, torch.cat(lists), 0.125,
                                 out)  # fmt: skip
    for r, slots in enumerate(lists):
        torch.testing.assert_close(out[r], _reference(q[r], k_deq, v_deq, slots, 0.125, group), rtol=1e-5, atol=2e-6)
        alone = torch.empty_like(q)
        attention_rows.attention_rows_i8(q, k_plane, v_plane, torch.tensor([r]), torch.tensor([[0, len(slots)]]), slots,
                                     0.125, alone)  # fmt: skip
        assert torch.equal(alone[r], out[r])


def test_int8_attention_rows_take_heads_wider_than_256() -> None:
    """A head of 512 channels has 32 scales per row: dequantised 16 at a time (a fixed 16-scale buffer overran)."""
    g = torch.Generator().manual_seed(512)
    kernel, k_plane, v_plane, k_ref, v_ref = _cache_pair("int8", 64, 1, 512, g)
    q = torch.randn(2, 2, 512, generator=g)
    slots = torch.randperm(64, generator=g)[:45]
    out = torch.empty_like(q)
    kernel(q, k_plane, v_plane, torch.arange(2), torch.tensor([[0, 5], [5, 45]]), slots, 512**-0.5, out)
    for r, (a, b) in enumerate([(0, 5), (5, 45)]):
        torch.testing.assert_close(out[r], _reference(q[r], k_ref, v_ref, slots[a:b], 512**-0.5, 2), rtol=1e-5,
                                   atol=2e-6)


@pytest.mark.parametrize("calibrated, rotated", [(False, True), (True, True), (True, False)])
def test_int8_quantize_on_write_matches_the_torch_definition(calibrated: bool, rotated: bool) -> None:
    """quantize_kv_rows is kv_quant's write in one call: same scales, int8 values off by at most one step where the
    rotation's float sums round differently (a value right at a rounding boundary); without a rotation, the shifted
    and smoothed rows themselves."""
    from leapdecode.layers.kv_quant import QuantizedKV, quantize, rotation_matrix

    g = torch.Generator().manual_seed(3)
    shift = torch.randn(3, 64, generator=g) * 3 if calibrated else None
    smooth = torch.rand(3, 64, generator=g) + 0.5 if calibrated else None
    plane = QuantizedKV(torch.zeros(64, 3, 64, dtype=torch.int8), torch.zeros(64, 3, 4, dtype=torch.float16),
                        rotation_matrix(64) if rotated else None, shift, smooth)  # fmt: skip
    x = torch.randn(20, 3, 64, generator=g) * torch.logspace(-2, 2, 20).view(-1, 1, 1)
    slots = torch.randperm(64, generator=g)[:20]
    plane.write(slots, x)
    q, s = quantize(plane.to_cache_basis(x), 4)
    torch.testing.assert_close(plane.scale[slots].float(), s.float(), rtol=1e-3, atol=0)
    diff = (plane.data[slots].int() - q.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01


def test_attention_rows_rejects_bad_indices() -> None:
    k = torch.zeros(8, 1, 16)
    q, out = torch.zeros(2, 1, 16), torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="slot out of range"):
        attention_rows.attention_rows(q, k, k, torch.tensor([0]), torch.tensor([[0, 1]]), torch.tensor([8]), 1.0, out)
    with pytest.raises(RuntimeError, match="out of range or sees no position"):
        attention_rows.attention_rows(q, k, k, torch.tensor([2]), torch.tensor([[0, 1]]), torch.tensor([0]), 1.0, out)
    with pytest.raises(RuntimeError, match="out of range or sees no position"):
        attention_rows.attention_rows(q, k, k, torch.tensor([0]), torch.tensor([[0, 0]]), torch.tensor([0]), 1.0, out)
    with pytest.raises(RuntimeError, match="out of range or sees no position"):  # a span past the slot list
        attention_rows.attention_rows(q, k, k, torch.tensor([0]), torch.tensor([[0, 2]]), torch.tensor([0]), 1.0, out)
    with pytest.raises(RuntimeError, match="spans"):  # the old cumulative-offsets form
        attention_rows.attention_rows(q, k, k, torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0]), 1.0, out)


def test_attention_rows_causal_rows_share_one_slot_list() -> None:
    """A prompt's causal rows see growing prefixes of one slot list (overlapping spans, as kernel_rows builds
    them): each row equals the same row attended over its own copied list, bit for bit."""
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(64, 3, 64, generator=g), torch.randn(64, 3, 64, generator=g)
    slots = torch.randperm(64, generator=g)[:40]
    q = torch.randn(9, 9, 64, generator=g)
    ends = torch.arange(32, 41)  # rows see positions 0 .. 31 + r
    shared = torch.empty_like(q)
    attention_rows.attention_rows(q, k_cache, v_cache, torch.arange(9), torch.stack([torch.zeros_like(ends), ends], 1),
                              slots, 0.125, shared)  # fmt: skip
    copies = torch.cat([slots[:e] for e in ends.tolist()])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends.cumsum(0)[:-1]])
    separate = torch.empty_like(q)
    attention_rows.attention_rows(q, k_cache, v_cache, torch.arange(9), torch.stack([starts, starts + ends], 1), copies,
                              0.125, separate)  # fmt: skip
    assert torch.equal(shared, separate)
    torch.testing.assert_close(shared[3], _reference(q[3], k_cache, v_cache, slots[:35], 0.125, 3), rtol=1e-5,
                               atol=2e-6)


# whole rows; whole, then chunked; across 512; chunked (the first two in neighbouring pairs, the last two fused)
@pytest.mark.parametrize("first,last,cache", [(1, 200, "float32"), (1, 600, "float32"), (470, 560, "float32"),
                                              (1000, 1060, "float32"), (1, 600, "int8"), (1000, 1060, "int8")])
def test_a_long_prompts_causal_rows_each_match_the_row_alone(first: int, last: int, cache: str) -> None:
    """A prompt's rows, dealt to the threads first and last alternately (neighbours two by two where they chunk
    alike), some past 512 positions (chunked, and fused where most of their keys are shared): every row is the bits
    it gets alone, and SDPA's values."""
    g = torch.Generator().manual_seed(first)
    kernel, k_cache, v_cache, k_ref, v_ref = _cache_pair(cache, 1200, 3, 64, g)
    slots = torch.randperm(1200, generator=g)[:last]
    ends = torch.arange(first, last + 1)
    q = torch.randn(len(ends), 9, 64, generator=g)
    out = torch.empty_like(q)
    kernel(q, k_cache, v_cache, torch.arange(len(ends)), torch.stack([torch.zeros_like(ends), ends], 1), slots, 0.125,
           out)
    for r in range(0, len(ends), 7):
        alone = torch.empty_like(q)
        kernel(q, k_cache, v_cache, torch.tensor([r]), torch.tensor([[0, int(ends[r])]]), slots, 0.125, alone)
        assert torch.equal(alone[r], out[r]), r
    for r in (0, len(ends) // 2, len(ends) - 1):
        torch.testing.assert_close(out[r], _reference(q[r], k_ref, v_ref, slots[: int(ends[r])], 0.125, 3), rtol=1e-5,
                                   atol=2e-6)


def test_rope_and_silu_mul_match_torch() -> None:
    from leapdecode.layers.rotary import RotaryEmbedding, rotate

    g = torch.Generator().manual_seed(7)
    t, heads, d = 5, 4, 32
    rope = RotaryEmbedding(d, 256, 10000.0, None).table(torch.tensor([0, 3, 17, 100, 255]), torch.float32)
    qkv = torch.randn(t, (heads + 2) * d, generator=g)
    want = rotate(qkv[:, : heads * d].view(t, heads, d), rope)
    got = qkv.clone()
    layer_ops.rope_(got, rope[0].view(t, d), rope[1].view(t, d), heads)
    torch.testing.assert_close(got[:, : heads * d].view(t, heads, d), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[:, heads * d :], qkv[:, heads * d :])  # the V part is left alone
    t = 100  # a prompt's rows, on every thread: each row as it is alone
    rope = RotaryEmbedding(d, 256, 10000.0, None).table(torch.arange(t), torch.float32)
    qkv = torch.randn(t, (heads + 2) * d, generator=g)
    got = qkv.clone()
    layer_ops.rope_(got, rope[0].view(t, d), rope[1].view(t, d), heads)
    for i in (0, 37, 99):
        alone = qkv[i : i + 1].clone()
        layer_ops.rope_(alone, rope[0].view(t, d)[i : i + 1], rope[1].view(t, d)[i : i + 1], heads)
        assert torch.equal(alone, got[i : i + 1]), i
    for width in (64, 40):  # whole vectors, and a scalar tail
        gu = torch.randn(3, 2 * width, generator=g) * 4
        gate, up = gu.split(width, dim=-1)
        out = layer_ops.silu_mul(gu)
        torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
        assert torch.equal(layer_ops.silu_mul(gu[1:2]), out[1:2])
    gu = torch.randn(100, 2 * 64, generator=g) * 4  # a prompt's rows, on every thread: each row as it is alone
    out = layer_ops.silu_mul(gu)
    assert torch.equal(out, torch.cat([layer_ops.silu_mul(gu[i : i + 1]) for i in range(100)]))


@pytest.mark.parametrize("d", [64, 128, 24])  # 24: not whole vectors, one row at a time
def test_rotate_rows_matches_the_torch_basis_change(d: int) -> None:
    """The int8 cache's query / output basis changes in C++: (q * s) @ R per KV-head group, and o @ R^T; each
    (row, head) the same bits whichever heads share its group of four (9 heads: 4 + 4 + 1 alone, across rows in
    a batch)."""
    from leapdecode.layers.kv_quant import rotation_matrix

    g = torch.Generator().manual_seed(9)
    q = torch.randn(5, 9, d, generator=g)
    s = torch.rand(3, d, generator=g) + 0.5
    r = rotation_matrix(d)
    want = (q.view(5, 3, 3, d) * s.unsqueeze(1)).view(5, 9, d) @ r
    torch.testing.assert_close(int8_kv.rotate_rows(q, s, r, transpose=False), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(int8_kv.rotate_rows(q, None, r, transpose=True), q @ r.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(int8_kv.rotate_rows(q, None, None, transpose=False), q)
    alone = torch.cat([int8_kv.rotate_rows(q[i : i + 1], s, r, transpose=False) for i in range(5)])
    assert torch.equal(alone, int8_kv.rotate_rows(q, s, r, transpose=False))  # rows do not depend on each other


@pytest.mark.parametrize("rows,vocab,k", [(1, 49152, 8), (5, 1000, 3), (3, 37, 37), (2, 20, 1)])
def test_row_top_k_matches_topk_and_logsumexp(rows: int, vocab: int, k: int) -> None:
    """The drafters' per-row summary (layer_ops.cpp): torch's top-k values and logsumexp, ties in index order,
    and no row depends on the others (a whole vector loop plus a scalar tail: vocab 37 and 20)."""
    g = torch.Generator().manual_seed(rows * vocab + k)
    logits = torch.randn(rows, vocab, generator=g) * 6
    vals, idx, lse = layer_ops.row_top_k(logits, k)
    want_vals, _ = logits.topk(k, dim=-1)
    assert torch.equal(vals, want_vals)
    assert torch.equal(logits.gather(1, idx), vals)
    torch.testing.assert_close(lse, logits.logsumexp(dim=-1), rtol=1e-6, atol=1e-5)
    for r in range(rows):
        one = layer_ops.row_top_k(logits[r : r + 1], k)
        assert torch.equal(one[0], vals[r : r + 1]) and torch.equal(one[1], idx[r : r + 1])
        assert torch.equal(one[2], lse[r : r + 1])
    tied = torch.zeros(1, 40)
    tied[0, [3, 17, 30]] = 2.0
    assert layer_ops.row_top_k(tied, 5)[1].tolist() == [[3, 17, 30, 0, 1]]  # equal values: lower index first
    masked = torch.full((1, 50), float("-inf"))
    masked[0, 9] = 1.5
    v, i, s = layer_ops.row_top_k(masked, 2)
    assert i[0, 0] == 9 and v[0, 0] == 1.5 and v[0, 1] == float("-inf") and float(s[0]) == pytest.approx(1.5)


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 37), (17, 1000), (2, 5)])
def test_row_argmax_is_torchs_argmax(rows: int, vocab: int) -> None:
    """The greedy token of each row (layer_ops.cpp): torch's argmax, ties to the first, NaN first where there is
    one, in the vector loop and in its scalar tail."""
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g) * 6
    assert layer_ops.row_argmax(logits) == logits.argmax(dim=-1).tolist()
    tied = torch.zeros(rows, vocab)
    tied[:, [vocab // 3, vocab // 2, vocab - 1]] = 2.0  # equal maxima in different lanes and in the tail
    assert layer_ops.row_argmax(tied) == tied.argmax(dim=-1).tolist() == [vocab // 3] * rows
    odd = torch.full((rows, vocab), float("-inf"))
    assert layer_ops.row_argmax(odd) == odd.argmax(dim=-1).tolist() == [0] * rows
    odd[0, vocab - 1] = float("nan")
    odd[-1, min(vocab - 1, 20)] = float("nan")
    assert layer_ops.row_argmax(odd) == odd.argmax(dim=-1).tolist()
    big = torch.zeros(1, vocab)
    big[0, 0] = 1.0  # the maximum at index 0, which every lane starts from
    assert layer_ops.row_argmax(big) == [0]


def test_record_successors_writes_each_rows_top_k_in_order() -> None:
    """Token Recycling's matrix update (layer_ops.cpp): each row's top-k ids and softmax probabilities into the
    matrix row of its input token, rows in order (a repeated token keeps its last row), out-of-range tokens
    skipped; the same as torch's topk / logsumexp."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g) * 4
    tokens = [7, 2, 7, -1, 40]
    ids = torch.full((40, 4), -1, dtype=torch.int32)
    probs = torch.zeros(40, 4, dtype=torch.float16)
    layer_ops.record_successors(logits, tokens, ids, probs)
    vals, idx = logits.topk(4, dim=-1)
    want = (vals - logits.logsumexp(dim=-1, keepdim=True)).exp()
    assert ids[7].tolist() == idx[2].tolist() and ids[2].tolist() == idx[1].tolist()
    torch.testing.assert_close(probs[7].float(), want[2].half().float(), rtol=1e-3, atol=1e-4)
    untouched = [r for r in range(40) if r not in (2, 7)]
    assert (ids[untouched] == -1).all() and (probs[untouched] == 0).all()  # -1 and 40 are outside the rows
