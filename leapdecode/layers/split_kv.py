"""Split-KV attention (FlashDecoding-style) for few query rows over a long cached context.

A decode step attends one (or a few) query rows per sequence to thousands of cached keys. Instead of one
attention call over the whole context, the context is cut into chunks; each chunk yields a partial output
``o_c`` (softmax-normalised within the chunk) and the log-sum-exp ``lse_c`` of its scores, and the partials
merge exactly::

    lse = logsumexp_c(lse_c)            out = sum_c exp(lse_c - lse) * o_c

which is the same softmax over all keys, reassociated (equal to plain attention up to float rounding).

Two ways to run the chunks, for two different costs of the plain path:

* **One sequence (batch 1): chunks in parallel.** The context (a view of the cache when its blocks are
  adjacent, else one gather, exactly as the plain path reads it) is reshaped -- without a copy -- into ``N``
  chunks that become the *batch* axis of a single attention call. The plain call has only ``kv_heads`` units
  of parallel work (3 for SmolLM2), which a GPU cannot fill and which even 2 CPU threads split unevenly;
  ``N x kv_heads`` units fill both. This is the FlashDecoding argument.
* **Many sequences (padded batch): chunks one after another.** The plain path gathers every sequence's whole
  K and V into one padded ``[B, max_len]`` buffer per layer. At 8 x 4k tokens that is ~25 MB per tensor,
  written and read back through DRAM on every layer (and freshly allocated each time). Gathering one chunk
  at a time keeps the buffers small and cache-resident; the batch already supplies the parallel work.

Where each pays on the 2-core development CPU was measured (``python -m leapdecode.eval.attention_bench``
and end to end; numbers beside the thresholds below). Short version: for one sequence it does not pay on this
CPU and is off by default; for a large padded batch it pays mainly by sidestepping an allocator cost.

:func:`plan_split` runs once per step (from ``build_attention_metadata``); the plan is reused by every layer.
:func:`split_attention` is the per-layer kernel; :func:`split_kv_attention` is the same algorithm on dense
tensors, the executable definition the tests compare against plain attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from leapdecode.layers.kv_quant import KVPlane, read_kv_slots

# Measured on the 2-core development CPU (SmolLM2 shape: 9 query / 3 KV heads x 64, float32). Per layer call,
# ``python -m leapdecode.eval.attention_bench`` (split / plain; the machine is shared, so +-10%):
#   one sequence, 2 threads (quiet machine): 2k 1.12, 6k 0.91; fragmented blocks: 2k 1.07, 6k 0.98
#   one sequence, 1 thread:                  2k 1.13, 6k 0.90; fragmented blocks: 2k 1.11, 6k 0.95
#   padded batch, 1 thread: 8 x 2k 1.01, 4 x 4k 0.93, 5 x 6k 0.78, 8 x 6k 0.35-0.40
# End to end (decode step of the engine, median): one sequence at 6k tokens, 2 threads 57 ms split vs 52 ms
# plain, 1 thread no difference (85-96 ms both); 5 sequences x 4k, 1 thread: 402 ms split vs 331 ms plain.
# And the large batched win is the allocator, not the algorithm: the plain path's per-layer gather buffer for
# 8 x 6k tokens is 37 MB, above glibc's largest mmap threshold (32 MB), so every layer maps fresh pages and
# faults them in. With MALLOC_MMAP_THRESHOLD_=4000000000 the same case is 23 ms plain vs 21 ms split (0.91).
# So on this CPU split-KV does not pay for one sequence and is off; for a padded batch it stays on only where
# the gather buffer passes ~32 MB in float32 for this shape (48k tokens), where it measurably avoids the
# page-fault cost. On a GPU the parallel mode is the FlashDecoding structure (one call over chunks x heads);
# try SPLIT_KV_MIN_CONTEXT = 1024 there -- unmeasured here, no GPU was available.
# One sequence: split from this many context tokens on (None = never), into SPLIT_KV_CHUNK-token chunks.
SPLIT_KV_MIN_CONTEXT: int | None = None
SPLIT_KV_CHUNK = 512
# A padded batch of decoding sequences: split when batch * longest context reaches this many tokens (None =
# never), reading SPLIT_KV_BATCH_CHUNK context tokens of every sequence per step of the loop.
SPLIT_KV_MIN_BATCH_TOKENS: int | None = 49152
SPLIT_KV_BATCH_CHUNK = 1024

_NEG_INF = float("-inf")
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class MaskPart:
    """A boolean mask for one call (True = may attend), plus what the kernels need, built once per step."""

    mask: torch.Tensor  # [b, 1, rows, k] bool
    rows_seen: torch.Tensor = field(init=False)  # [b, 1, rows]: the row sees some key (else its lse is -inf)
    _additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.rows_seen = self.mask.any(dim=-1)

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as 0 / -inf in ``dtype``: the fused CPU kernel takes no bool mask."""
        m = self._additive.get(dtype)
        if m is None:
            m = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, _NEG_INF
            )
            self._additive[dtype] = m
        return m


@dataclass
class KVChunk:
    """Batched mode: context positions ``offset .. offset+length-1`` of every sequence of the group."""

    offset: int
    length: int
    slots: torch.Tensor  # [batch*length] cache slots to gather
    mask: MaskPart | None  # None = all visible


@dataclass
class SplitPlan:
    """How one attention group is split. ``chunked_read``: the kernel reads the cache itself, by chunks."""

    batch: int
    chunk: int
    chunked_read: bool
    # parallel mode (batch 1): num_full chunks of `chunk` tokens in one call, then a tail of `tail` tokens
    num_full: int = 0
    tail: int = 0
    mask_full: MaskPart | None = None  # [num_full, 1, rows, chunk]
    mask_tail: MaskPart | None = None  # [1, 1, rows, tail]
    # batched mode
    chunks: list[KVChunk] = field(default_factory=list)


def use_split(folded: bool, batch: int, kv_len: int) -> bool:
    """Whether an attention group (GQA heads ``folded`` into rows, ``batch`` sequences, ``kv_len`` context
    positions each) takes a split path (constants are read at call time, so tests can patch them)."""
    if not folded:
        return False
    if batch == 1:
        limit = SPLIT_KV_MIN_CONTEXT
        return limit is not None and kv_len >= max(limit, 2 * SPLIT_KV_CHUNK)
    return SPLIT_KV_MIN_BATCH_TOKENS is not None and batch * kv_len >= SPLIT_KV_MIN_BATCH_TOKENS


def plan_split(batch: int, kv_len: int, mask: torch.Tensor | None, kv_slots: torch.Tensor | None,
               block_size: int) -> SplitPlan:
    """Plan the split of a folded, few-rows attention group: ``batch`` sequences of ``kv_len`` positions, its
    mask [batch, 1, rows, kv_len] (None = all visible) and, for a padded batch, its cache slots [batch*kv_len]."""
    if batch == 1:
        c = SPLIT_KV_CHUNK
        n, tail = divmod(kv_len, c)
        plan = SplitPlan(batch=1, chunk=c, chunked_read=False, num_full=n, tail=tail)
        if mask is not None:
            rows = mask.shape[2]
            full = mask[..., : n * c].reshape(rows, n, c).transpose(0, 1).reshape(n, 1, rows, c)
            plan.mask_full = MaskPart(full.contiguous())
            if tail:
                plan.mask_tail = MaskPart(mask[..., n * c :].contiguous())
        return plan
    if kv_slots is None:
        raise ValueError("a split over a padded batch needs the group's cache slots")
    c = max(block_size, SPLIT_KV_BATCH_CHUNK // block_size * block_size)
    plan = SplitPlan(batch=batch, chunk=c, chunked_read=True)
    slots = kv_slots.view(batch, kv_len)
    for c0 in range(0, kv_len, c):
        n = min(c, kv_len - c0)
        part = None if mask is None else MaskPart(mask[..., c0 : c0 + n].contiguous())
        plan.chunks.append(KVChunk(c0, n, slots[:, c0 : c0 + n].reshape(-1), part))
    return plan


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: MaskPart | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, H, Q, D] to one chunk k, v [B, H, K, D], plus its log-sum-exp.

    Returns (o [B, H, Q, D] in q's dtype, lse [B, H, Q] float32). A row that sees no key of the chunk gets
    lse = -inf (and o = 0), so the merge ignores it. On CPU the fused flash kernel (the one SDPA itself calls)
    returns the LSE for free; elsewhere the scores are materialised, which is cheap for few query rows.
    """
    if mask is not None and not isinstance(mask, MaskPart):
        mask = MaskPart(mask)
    if _CPU_FLASH is not None and q.device.type == "cpu" and q.dtype.is_floating_point:
        o, lse = _CPU_FLASH(q, k, v, attn_mask=None if mask is None else mask.additive(q.dtype), scale=scale)[
            :2
        ]
        if mask is not None:
            lse = lse.masked_fill(~mask.rows_seen, _NEG_INF)  # the kernel reports 0 for a fully masked row
        return o, lse
    s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if mask is not None:
        s.masked_fill_(~mask.mask, _NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # a row with no visible key: exp(nan) -> 0
    return torch.matmul(p.to(v.dtype), v), lse


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """o [N, ...rows, D], lse [N, ...rows] of N partials over disjoint key sets -> the full-context output."""
    w = torch.softmax(lse, dim=0).nan_to_num_(0.0)  # a row that sees no key anywhere -> 0
    return (o.float() * w.unsqueeze(-1)).sum(0).to(o.dtype)


def _parallel(
    qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SplitPlan, scale: float
) -> torch.Tensor:
    """Batch-1 mode: k, v [1, Hkv, K, D] (any strides along K) -> [1, Hkv, rows, D]."""
    _, hkv, rows, d = qf.shape
    n, c, tail = plan.num_full, plan.chunk, plan.tail
    # [1, Hkv, n*c, D] -> [n, Hkv, c, D]: a strided view over the same memory, chunks on the batch axis
    kf = k[:, :, : n * c].unflatten(2, (n, c)).squeeze(0).transpose(0, 1)
    vf = v[:, :, : n * c].unflatten(2, (n, c)).squeeze(0).transpose(0, 1)
    o, lse = partial_attention(qf.expand(n, hkv, rows, d), kf, vf, scale, plan.mask_full)
    if tail:
        ot, lt = partial_attention(qf, k[:, :, n * c :], v[:, :, n * c :], scale, plan.mask_tail)
        o, lse = torch.cat([o, ot]), torch.cat([lse, lt])
    return merge_partials(o, lse).unsqueeze(0)


def _chunked(
    qf: torch.Tensor, k_cache: KVPlane, v_cache: KVPlane, plan: SplitPlan, scale: float
) -> torch.Tensor:
    """Batched mode: gather, attend and drop one chunk of every sequence at a time."""
    b, hkv, _, d = qf.shape
    outs, lses = [], []
    for ch in plan.chunks:
        kc = read_kv_slots(k_cache, ch.slots, qf.dtype).view(b, ch.length, hkv, d).transpose(1, 2)
        vc = read_kv_slots(v_cache, ch.slots, qf.dtype).view(b, ch.length, hkv, d).transpose(1, 2)
        o, lse = partial_attention(qf, kc, vc, scale, ch.mask)
        outs.append(o)
        lses.append(lse)
    return merge_partials(torch.stack(outs), torch.stack(lses))


def split_attention(
    qf: torch.Tensor,
    kg: torch.Tensor | None,
    vg: torch.Tensor | None,
    k_cache: KVPlane,
    v_cache: KVPlane,
    plan: SplitPlan,
    scale: float,
) -> torch.Tensor:
    """Per-layer entry from ``paged_attention``: qf [B, Hkv, rows, D] (GQA heads folded into rows).

    ``kg``/``vg`` [B, Hkv, K, D] are the group's K/V as the plain path read them (None when
    ``plan.chunked_read``: then the caches are read here, chunk by chunk). Returns [B, Hkv, rows, D].
    """
    if plan.chunked_read:
        return _chunked(qf, k_cache, v_cache, plan, scale)
    assert kg is not None and vg is not None
    return _parallel(qf, kg, vg, plan, scale)


def split_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    chunk: int = SPLIT_KV_CHUNK,
) -> torch.Tensor:
    """Dense split-KV attention: q [B, H, Q, D], k, v [B, Hkv, K, D] (H = G * Hkv), mask [B, 1, Q, K] bool.

    Equal to ``scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=True)`` up to rounding. The
    query heads sharing a KV head are folded into the row axis (as the paged path does), so K/V are never
    repeated; chunks are attended one by one and merged by their log-sum-exp.
    """
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = h // hkv
    qf = q.reshape(b, hkv, group * nq, d)
    fmask = None
    if mask is not None:
        fmask = (
            mask.expand(b, 1, nq, nk).unsqueeze(2).expand(b, 1, group, nq, nk).reshape(b, 1, group * nq, nk)
        )
    outs, lses = [], []
    for c0 in range(0, nk, chunk):
        sl = slice(c0, min(nk, c0 + chunk))
        o, lse = partial_attention(
            qf, k[:, :, sl], v[:, :, sl], scale, None if fmask is None else fmask[..., sl]
        )
        outs.append(o)
        lses.append(lse)
    return merge_partials(torch.stack(outs), torch.stack(lses)).reshape(b, h, nq, d)
