"""CUDA graphs for decode and verification steps, per padded batch size (as vLLM captures them).

A decode step of a small model on a GPU is launch-bound: hundreds of small kernels whose CPU-side launch costs
more than their work. A captured graph replays the whole forward pass (every layer, the Triton attention of
layers/triton_attention.py and the LM head) as one launch. A graph fixes its tensors' shapes and addresses, so
each captured :class:`StepShape` owns static device buffers -- token ids, positions, the KV slots written, the
block tables, per-sequence lengths -- and a step is *filled* into the smallest shape that holds it:

- ``batch``: sequences, rounded up to the next of :data:`BATCH_SIZES`; the extra sequences have no rows that
  attend (length 0) and their rows write their K/V into a scratch block that no sequence owns;
- ``q_len``: rows per sequence, rounded up to the next of :data:`QUERY_LENS` (1 = plain decoding; more = a draft
  chain plus its bonus row); a sequence with fewer rows pads its own tail the same way.

Steps outside the buckets run eagerly (:func:`eager_reason` says why): prompt chunks (more rows than the largest
query bucket), candidate trees (their masks change shape every step), batches above the largest bucket, and any
pass a drafter listens to part-way (self-speculation's layer captures). The split-KV choice inside the graph is
made once, for ``max_model_len``; shorter contexts leave some splits empty, which the merge ignores.

Graphs are captured on first use of a shape (the first step of a new size pays for its capture). With
``capture=False`` the same static buffers run eagerly: that is how the padding is tested on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ForwardResult
from leapdecode.layers import triton_attention
from leapdecode.layers.attention import AttentionMetadata, SeqAttention, build_attention_metadata

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
QUERY_LENS = (1, 2, 4, 8, 16)
MAX_ROWS = 2048  # largest batch * q_len captured: the static logits are [rows, vocab] float32
SCRATCH_BLOCKS = 1  # extra KV blocks the engine allocates for the padding rows' writes


@dataclass(frozen=True)
class StepShape:
    batch: int  # sequences, padding included
    q_len: int  # rows per sequence, padding included


def wanted(device: torch.device, enforce_eager: bool, kv_device_layers: int | None,
           windowed: bool = False) -> bool:
    """Whether an engine captures graphs: on CUDA with triton, unless told not to, some layers' KV lives in host
    memory (those layers fetch their slots through host-side indexing, which a graph cannot record), or some layers
    attend within a sliding window (the captured Triton attention reads every position)."""
    return (device.type == "cuda" and triton_attention.AVAILABLE and not enforce_eager and kv_device_layers is None
            and not windowed)


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) that is at least ``n``, or None."""
    return next((s for s in sizes if s >= n), None)


def eager_reason(items: Sequence[ForwardItem], batch_sizes: Sequence[int], query_lens: Sequence[int],
                 max_model_len: int) -> str | None:  # fmt: skip
    """Why this step cannot replay a captured graph (None: it can)."""
    if not items:
        return "empty step"
    if any(it.tree_mask is not None or it.depths is not None for it in items):
        return "a candidate tree"
    longest = max(len(it.tokens) for it in items)
    if longest == 0 or bucket(longest, query_lens) is None:
        return f"{longest} rows in one sequence (above the largest query bucket {query_lens[-1]})"
    if bucket(len(items), batch_sizes) is None:
        return f"{len(items)} sequences (above the largest batch bucket {batch_sizes[-1]})"
    if max(it.start + len(it.tokens) for it in items) > max_model_len:
        return "a context beyond max_model_len"
    return None


def shape_for(items: Sequence[ForwardItem], batch_sizes: Sequence[int], query_lens: Sequence[int]) -> StepShape:
    """The captured shape a step (that :func:`eager_reason` accepts) is padded to."""
    b = bucket(len(items), batch_sizes)
    q = bucket(max(len(it.tokens) for it in items), query_lens)
    assert b is not None and q is not None
    return StepShape(b, q)


class StaticStep:
    """The device buffers of one captured shape, the graph that reads them, and its outputs."""

    def __init__(self, shape: StepShape, group_size: int, block_size: int, max_model_len: int, scratch_block: int,
                 device: torch.device) -> None:  # fmt: skip
        self.shape, self.block_size, self.device = shape, block_size, device
        b, q = shape.batch, shape.q_len
        self.max_blocks = -(-max_model_len // block_size)
        self.scratch = scratch_block * block_size + torch.arange(b * q) % block_size  # padding rows' K/V slots
        self.input_ids = torch.zeros(b * q, dtype=torch.long, device=device)
        self.positions = torch.zeros(b * q, dtype=torch.long, device=device)
        slot_mapping = self.scratch.to(device)
        # the metadata's structure (one few-row group of b sequences of q rows) is what a filled step has; its
        # sequences' lengths live in the RowBatch tensors, which fill() rewrites in place
        seqs = [SeqAttention(i * q, q, q, [scratch_block] * -(-q // block_size), block_size) for i in range(b)]
        self.meta: AttentionMetadata = build_attention_metadata(seqs, slot_mapping, group_size, device)
        rows = triton_attention.RowBatch.from_seqs(seqs, device, max_blocks=self.max_blocks, max_q=q)
        rows.max_ctx = max_model_len  # the split-KV choice is made once, for the longest context
        rows.q_len.zero_()
        rows.ctx_len.zero_()
        self.meta._triton = rows
        self.rows = rows
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def fill(self, items: Sequence[ForwardItem]) -> None:
        """Copy a step's sequences into the static buffers; sequences and rows past the step's are padding."""
        b, q, bs = self.shape.batch, self.shape.q_len, self.block_size
        if len(items) > b or any(len(it.tokens) > q for it in items):
            raise ValueError(f"a step of {len(items)} sequences does not fit the captured shape {self.shape}")
        ids = torch.zeros(b * q, dtype=torch.long)
        pos = torch.zeros(b * q, dtype=torch.long)
        slots = self.scratch.clone()
        tables = torch.zeros(b, self.max_blocks, dtype=torch.int32)
        q_len = torch.zeros(b, dtype=torch.int32)
        ctx = torch.zeros(b, dtype=torch.int32)
        for i, it in enumerate(items):
            n, base, end = len(it.tokens), i * q, it.start + len(it.tokens)
            used = -(-end // bs)
            if used > self.max_blocks or len(it.block_table) < used:
                raise ValueError(f"sequence {i}: {end} positions do not fit its block table or max_model_len")
            table = torch.tensor(it.block_table[:used], dtype=torch.long)
            p = torch.arange(it.start, end)
            ids[base : base + n] = torch.tensor(it.tokens, dtype=torch.long)
            pos[base : base + n] = p
            slots[base : base + n] = table[p // bs] * bs + p % bs
            tables[i, :used] = table.to(torch.int32)
            q_len[i], ctx[i] = n, end
        for dst, src in ((self.input_ids, ids), (self.positions, pos), (self.meta.slot_mapping, slots),
                         (self.rows.block_tables, tables), (self.rows.q_len, q_len), (self.rows.ctx_len, ctx)):
            dst.copy_(src, non_blocking=True)

    def forward(self, model: torch.nn.Module, kv: KVCache) -> None:
        """One pass over the static buffers (what the graph records)."""
        self.hidden = model(self.input_ids, self.positions, kv.layers, self.meta)
        self.logits = model.compute_logits(self.hidden).float()

    def capture(self, model: torch.nn.Module, kv: KVCache, pool: tuple[int, int] | None) -> None:
        """Warm up on a side stream (Triton compiles its kernels there), then record one pass. The buffers hold
        padding only, so neither run writes a sequence's KV."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(model, kv)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.forward(model, kv)
        self.graph = graph


class StepGraphs:
    """Captured decode/verification steps of one model runner. :meth:`execute` returns None for a step that
    must run eagerly. ``capture=False`` runs the static buffers without graphs (any device)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int, device: torch.device,
                 max_model_len: int, max_num_seqs: int, scratch_block: int, capture: bool = True,
                 batch_sizes: Sequence[int] = BATCH_SIZES, query_lens: Sequence[int] = QUERY_LENS) -> None:  # fmt: skip
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device (capture=False runs the static buffers eagerly)")
        if scratch_block * block_size >= kv_cache.pool.shape[2] or scratch_block < 0:
            raise ValueError(f"scratch block {scratch_block} is outside the KV pool")
        self.model, self.kv_cache, self.block_size, self.device = model, kv_cache, block_size, device
        self.max_model_len, self.scratch_block, self.capture = max_model_len, scratch_block, capture
        self.query_lens = tuple(sorted(query_lens))
        sizes = sorted({min(b, max_num_seqs) for b in batch_sizes})
        self.batch_sizes = tuple(b for b in sizes if b * self.query_lens[0] <= MAX_ROWS)
        cfg = model.config
        self.group_size = cfg.num_attention_heads // cfg.num_key_value_heads
        self.steps: dict[StepShape, StaticStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        self.eager_steps = 0

    def step_for(self, shape: StepShape) -> StaticStep:
        """The static step of ``shape``, built (and on CUDA captured) on first use."""
        step = self.steps.get(shape)
        if step is None:
            # the static metadata describes its sequences only to the Triton kernels (RowBatch); a layer on the SDPA
            # path would attend through the placeholder slots it was built with
            probe = torch.empty(0, device=self.device)
            if not all(triton_attention.applies(probe, k) for k, _ in self.kv_cache.layers):
                raise RuntimeError("a static step needs every layer's attention on the Triton kernels (a float or "
                                   "int8 cache on the device, triton installed; triton_attention.forced() on a CPU)")
            step = StaticStep(shape, self.group_size, self.block_size, self.max_model_len, self.scratch_block,
                              self.device)  # fmt: skip
            if self.capture:
                step.capture(self.model, self.kv_cache, self.pool)
            self.steps[shape] = step
        return step

    @torch.inference_mode()
    def execute(self, items: Sequence[ForwardItem]) -> list[ForwardResult] | None:
        reason = eager_reason(items, self.batch_sizes, self.query_lens, self.max_model_len)
        shape = None if reason else shape_for(items, self.batch_sizes, self.query_lens)
        if shape is None or shape.batch * shape.q_len > MAX_ROWS:
            self.eager_steps += 1
            return None
        step = self.step_for(shape)
        step.fill(items)
        if step.graph is not None:
            step.graph.replay()
        else:
            step.forward(self.model, self.kv_cache)
        self.replays += 1
        assert step.logits is not None and step.hidden is not None
        rows = torch.tensor([i * shape.q_len + r for i, it in enumerate(items) for r in it.logit_rows],
                            dtype=torch.long, device=self.device)  # fmt: skip
        logits, hidden = step.logits.index_select(0, rows), step.hidden.index_select(0, rows)
        out, i = [], 0
        for it in items:
            n = len(it.logit_rows)
            out.append(ForwardResult(logits[i : i + n], hidden[i : i + n]))
            i += n
        return out
