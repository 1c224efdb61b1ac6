"""The few-row CPU kernel for the projections that dominate decoding (Python side of kernels/small_gemm.cpp).

A decode step multiplies 1 row per sequence by every weight matrix; verifying k drafts multiplies k+1 rows. Both
should cost what it costs to read the weights once. torch's CPU ``linear`` does that for one row (a vector-matrix
product), but from 2 rows up it switches to a general GEMM that costs 2-2.5x as much on the machines we measured,
so verifying drafts is far from free on a CPU (on a GPU, a few more rows cost almost nothing).
``kernels/small_gemm.cpp`` keeps it at ~1.0-1.3x up to 8-16 rows; see the bench notes.

Layout of float weights (an HF folder): each weight [N, K] gets a packed copy [N/16, K, 16] (16 output features
per contiguous panel), built once at load time. Calls with at most ``MAX_ROWS`` rows use it; larger ones (prefill)
keep torch's GEMM, which is compute-bound there and tuned for it (``linear_kernel="torch"`` turns the kernel off).

Weights of a GGUF checkpoint stay in their blocks (layers/block_formats.py): every common type (Q4_0 ... Q8_0,
Q2_K ... Q6_K) is repacked at load time into records of 16 rows x 32 inputs (x 256 for Q4_K and Q6_K), and the
kernel rebuilds the exact float32 weights in registers and sums in the same order, so results are bit-identical to
the float32 panels while a step reads 4.75-10 bits per weight instead of 32. This is not a lossy option: the
float32 model *is* the dequantised checkpoint, and no float32 copy of it is ever made. A fused weight whose parts
have different kinds is segments of their own records (``segment_buffer``).

``linear_kernel="packed-int8act"`` is the one lossy option (off by default): the same blocks re-laid for the
int8-activation kernel (layers/int8_gemm.py), each input row rounded to int8 per 32 values as llama.cpp does.
Those records serve every row count, prompts included, so the precision never depends on the batch and speculation
stays token-identical to plain decoding at that precision.

The extension is built on first use (kernels/extension.py); without a compiler, ``"auto"`` falls back to torch
(and GGUF weights to float32) with one warning.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leapdecode.kernels import extension
from leapdecode.layers import int8_gemm

# record bytes per 16 rows x 32 inputs -> kind (kernels/block_formats.h; layers/block_formats.py describes them)
RECORD_KINDS = {384: "q4", 576: "q8", 640: "q8m", 608: "q8s", 448: "q4s", 2432: "q4k", 3392: "q6k", 320: "q4h"}
SEGMENTS_MAGIC = 0x53544E454D474553  # "SEGMENTS": a weight of parts in different formats (kernels/small_gemm.cpp)
MAX_ROWS = 64  # beyond this the call is compute-bound and torch's GEMM is as fast (measured up to 64)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K, 16]; N must be a multiple of 16 and K even (true of every layer of the models we load)."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def packable(weight: torch.Tensor) -> bool:
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 2 == 0
    )


def segment_buffer(shapes: list[tuple[int, ...]], int8_activations: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One packed weight made of segments of the given uint8 record shapes (the parts of a fused weight whose
    formats differ), and a view of each segment to fill: the header the kernel reads, then the segments, each at a
    64-byte boundary. The buffer's dtype tells the activations: int8 for int8-activation records, else uint8."""
    header, offsets, total = _segment_layout(shapes)
    buf = torch.zeros(total, dtype=torch.uint8)
    buf[: 8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    views = [buf[off: off + torch.Size(shape).numel()].view(shape) for off, shape in zip(offsets, shapes)]
    return (buf.view(torch.int8) if int8_activations else buf), views


def _segment_layout(shapes: list[tuple[int, ...]]) -> tuple[list[int], list[int], int]:
    """The header (int64 fields), each segment's byte offset and the total bytes of a segmented weight."""
    start = -(-8 * (2 + 6 * len(shapes)) // 64) * 64
    header, offsets = [SEGMENTS_MAGIC, len(shapes)], []
    for shape in shapes:
        offsets.append(start)
        header += [len(shape), *shape, *[1] * (4 - len(shape)), start]
        start += -(-int(torch.Size(shape).numel()) // 64) * 64
    return header, offsets, start


def segment_bytes(shapes: list[tuple[int, ...]]) -> int:
    """Bytes of a segmented weight of uint8 segments of these shapes (header and alignment included)."""
    return _segment_layout(shapes)[2]


def join_segments(parts: list[torch.Tensor], int8_activations: bool) -> torch.Tensor:
    """:func:`segment_buffer` filled with ``parts`` (uint8 records)."""
    buf, views = segment_buffer([tuple(p.shape) for p in parts], int8_activations)
    for view, part in zip(views, parts):
        view.copy_(part)
    return buf


def segments_of(packed: torch.Tensor) -> list[torch.Tensor]:
    """The segments of a packed weight made by :func:`segment_buffer` (views)."""
    raw = packed.view(torch.uint8)
    header = raw[:16].view(torch.int64)
    if raw.dim() != 1 or int(header[0]) != SEGMENTS_MAGIC:
        raise ValueError("not a segmented packed weight")
    fields = raw[: 8 * (2 + 6 * int(header[1]))].view(torch.int64)[2:].reshape(-1, 6).tolist()
    return [raw[f[5]: f[5] + torch.Size(f[1: 1 + f[0]]).numel()].view(f[1: 1 + f[0]]) for f in fields]


def takes_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether ``x @ W^T`` goes through the packed kernel (inference only: the kernel has no backward): few rows,
    or any rows for int8-activation records, whose precision must not depend on the batch."""
    return (packed is not None and x.dim() == 2 and 0 < x.shape[0]
            and (x.shape[0] <= MAX_ROWS or int8_gemm.int8_activation_layout(packed))
            and not x.requires_grad and x.dtype == torch.float32)  # (under autocast x may arrive in bfloat16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` from ``packed``: float32 panels [N/16, K, 16], block records [N/16, K/32, bytes]
    (layers/block_formats.py) or int8-activation records [N/16, K/32, lines, 64]; the kernel tells them apart."""
    y = extension.ext.packed_linear(x.contiguous(), packed)
    return y if bias is None else y.add_(bias)


def packed_linear_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`packed_linear` for any number of rows, ``MAX_ROWS`` at a time: for weights that exist only as block
    records (a prompt longer than the kernel's row limit), each row's result is the one it gets decoded alone."""
    x = x.contiguous()
    return torch.cat([packed_linear(x[i: i + MAX_ROWS], packed, bias) for i in range(0, x.shape[0], MAX_ROWS)])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """``F.linear`` that takes the packed kernel when :func:`takes_packed` says so."""
    if takes_packed(x, packed):
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def pack_rows(lm_head: torch.nn.Module, rows: torch.Tensor | None, weight: torch.Tensor,
              int8_activations: bool = False) -> torch.Tensor | None:
    """A packed copy of ``weight`` = rows ``rows`` (None = all) of an LM head's weight, for the kernel: from the
    head's checkpoint records when the loader kept them (for the int8-activation kernel if asked), else float32
    panels; None without the kernel."""
    if extension.load_kernel() is None or not packable(weight):
        return None
    owner = lm_head.owner() if hasattr(lm_head, "owner") else lm_head
    quant, bq = getattr(owner, "quant", None), getattr(owner, "block_quantized", None)
    if getattr(lm_head, "gather", False):  # a split head holds only this rank's rows: pack the gathered weight
        quant = bq = None
    if quant is not None:
        quant = quant if rows is None else quant.select_rows(rows)
        if quant is not None:
            return quant.int8_activation_records() if int8_activations else quant.records
    elif bq is not None and rows is not None:
        bq = int8_gemm.BlockQuantized(
            bq.kind, *[None if t is None else t.index_select(0, rows.to(t.device)).contiguous()
                       for t in (bq.q, bq.scale, bq.minimum)])  # fmt: skip
    if bq is None or not int8_activations:
        return pack(weight)
    return bq.pack_int8_activations()


def packed_formats(model: torch.nn.Module) -> dict[str, int]:
    """How many layers of ``model`` use each kernel format: "float32", a record kind ("q4h", "q4k", "q6k", "q8",
    ...; layers/block_formats.py), or an int8-activation layout ("q4h-int8act", "q4k-int8act", "q6k-int8act",
    "q4-int8act", "q8-int8act"), or those of a weight's segments joined by "+" ("q4k+q6k")."""
    counts: dict[str, int] = {}
    for mod in model.modules():
        p = getattr(mod, "packed", None)
        if isinstance(p, torch.Tensor):
            kind = "+".join(_format_name(s) for s in segments_of(p)) if p.dim() == 1 else _format_name(p)
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _format_name(p: torch.Tensor) -> str:
    if p.dtype == torch.float32:
        return "float32"
    if p.dim() == 4:  # int8-activation records
        return int8_gemm.A8_KIND_OF_LINES[p.shape[2]] + "-int8act"
    return RECORD_KINDS[p.shape[2]]
