"""Few-token attention over the paged KV cache through the Triton kernels of kernels/triton_decode.py.

This is the GPU counterpart of the CPU rows kernel: decode tokens, draft chains and candidate trees (the rows of
few-row attention groups) attend in one launch that reads the cache through the block tables, with no gathered
copy of the context. ``triton`` is optional (the ``gpu`` extra): without it :data:`AVAILABLE` is False and
attention keeps its SDPA path.

A launch is described by a :class:`RowBatch` (per-sequence device tensors, built once per step and shared by all
layers). :func:`paged_decode_attention` picks the short-context kernel or, when few programs would cover a long
context, the split-KV variant with its merge kernel (:func:`num_splits_for`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from leapdecode.layers.kv_quant import KVPlane, QuantizedKV

try:
    from leapdecode.kernels import triton_decode
except ImportError:  # triton not installed: the optional `gpu` extra
    triton_decode = None  # type: ignore[assignment]

AVAILABLE = triton_decode is not None
# streaming multiprocessors assumed when no GPU can be asked (the interpreter): only the split choice uses it
_DEFAULT_SMS = 132
# positions one split should cover at least: below this the merge costs more than the parallelism brings
MIN_SPLIT_LEN = 256
MAX_SPLITS = 32
_mode: bool | None = None  # None: on CUDA tensors only; True: forced(); False: disabled()


class RowSeq(Protocol):
    """What a launch needs of one sequence (``attention.SeqAttention`` has these fields)."""

    q_start: int
    q_len: int
    ctx_len: int
    block_table: list[int]
    block_size: int
    tree_mask: torch.Tensor | None


@contextlib.contextmanager
def _use(mode: bool) -> Iterator[None]:
    global _mode
    old, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = old


def forced() -> contextlib.AbstractContextManager[None]:
    """Use the Triton path for CPU tensors too (they then run through the interpreter: ``TRITON_INTERPRET=1``
    must have been set before triton was imported). For tests and debugging."""
    return _use(True)


def disabled() -> contextlib.AbstractContextManager[None]:
    """Keep the torch path (SDPA over gathered pages) even for CUDA tensors: the reference the kernels are tested
    against on a GPU."""
    return _use(False)


def applies(q: torch.Tensor, k_cache: object) -> bool:
    """Whether the few-token rows of this layer go through the Triton kernels: triton is installed, the tensors
    are on a GPU (or :func:`forced`; never under :func:`disabled`), and the cache plane is a float tensor or an int8
    plane (kv_quant.py) on q's device (not, say, the host layer tier's planes)."""
    if not AVAILABLE or _mode is False or not (q.is_cuda or _mode is True):
        return False
    if isinstance(k_cache, torch.Tensor):
        return k_cache.device == q.device and k_cache.is_floating_point()
    return isinstance(k_cache, QuantizedKV) and k_cache.data.device == q.device


@dataclass
class RowBatch:
    """Device tensors describing the sequences of one launch (see the kernel module for the visibility rule)."""

    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    q_start: torch.Tensor  # [S] int32: first flat row of each sequence
    q_len: torch.Tensor  # [S] int32
    ctx_len: torch.Tensor  # [S] int32: cached + new positions (0 = padding: attends nothing)
    tree_mask: torch.Tensor | None  # [S, max_q, max_m] int8; None when no sequence has a tree
    tree_len: torch.Tensor | None  # [S] int32: m of each sequence's mask, 0 = causal
    rows: torch.Tensor  # [R] int64: every flat row owned by these sequences (the merge's work list)
    block_size: int
    max_q: int
    max_ctx: int

    @classmethod
    def from_seqs(cls, seqs: Sequence[RowSeq], device: torch.device | str, max_blocks: int | None = None,
                  max_q: int | None = None) -> RowBatch:  # fmt: skip
        """Pack ``seqs``; ``max_blocks``/``max_q`` pad the tables and the row-block count to fixed sizes (a
        captured CUDA graph needs shapes that do not change between replays)."""
        if not seqs:
            raise ValueError("RowBatch needs at least one sequence")
        block_size = seqs[0].block_size
        if any(s.block_size != block_size for s in seqs):
            raise ValueError("all sequences of a RowBatch must share one block size")
        width = max(-(-s.ctx_len // block_size) for s in seqs)
        width = max(width, max_blocks or 0)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            n = -(-s.ctx_len // block_size)
            if len(s.block_table) < n:
                raise ValueError(f"block table of {len(s.block_table)} blocks cannot hold {s.ctx_len} positions")
            tables[i, :n] = torch.tensor(s.block_table[:n], dtype=torch.int32)
        q_max = max(max(s.q_len for s in seqs), max_q or 0)
        tree_mask = tree_len = None
        if any(s.tree_mask is not None for s in seqs):
            m_max = max(s.tree_mask.shape[1] for s in seqs if s.tree_mask is not None)
            tree_mask = torch.zeros(len(seqs), q_max, m_max, dtype=torch.int8)
            tree_len = torch.zeros(len(seqs), dtype=torch.int32)
            for i, s in enumerate(seqs):
                if s.tree_mask is not None:
                    q, m = s.tree_mask.shape
                    if q != s.q_len or not s.q_len <= m <= s.ctx_len:
                        raise ValueError(f"tree mask {tuple(s.tree_mask.shape)} does not fit q_len {s.q_len}")
                    tree_mask[i, :q, :m] = s.tree_mask.to(torch.int8)
                    tree_len[i] = m
        rows = torch.cat([torch.arange(s.q_start, s.q_start + s.q_len) for s in seqs])

        def ints(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32, device=device)

        return cls(
            block_tables=tables.to(device),
            q_start=ints([s.q_start for s in seqs]),
            q_len=ints([s.q_len for s in seqs]),
            ctx_len=ints([s.ctx_len for s in seqs]),
            tree_mask=None if tree_mask is None else tree_mask.to(device),
            tree_len=None if tree_len is None else tree_len.to(device),
            rows=rows.to(device),
            block_size=block_size,
            max_q=q_max,
            max_ctx=max(s.ctx_len for s in seqs),
        )


def num_splits_for(num_programs: int, max_ctx: int, num_sms: int = _DEFAULT_SMS) -> int:
    """How many chunks to cut each sequence's context into: enough programs to fill about two waves of the
    GPU's multiprocessors, but no chunk shorter than :data:`MIN_SPLIT_LEN` positions. 1 = the short kernel."""
    if num_programs <= 0:
        raise ValueError("num_programs must be positive")
    by_occupancy = -(-2 * num_sms // num_programs)
    by_length = max(1, max_ctx // MIN_SPLIT_LEN)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _block_m(rows: int) -> int:
    return min(64, max(16, _next_pow2(rows)))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _planes(cache: KVPlane) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(cache, QuantizedKV):
        return cache.data, cache.scale
    return cache, None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: KVPlane,
    v_cache: KVPlane,
    batch: RowBatch,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
    window: int = 0,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attend the rows of ``batch`` and write them into ``out`` ([T, H, D], q's flat layout; other rows are left
    alone). q: [T, H, D]; caches: [slots, Hkv, D] float tensors, or int8 planes with ``data`` [slots, Hkv, D] and
    float16 ``scale`` [slots, Hkv, groups] (q must already be in the cache basis: kv_quant.py). ``num_splits``:
    None = :func:`num_splits_for`; 1 = the short-context kernel. ``window``: sliding window (0 = none)."""
    if triton_decode is None:
        raise RuntimeError("the Triton attention path needs triton (pip install 'leapdecode[gpu]')")
    k_data, k_scale = _planes(k_cache)
    v_data, v_scale = _planes(v_cache)
    heads, d = q.shape[1], q.shape[2]
    hkv = k_data.shape[1]
    if heads % hkv or k_data.shape[2] != d or v_data.shape != k_data.shape:
        raise ValueError(f"q {tuple(q.shape)} does not match caches {tuple(k_data.shape)} / {tuple(v_data.shape)}")
    if window < 0 or (window and batch.tree_mask is not None):
        raise ValueError("a sliding window needs window >= 0 and causal rows (no tree mask)")
    group = heads // hkv
    quant = k_scale is not None
    if quant and (v_scale is None or k_scale.stride() != v_scale.stride()):
        raise ValueError("int8 K and V planes must both carry scales of one layout")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    # the kernels step through the last dimension (head channels, scale groups) as contiguous memory
    if any(t.stride(-1) != 1 for t in (q, out, k_data, v_data, *((k_scale, v_scale) if quant else ()))):
        raise ValueError("q, out and the cache planes need a contiguous last dimension")
    block_m = _block_m(batch.max_q * group)
    m_blocks = -(-(batch.max_q * group) // block_m)
    seqs = batch.q_len.shape[0]
    programs = seqs * hkv * m_blocks
    splits = num_splits or num_splits_for(programs, batch.max_ctx, _sm_count(q.device))
    block_n = block_n or (64 if q.is_cuda else 16)
    split_len = -(-max(batch.max_ctx, 1) // splits)
    split_len = -(-split_len // block_n) * block_n
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if splits > 1:
        part = torch.empty(q.shape[0], heads, splits, d, dtype=torch.float32, device=q.device)
        # -inf: rows no program writes (padding rows of a captured step) merge to 0 instead of reading garbage
        lse = torch.full((q.shape[0], heads, splits), float("-inf"), dtype=torch.float32, device=q.device)
        target, stride_os, lse_strides = part, part.stride(2), lse.stride()[:2]
    else:
        target, lse, stride_os, lse_strides = out, out, 0, (0, 0)
    scales = (k_scale, v_scale) if quant else (k_data, v_data)
    tree = batch.tree_mask if batch.tree_mask is not None else batch.q_len
    tree_len = batch.tree_len if batch.tree_len is not None else batch.q_len
    s_strides = k_scale.stride()[:2] if quant else (0, 0)
    t_strides = batch.tree_mask.stride()[:2] if batch.tree_mask is not None else (0, 0)
    triton_decode.paged_rows_kernel[(seqs, hkv * m_blocks, splits)](
        q, k_data, v_data, scales[0], scales[1], target, lse,
        batch.block_tables, batch.q_start, batch.q_len, batch.ctx_len, tree, tree_len,
        scale * math.log2(math.e), window, batch.block_size, split_len,
        q.stride(0), q.stride(1),
        k_data.stride(0), k_data.stride(1), v_data.stride(0), v_data.stride(1), *s_strides,
        target.stride(0), target.stride(1), stride_os, *lse_strides,
        batch.block_tables.stride(0), *t_strides,
        GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, _next_pow2(d)), BLOCK_M=block_m, BLOCK_N=block_n,
        M_BLOCKS=m_blocks, SCALE_GROUP=d // k_scale.shape[-1] if quant else 1, QUANT=quant, SPLIT=splits > 1,
        HAS_TREE=batch.tree_mask is not None, PRECISION=precision,
        DOT_FP32=q.dtype == torch.bfloat16 and not q.is_cuda,
    )  # fmt: skip
    if splits > 1:
        triton_decode.merge_splits_kernel[(batch.rows.shape[0], heads)](
            part, lse, out, batch.rows, splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=max(16, _next_pow2(d)), BLOCK_S=max(2, _next_pow2(splits)),
        )  # fmt: skip
    return out


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS
