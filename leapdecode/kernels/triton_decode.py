"""Triton kernels: attention of few-token rows over the paged KV cache (decode, drafts, candidate trees).

Importing this module needs ``triton``; :mod:`leapdecode.layers.triton_attention` guards the import and launches
the kernels. On a GPU they compile for it; with ``TRITON_INTERPRET=1`` (set before this module is imported) they
run through Triton's interpreter on CPU tensors, which is how the test suite checks them without a GPU.

One program attends one sequence, one KV head and one block of ``BLOCK_M`` query rows, where a *row* is one
(new token, query head of that KV head's group) pair: grouped-query heads are folded into the row axis, so the
KV head's keys and values are read once for all its query heads. The program walks the sequence's positions
``BLOCK_N`` at a time and finds each position's slot through the block table itself
(``slot = block_table[pos // block_size] * block_size + pos % block_size``): no gathered copy of the context is
ever made. Scores use the online softmax in base 2 (the scale carries ``log2 e``), accumulated in float32.

Visibility of cache position ``p`` to new token ``i`` of a sequence with ``ctx`` positions and ``q_len`` new
tokens: causal rows see ``p <= ctx - q_len + i``; tree rows (``tree_len = m > 0``) see every position before the
last ``m`` and, among those ``m``, what their row of the tree mask allows. A sliding window ``w > 0`` further
hides ``p <= ctx - q_len + i - w`` (causal rows only: the launcher refuses a window with a tree).

Split-KV (FlashDecoding): with ``SPLIT`` the positions are cut into ``num_splits`` chunks, one program each,
which stores its normalised partial output and its log-sum-exp; :func:`merge_splits_kernel` combines them.
Without ``SPLIT`` the program stores the final output directly.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kv_tile(ptr, scale_ptr, slot, kv_head, stride_n, stride_h, stride_sn, stride_sh, offs_d, mask,
             SCALE_GROUP: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_D] cache rows at ``slot`` of one KV head; an int8 plane's rows times their group scales."""
    x = tl.load(ptr + slot[:, None] * stride_n + kv_head * stride_h + offs_d[None, :], mask=mask, other=0)
    if QUANT:
        s_off = slot[:, None] * stride_sn + kv_head * stride_sh + (offs_d // SCALE_GROUP)[None, :]
        x = x.to(tl.float32) * tl.load(scale_ptr + s_off, mask=mask, other=0).to(tl.float32)
    return x


@triton.jit
def _visible(offs_n, n_ok, q_row, q_pos, row_ok, tree_start, tree_len, window, tree_ptr, stride_mq,
             HAS_TREE: tl.constexpr):  # fmt: skip
    """[BLOCK_M, BLOCK_N] bool: which of the tile's positions each row may attend (the module docstring's rule);
    ``tree_ptr`` points at this sequence's mask rows."""
    vis = row_ok[:, None] & n_ok[None, :]
    causal = offs_n[None, :] <= q_pos[:, None]
    if HAS_TREE:
        in_tree = offs_n[None, :] >= tree_start
        t_off = q_row[:, None] * stride_mq + (offs_n - tree_start)[None, :]
        allowed = tl.load(tree_ptr + t_off, mask=vis & in_tree & (tree_len > 0), other=0) != 0
        vis = vis & tl.where(tree_len > 0, tl.where(in_tree, allowed, True), causal)
    else:
        vis = vis & causal
    if window > 0:
        vis = vis & (offs_n[None, :] > q_pos[:, None] - window)
    return vis


@triton.jit
def paged_rows_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, lse_ptr,
    tables_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr, tree_ptr, tree_len_ptr,
    scale_log2, window, block_size, split_len,
    stride_qt, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_sn, stride_sh,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    stride_tb, stride_ms, stride_mq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, M_BLOCKS: tl.constexpr,
    SCALE_GROUP: tl.constexpr, QUANT: tl.constexpr, SPLIT: tl.constexpr, HAS_TREE: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // M_BLOCKS
    m_block = tl.program_id(1) % M_BLOCKS
    split = tl.program_id(2)

    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_len_ptr + seq)
    ctx = tl.load(ctx_len_ptr + seq)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_row = offs_m // GROUP  # which new token
    head = kv_head * GROUP + offs_m % GROUP  # which query head
    row_ok = q_row < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_off = (q_start + q_row)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:  # products in float32 (the interpreter cannot multiply bfloat16 matrices)
        q = q.to(tl.float32)
    q_pos = ctx - q_len + q_row  # each row's own cache position

    lo = ctx * 0
    if window > 0:  # no row sees anything at or before (first row's position - window)
        lo = tl.maximum(ctx - q_len - window + 1, 0)
    hi = ctx
    if SPLIT:
        lo = tl.maximum(lo, split * split_len)
        hi = tl.minimum(hi, (split + 1) * split_len)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.where(m_block * BLOCK_M < q_len * GROUP, hi, lo)  # a row block past this sequence's rows: no work
    tree_len = ctx * 0
    if HAS_TREE:
        tree_len = tl.load(tree_len_ptr + seq)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        block = tl.load(tables_ptr + seq * stride_tb + offs_n // block_size, mask=n_ok, other=0)
        slot = block.to(tl.int64) * block_size + offs_n % block_size
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _kv_tile(k_ptr, ks_ptr, slot, kv_head, stride_kn, stride_kh, stride_sn, stride_sh, offs_d, kv_mask,
                     SCALE_GROUP, QUANT)  # fmt: skip
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2
        vis = _visible(offs_n, n_ok, q_row, q_pos, row_ok, ctx - tree_len, tree_len, window,
                       tree_ptr + seq * stride_ms, stride_mq, HAS_TREE)  # fmt: skip
        scores = tl.where(vis, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_ptr, vs_ptr, slot, kv_head, stride_vn, stride_vh, stride_sn, stride_sh, offs_d, kv_mask,
                     SCALE_GROUP, QUANT)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    t = q_start + q_row
    o_off = t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:
        tl.store(out_ptr + o_off + split * stride_os, out, mask=row_ok[:, None] & d_ok[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + t * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    else:
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, rows_ptr, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One program per (listed row, query head): weight each split's partial output by its share of the
    softmax mass, ``2^(lse_s - max lse)``; splits that saw nothing carry ``lse = -inf``, weigh zero and their
    partial output is not read (a row no split wrote, a padding row, merges to zeros)."""
    t = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + t * stride_lt + head * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    seen = s_ok & (lse > float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw anything: every weight is zero
    w = tl.where(seen, tl.exp2(lse - top), 0.0)
    p_off = t * stride_pt + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    part = tl.load(part_ptr + p_off, mask=seen[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
