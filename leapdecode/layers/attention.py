"""Attention over the paged KV cache.

Every forward pass works on a *flat* batch of T new tokens (varlen, like vLLM): prefill chunks, decode tokens,
draft chains and candidate trees of many sequences laid end to end. Attention for one layer is two moves:

1. write the new K/V rows into the cache slots named by ``slot_mapping`` (slot = block_id * block_size + offset);
2. for each *group* of sequences, read their K/V back by slot and run one ``scaled_dot_product_attention``.

Groups are planned once per step by :func:`build_attention_metadata` and reused by all layers:
- sequences with few new tokens (decode, verification of drafts or trees) share one padded call; with grouped-query
  attention the query heads that share a KV head are folded into the query axis, so K/V are never repeated;
- a long prefill chunk gets its own call (it is compute-bound; padding it with others would waste work);
- a sequence whose slots are one contiguous run reads the cache through a view instead of a gather.

Masks are boolean (True = may attend). A new token at absolute position p may see every cached position <= p
(with a sliding window w: the positions p - w + 1 .. p, and the cache before the earliest window is not read);
a candidate tree (Medusa, hybrid) replaces the causal rule among the new tokens with its ancestor mask; a tree
grown over several passes (the feature draft's dynamic tree) extends that mask over its nodes already cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from leapdecode.layers import attention_rows, int8_kv, split_kv, triton_attention
from leapdecode.layers.kv_quant import KVPlane, QuantizedKV, read_kv_range, read_kv_slots, write_kv

# New-token count up to which sequences are batched into one padded attention call.
SMALL_QUERY = 16
# float caches the C++ rows kernel reads (kernels/attention_rows.cpp; a half cache's rows widened to float32)
ROWS_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class SeqAttention:
    """What attention needs to know about one sequence in the flat batch."""

    q_start: int  # first row of this sequence in the flat batch
    q_len: int  # new tokens this step; they occupy cache positions ctx_len - q_len .. ctx_len - 1
    ctx_len: int  # cached + new positions
    block_table: list[int]
    block_size: int
    # [q_len, m] bool, m >= q_len: what each new token may see of the last m positions (m - q_len earlier
    # tree nodes already in the cache, then the new tokens); None = causal
    tree_mask: torch.Tensor | None = None
    # the new tokens' positions in the text (a tree's nodes sit at their depth); None = their cache positions
    positions: torch.Tensor | None = None
    # sliding window: a token sees the positions p - window + 1 .. p of the text; None = everything before it
    window: int | None = None
    _slots: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def slots(self) -> torch.Tensor:
        """Cache slot of every position 0 .. ctx_len-1. Built once: a step asks for it three times (the K/V
        write mapping, the padded groups, the C++ rows kernel), and the block table does not change within it."""
        if self._slots is None:
            table = torch.tensor(self.block_table, dtype=torch.long).unsqueeze(1)
            self._slots = (table * self.block_size + torch.arange(self.block_size)).view(-1)[: self.ctx_len]
        return self._slots

    def row_positions(self) -> torch.Tensor:
        """[q_len] the new tokens' positions in the text."""
        if self.positions is not None:
            return self.positions
        return torch.arange(self.ctx_len - self.q_len, self.ctx_len)

    def first(self) -> int:
        """The first cache position any new token may see: 0, or where the earliest row's window begins (the
        positions before it are never read). A tree's nodes stay visible whatever the window."""
        if self.window is None:
            return 0
        tree = self.q_len if self.tree_mask is None else self.tree_mask.shape[1]
        start = int(self.row_positions().min()) - self.window + 1
        return max(0, min(start, self.ctx_len - tree))

    def kv_len(self) -> int:
        """Positions read: first() .. ctx_len - 1."""
        return self.ctx_len - self.first()

    def kv_slots(self) -> torch.Tensor:
        """Cache slots of the positions read, first() .. ctx_len - 1."""
        return self.slots()[self.first():]

    def contiguous_start(self) -> int | None:
        """First slot when the positions read occupy one run of slots (read through a view)."""
        first = self.first()
        t = self.block_table[first // self.block_size : -(-self.ctx_len // self.block_size)]
        if t[-1] - t[0] == len(t) - 1 and all(b - a == 1 for a, b in zip(t, t[1:])):
            return t[0] * self.block_size + first % self.block_size
        return None


@dataclass
class AttentionGroup:
    batch: int
    q_len: int
    kv_len: int
    q_start: int | None = None  # batch == 1: rows q_start .. q_start+q_len
    q_rows: torch.Tensor | None = None  # [batch*q_len] flat rows (padding repeats a valid row)
    q_valid: torch.Tensor | None = None  # [batch*q_len] bool
    kv_start: int | None = None  # batch == 1 and contiguous slots
    kv_slots: torch.Tensor | None = None  # [batch*kv_len]
    mask: torch.Tensor | None = None  # [batch, 1, q_len(*group), kv_len] bool; None = all visible
    causal: bool = False  # plain causal self-attention (q_len == kv_len, no cache)
    fold: bool = False  # fold GQA query groups into the query axis
    split: split_kv.SplitPlan | None = None  # long context, few rows: attend chunk by chunk (split_kv.py)
    seqs: list[SeqAttention] | None = None  # few-row groups: their sequences (for the C++ rows kernel)
    # a few-row group's q_rows, q_valid, kv_start, kv_slots and mask wait for :meth:`fill` (device, GQA group
    # size): a CPU step whose rows all go through the C++ rows kernel never reads them, and building them cost ~1
    # ms of a 16-sequence decode step (a padded group), ~40 us of a one-sequence tree step
    _unfilled: tuple[torch.device, int] | None = field(default=None, repr=False, compare=False)

    def fill(self) -> AttentionGroup:
        """Build a padded group's row indices, slots and mask if they are not built yet; returns the group."""
        if self._unfilled is not None:
            device, group_size = self._unfilled
            self._unfilled = None
            if self.q_start is not None:
                assert self.seqs is not None
                _fill_single(self, self.seqs[0], device, group_size)
            else:
                _fill_padded(self, device, group_size)
        return self


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    groups: list[AttentionGroup]
    num_tokens: int
    _rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the same step as seen by layers with a sliding window, by window size (built with the step)
    windowed: dict[int, AttentionMetadata] = field(default_factory=dict)
    _triton: triton_attention.RowBatch | None = None

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The step as a layer with this sliding window (None: global attention) sees it."""
        if window is None:
            return self
        if window not in self.windowed:
            raise ValueError(f"the step was planned without sliding window {window} (has {sorted(self.windowed)})")
        return self.windowed[window]

    def triton_rows(self, device: torch.device) -> triton_attention.RowBatch | None:
        """The few-row groups' sequences (split or not) packed for one Triton launch (layers/triton_attention.py);
        built on first use in a step, then reused by every layer. None for a sliding-window plan: the Triton kernel
        reads every position, so those layers take the windowed torch path."""
        if self._triton is None:
            seqs = [s for g in self.groups if g.seqs is not None for s in g.seqs]
            if not seqs or any(s.window is not None for s in seqs):
                return None
            self._triton = triton_attention.RowBatch.from_seqs(seqs, device)
        return self._triton

    def all_kernel_rows(self) -> bool:
        """Every row of the step is a few-token row the C++ rows kernel attends (no prefill chunk, no split)."""
        rows = self.kernel_rows()
        return rows is not None and rows[0].numel() == self.num_tokens

    def kernel_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For the C++ rows kernel (kernels/attention_rows.cpp): every row of the few-row groups not split by
        split_kv, as (rows [R], spans [R, 2], slots): row ``rows[r]`` sees ``slots[spans[r, 0]:spans[r, 1]]``,
        its visible positions in order. Causal rows of one sequence share its slot list (row i sees a prefix of
        it), so a prompt costs O(length) here, not O(length^2); tree rows list their visible slots each. Built
        on first use in a step, then reused by every layer."""
        if self._rows is None:
            seqs = [s for g in self.groups if g.seqs is not None and g.split is None for s in g.seqs]
            if not seqs:
                return None
            if all(s.tree_mask is None and s.window is None for s in seqs):
                self._rows = _causal_rows(seqs)
            else:
                self._rows = _listed_rows(seqs)
        return self._rows


def _causal_rows(seqs: list[SeqAttention]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernel_rows of causal rows with no window (decode tokens, draft chains, prompts): every sequence's slots
    0 .. ctx_len - 1 once, and row i of a sequence sees a prefix of them; built from Python ints and one gather of
    the block tables, not a few tensor calls per sequence (a 16-sequence decode step made ~100 of them)."""
    rows: list[int] = []
    spans: list[int] = []
    blocks: list[int] = []
    base = 0
    for s in seqs:
        n_blocks = -(-s.ctx_len // s.block_size)
        blocks += s.block_table[:n_blocks]
        rows += range(s.q_start, s.q_start + s.q_len)
        for end in range(s.ctx_len - s.q_len + 1, s.ctx_len + 1):
            spans += (base, base + end)
        base += n_blocks * s.block_size  # the last block's unused tail is never inside a span
    bs = seqs[0].block_size
    if any(s.block_size != bs for s in seqs):
        raise ValueError("kernel rows of one step need one block size")
    slots = (torch.tensor(blocks, dtype=torch.long).unsqueeze(1) * bs + torch.arange(bs)).view(-1)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(spans, dtype=torch.long).view(-1, 2), slots


def _listed_rows(seqs: list[SeqAttention]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernel_rows of any mix of causal, windowed and tree rows: each tree row lists its own visible slots. In
    numpy: the same arrays through torch's calls (a few microseconds each) took ~0.2 ms of every tree step."""
    rows, spans, slots = [], [], []
    base = 0
    for s in seqs:
        seq_slots, first = s.kv_slots().cpu().numpy(), s.first()
        rows.append(np.arange(s.q_start, s.q_start + s.q_len, dtype=np.int64))
        if s.tree_mask is None:  # row i sees positions (window start) .. ctx_len - q_len + i
            ends = np.arange(s.ctx_len - s.q_len + 1, s.ctx_len + 1, dtype=np.int64) - first
            starts = np.zeros_like(ends)
            if s.window is not None:
                starts = np.maximum(s.row_positions().cpu().numpy() - s.window + 1 - first, 0)
            spans.append(np.stack([starts + base, ends + base], axis=1))
            slots.append(seq_slots)
            base += len(seq_slots)
        else:
            vis = _visible_np(s)  # [q_len, kv_len]: row-major = each row's positions in order
            ends = vis.sum(1).cumsum() + base
            spans.append(np.stack([np.concatenate(([base], ends[:-1])), ends], axis=1))
            slots.append(np.broadcast_to(seq_slots, vis.shape)[vis])
            base = int(ends[-1])
    return torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(spans)), \
        torch.from_numpy(np.concatenate(slots))


def _visible_np(seq: SeqAttention) -> np.ndarray:
    """[q_len, kv_len] bool: which of the positions read (first() .. ctx_len - 1) each new token may attend to."""
    ctx, q, first = seq.ctx_len, seq.q_len, seq.first()
    cols = np.arange(first, ctx)[None, :]
    vis = cols <= np.arange(ctx - q, ctx)[:, None]
    if seq.window is not None:  # positions before the window; a tree's nodes are masked by the tree alone
        vis &= cols > (seq.row_positions().cpu().numpy() - seq.window)[:, None]
    if seq.tree_mask is not None:
        vis[:, vis.shape[1] - seq.tree_mask.shape[1] :] = seq.tree_mask.cpu().numpy()
    return vis


def _visible(seq: SeqAttention) -> torch.Tensor:
    """_visible_np as a tensor (the masks of torch's attention calls)."""
    return torch.from_numpy(_visible_np(seq))


def build_attention_metadata(
    seqs: list[SeqAttention], slot_mapping: torch.Tensor, group_size: int, device: torch.device,
    small_query: int | None = SMALL_QUERY, windows: Sequence[int] = (),
) -> AttentionMetadata:
    """``small_query``: sequences with at most this many new tokens join the few-row groups (the C++ rows kernel
    on a CPU); ``None`` puts every sequence there, prompts included, so that a prompt token's attention is
    computed exactly as it would be for a decoded token (needed where rounding is coarse: int8 activations).
    ``windows``: the model's sliding windows; the step is also planned as each of them sees it
    (:meth:`AttentionMetadata.for_window`), reading only the positions inside the window."""
    meta = _plan_groups(seqs, slot_mapping, group_size, device, small_query)
    for w in windows:
        windowed = [replace(s, window=w) for s in seqs]
        meta.windowed[w] = _plan_groups(windowed, slot_mapping, group_size, device, small_query)
    return meta


def _plan_groups(seqs: list[SeqAttention], slot_mapping: torch.Tensor, group_size: int, device: torch.device,
                 small_query: int | None) -> AttentionMetadata:
    limit = small_query if small_query is not None else max((s.q_len for s in seqs), default=0)
    small = [s for s in seqs if s.q_len <= limit]
    large = [s for s in seqs if s.q_len > limit]
    groups: list[AttentionGroup] = []
    for s in large:
        groups.append(_single_group(s, device, fold=False))
    # plain decode rows and draft/tree verification rows go in separate padded calls: mixed, every decoding
    # sequence would be padded to the longest draft's query length
    for part in ([s for s in small if s.q_len == 1], [s for s in small if s.q_len > 1]):
        if not part:
            continue
        if len(part) == 1:
            groups.append(_few_row_group(part[0], device, group_size))
        else:
            groups.append(_padded_group(part, device, group_size))
        groups[-1].seqs = part
        g = groups[-1]
        if split_kv.use_split(g.fold, g.batch, g.kv_len):  # few rows over a long context (see split_kv.py)
            g.fill()
            g.split = split_kv.plan_split(g.batch, g.kv_len, g.mask, g.kv_slots, part[0].block_size)
    total = sum(s.q_len for s in seqs)
    return AttentionMetadata(slot_mapping=slot_mapping, groups=groups, num_tokens=total)


def _fold_mask(mask: torch.Tensor, group_size: int) -> torch.Tensor:
    b, _, q, k = mask.shape
    return mask.unsqueeze(2).expand(b, 1, group_size, q, k).reshape(b, 1, group_size * q, k)


def _single_group(s: SeqAttention, device: torch.device, fold: bool, group_size: int = 1) -> AttentionGroup:
    g = AttentionGroup(batch=1, q_len=s.q_len, kv_len=s.kv_len(), q_start=s.q_start, fold=fold)
    _fill_single(g, s, device, group_size)
    return g


def _few_row_group(s: SeqAttention, device: torch.device, group_size: int) -> AttentionGroup:
    """One sequence's few rows (decode, drafts, a tree); its tensors are built by :meth:`AttentionGroup.fill`."""
    return AttentionGroup(batch=1, q_len=s.q_len, kv_len=s.kv_len(), q_start=s.q_start, fold=True,
                          _unfilled=(device, group_size))


def _fill_single(g: AttentionGroup, s: SeqAttention, device: torch.device, group_size: int) -> None:
    g.kv_start = s.contiguous_start()
    if g.kv_start is None:
        g.kv_slots = s.kv_slots().to(device)
    if s.tree_mask is None and s.q_len == 1:
        return  # a single new token sees every position read (its window, if any): no mask
    if s.tree_mask is None and s.q_len == s.ctx_len and not g.fold and (s.window is None or s.window >= s.ctx_len):
        g.causal = True
        return
    mask = _visible(s).view(1, 1, s.q_len, g.kv_len)
    g.mask = (_fold_mask(mask, group_size) if g.fold else mask).to(device)


def _padded_group(seqs: list[SeqAttention], device: torch.device, group_size: int) -> AttentionGroup:
    """A padded call over few-row sequences; its tensors are built by :meth:`AttentionGroup.fill` when needed."""
    return AttentionGroup(batch=len(seqs), q_len=max(s.q_len for s in seqs), kv_len=max(s.kv_len() for s in seqs),
                          fold=True, seqs=seqs, _unfilled=(device, group_size))


def _fill_padded(g: AttentionGroup, device: torch.device, group_size: int) -> None:
    assert g.seqs is not None
    b, q_len, kv_len = g.batch, g.q_len, g.kv_len
    q_rows = torch.zeros(b, q_len, dtype=torch.long)
    q_valid = torch.zeros(b, q_len, dtype=torch.bool)
    kv_slots = torch.zeros(b, kv_len, dtype=torch.long)
    mask = torch.zeros(b, 1, q_len, kv_len, dtype=torch.bool)
    for i, s in enumerate(g.seqs):
        q_rows[i, : s.q_len] = torch.arange(s.q_start, s.q_start + s.q_len)
        q_rows[i, s.q_len :] = s.q_start  # padding re-reads a valid row; its output is dropped
        q_valid[i, : s.q_len] = True
        kv_slots[i, : s.kv_len()] = s.kv_slots()
        mask[i, 0, : s.q_len, : s.kv_len()] = _visible(s)
        mask[i, 0, s.q_len :, 0] = True  # padded rows see one key so softmax stays finite
    g.q_rows = q_rows.view(-1).to(device)
    g.q_valid = q_valid.view(-1).to(device)
    g.kv_slots = kv_slots.view(-1).to(device)
    g.mask = _fold_mask(mask, group_size).to(device)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVPlane,
    v_cache: KVPlane,
    meta: AttentionMetadata,
    scale: float,
    use_kernel: bool = False,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_slots, Hkv, D] tensors or int8 planes (kv_quant.py).
    ``use_kernel``: over a float32 or int8 CPU cache, the rows of few-token groups (decode tokens, drafts, tree
    nodes) attend in one C++ call, each row on its own (kernels/attention_rows.cpp), so a token's result does not
    depend on the batch or on being verified among drafts. Returns [T, H, D]."""
    if isinstance(k_cache, QuantizedKV) and isinstance(v_cache, QuantizedKV):
        # an int8 cache stores keys as ((k - mu) / s) R and values as v R (kv_quant.py): attend in that basis
        o = _paged_attention(k_cache.query_to_cache_basis(q), k, v, k_cache, v_cache, meta, scale, use_kernel)
        return v_cache.unrotate(o)
    return _paged_attention(q, k, v, k_cache, v_cache, meta, scale, use_kernel)


def _group_attention(q: torch.Tensor, g: AttentionGroup, k_cache: KVPlane, v_cache: KVPlane, scale: float,
                     hkv: int) -> torch.Tensor:
    """One group's attention through torch ([batch, q_len, heads, d]): its queries and K/V gathered from the
    cache, then SDPA (or split-KV for long reads)."""
    heads, d = q.shape[1], q.shape[2]
    group = heads // hkv
    g.fill()
    if g.q_start is not None:
        qg = q[g.q_start : g.q_start + g.q_len].unsqueeze(0)
    else:
        qg = q.index_select(0, g.q_rows).view(g.batch, g.q_len, heads, d)
    if g.split is not None and g.split.chunked_read:
        kg = vg = None  # split_kv reads the cache chunk by chunk
    elif g.kv_start is not None:
        kg = read_kv_range(k_cache, g.kv_start, g.kv_len, q.dtype).unsqueeze(0)
        vg = read_kv_range(v_cache, g.kv_start, g.kv_len, q.dtype).unsqueeze(0)
    else:
        kg = read_kv_slots(k_cache, g.kv_slots, q.dtype).view(g.batch, g.kv_len, hkv, d)
        vg = read_kv_slots(v_cache, g.kv_slots, q.dtype).view(g.batch, g.kv_len, hkv, d)
    if kg is not None:
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)  # [B, Hkv, K, D]
    if g.fold:
        # [B, Q, Hkv, G, D] -> [B, Hkv, G*Q, D]: query heads sharing a KV head become extra query rows
        qf = qg.view(g.batch, g.q_len, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(
            g.batch, hkv, group * g.q_len, d
        )
        if g.split is not None:
            o = split_kv.split_attention(qf, kg, vg, k_cache, v_cache, g.split, scale)
        else:
            o = F.scaled_dot_product_attention(qf, kg, vg, attn_mask=g.mask, scale=scale)
        o = o.view(g.batch, hkv, group, g.q_len, d).permute(0, 3, 1, 2, 4).reshape(g.batch, g.q_len, heads, d)
    else:
        if group > 1:
            kg = kg.repeat_interleave(group, dim=1)
            vg = vg.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg, vg, attn_mask=g.mask, is_causal=g.causal, scale=scale
        ).transpose(1, 2)
    return o


def _paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVPlane,
    v_cache: KVPlane,
    meta: AttentionMetadata,
    scale: float,
    use_kernel: bool = False,
) -> torch.Tensor:
    heads, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    groups = meta.groups
    kernel_rows = None
    float_rows = (isinstance(k_cache, torch.Tensor) and k_cache.dtype in ROWS_KERNEL_DTYPES
                  and q.dtype == torch.float32 and k_cache.device.type == "cpu")  # fmt: skip
    int8_rows = (isinstance(k_cache, QuantizedKV) and isinstance(v_cache, QuantizedKV) and q.dtype == torch.float32
                 and int8_kv.int8_kv_kernels(k_cache))  # fmt: skip
    if use_kernel and (float_rows or int8_rows):
        # few-row groups (decode, drafts, trees) in one C++ call, each row alone: bit-identical across batchings
        kernel_rows = meta.kernel_rows()
    triton_rows = meta.triton_rows(q.device) if kernel_rows is None and triton_attention.applies(q, k_cache) else None
    # (a float16 or bfloat16 cache under float32 queries takes the general path, which converts what it reads)
    one_token = (q.shape[0] == 1 and isinstance(k_cache, torch.Tensor) and k_cache.dtype == q.dtype
                 and groups[0].split is None)  # fmt: skip
    if kernel_rows is None and triton_rows is None and one_token:
        return _decode_one(q, k, v, k_cache, v_cache, meta, scale)
    write_kv(k_cache, meta.slot_mapping, k)
    write_kv(v_cache, meta.slot_mapping, v)
    if kernel_rows is not None:
        out = torch.empty_like(q)
        if int8_rows:  # reads the int8 rows themselves: ~3.6x fewer bytes than a float32 cache
            attention_rows.attention_rows_i8(q.contiguous(), k_cache, v_cache, *kernel_rows, scale, out)
        else:
            attention_rows.attention_rows(q.contiguous(), k_cache, v_cache, *kernel_rows, scale, out)
        groups = [g for g in groups if g.seqs is None or g.split is not None]
    elif triton_rows is not None:  # few-row groups in one launch over the block tables (split-KV inside)
        out = torch.empty_like(q)
        triton_attention.paged_decode_attention(q, k_cache, v_cache, triton_rows, scale, out)
        groups = [g for g in groups if g.seqs is None]
    elif len(groups) == 1 and groups[0].q_start == 0 and groups[0].q_len == q.shape[0]:
        out = None  # the single group covers the whole batch: write straight into its result
    else:
        out = torch.empty_like(q)
    for g in groups:
        o = _group_attention(q, g, k_cache, v_cache, scale, hkv)
        if out is None:
            return o.reshape(g.q_len, heads, d)
        if g.q_start is not None:
            out[g.q_start : g.q_start + g.q_len] = o[0]
        else:
            flat = o.reshape(g.batch * g.q_len, heads, d)
            out[g.q_rows[g.q_valid]] = flat[g.q_valid]
    return out


def _decode_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The batch-1 decode step (one new token, float cache), the case that sets single-stream latency: the same
    computation as the general loop with a third of its tensor calls, since at this size each call costs more than
    its arithmetic. q: [1, H, D] -> [1, H, D]."""
    g = meta.groups[0].fill()
    hkv, d = k.shape[1], k.shape[2]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if g.kv_start is not None:
        kg, vg = k_cache[g.kv_start : g.kv_start + g.kv_len], v_cache[g.kv_start : g.kv_start + g.kv_len]
    else:
        kg, vg = k_cache.index_select(0, g.kv_slots), v_cache.index_select(0, g.kv_slots)
    # one token: its H query heads, grouped by the KV head they share, are the G query rows of each KV head
    o = F.scaled_dot_product_attention(
        q.view(1, hkv, -1, d), kg.transpose(0, 1).unsqueeze(0), vg.transpose(0, 1).unsqueeze(0), scale=scale
    )
    return o.view(1, -1, d)
