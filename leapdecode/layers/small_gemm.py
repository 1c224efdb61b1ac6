"""The few-row CPU kernel for the projections that dominate decoding, and the other C++ ops of the extension.

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
the float32 panels while a step reads 4.75-12 bits per weight instead of 32. This is not a lossy option: the
float32 model *is* the dequantised checkpoint, and no float32 copy of it is ever made.

``linear_kernel="packed-int8act"`` is the one lossy option (off by default): the same blocks re-laid for AVX-512
VNNI or AVX2 (``BlockQuantized.pack_int8_activations``; ``int8_activation_isa`` says which was built), each input
row rounded to int8 per 32 values as llama.cpp does.
Those records serve every row count, prompts included, so the precision never depends on the batch and speculation
stays token-identical to plain decoding at that precision.

The kernel is C++ compiled on first use with the host compiler (``-march=native``; ~60 s once, cached by torch in
``~/.cache/torch_extensions``). Without a compiler, ``"auto"`` falls back to torch (and GGUF weights to float32)
with one warning.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from leapdecode.kernels.build import load_extension

# record bytes per 16 rows x 32 inputs -> kind (kernels/block_formats.h; layers/block_formats.py describes them)
RECORD_KINDS = {384: "q4", 576: "q8", 640: "q8m", 608: "q8s", 448: "q4s", 2432: "q4k", 3392: "q6k", 320: "q4h"}
# 64-byte lines per record of the int8-activation layout (kernels/int8_gemm.cpp), and the kind each one holds
A8_Q4_LINES, A8_Q8_LINES, A8_Q4K_LINES, A8_Q6K_LINES, A8_Q4H_LINES = 6, 9, 38, 53, 5
A8_KIND_OF_LINES = {A8_Q4_LINES: "q4", A8_Q8_LINES: "q8", A8_Q4K_LINES: "q4k", A8_Q6K_LINES: "q6k", A8_Q4H_LINES: "q4h"}
SEGMENTS_MAGIC = 0x53544E454D474553  # "SEGMENTS": a weight of parts in different formats (kernels/small_gemm.cpp)
MAX_ROWS = 64  # beyond this the call is compute-bound and torch's GEMM is as fast (measured up to 64)
KERNELS = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = [KERNELS / "small_gemm.cpp", KERNELS / "int8_gemm.cpp", KERNELS / "gguf_blocks.cpp",
           KERNELS / "decode_ops.cpp"]  # one extension: one build, one load
_ext = None
_error: str | None = None


def _cpu_tag() -> str:
    """Short hash of the CPU model and flags: a ``-march=native`` build must not be reused on another CPU."""
    info = platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info += "".join(ln for ln in lines if ln.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha256(info.encode()).hexdigest()[:10]


def _headers_tag() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(KERNELS.glob("*.h")))).hexdigest()[:12]


def load_kernel(required: bool = False):
    """The compiled extension, building it on first use; None (with one warning) if it cannot be built, or an
    error when ``required``."""
    global _ext, _error
    if _ext is not None:
        return _ext
    if _error is None:
        try:
            from torch.utils.cpp_extension import _get_build_directory

            name = f"leapdecode_small_gemm_{_cpu_tag()}"
            if not any(Path(_get_build_directory(name, verbose=False)).glob("*.so")):
                print("leapdecode: building the CPU kernels (once, ~60 s)", file=sys.stderr, flush=True)
            _ext = load_extension(  # behind an OS lock: a killed build cannot wedge later runs
                name=name,
                sources=[str(p) for p in SOURCES],
                # torch rebuilds when a source or a build flag changes: the header's hash is a flag
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-Wno-psabi",
                              f"-DLEAPDECODE_HEADERS={_headers_tag()}"],
                extra_include_paths=[str(KERNELS)],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            return _ext
        except Exception as e:  # no compiler, no ninja, unsupported platform
            _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            if not required:
                warnings.warn(f"packed CPU linear kernel unavailable, using torch's linear ({_error})", stacklevel=2)
    if required:
        raise RuntimeError(f'linear_kernel="packed" but the kernel could not be built: {_error}')
    return None


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


@dataclass
class BlockQuantized:
    """A weight as a GGUF checkpoint stores it: ``w[n, k] = scale[n, k // 32] * q[n, k] + minimum[n, k // 32]``.

    ``kind`` "q4": q in 0..15 (Q4_1; Q4_0's ``d * (q - 8)`` is kept with ``minimum = -8 d``, the same float32
    value); "q8": q in -128..127 and no minimum (Q8_0). Scales are fp16 values held as float32, so ``scale * q`` is
    exact and ``dequantize`` reproduces gguf's float32 dequantisation bit for bit.
    """

    kind: str
    q: torch.Tensor  # [N, K] uint8 (q4) or int8 (q8)
    scale: torch.Tensor  # [N, K/32] float32
    minimum: torch.Tensor | None = None  # [N, K/32] float32 (q4)

    @classmethod
    def quantize_q8(cls, weight: torch.Tensor) -> BlockQuantized:
        """Q8_0 blocks of a float weight [N, K] (K a multiple of 32) exactly as gguf / llama.cpp make them: per
        block of 32 inputs d = amax / 127, q = w / d rounded half away from zero, d stored as fp16."""
        n, k = weight.shape
        w = weight.detach().float().reshape(n, k // 32, 32)
        d = w.abs().amax(dim=-1, keepdim=True) / 127.0
        x = w * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = (x.sign() * (x.abs() + 0.5).floor()).to(torch.int8).reshape(n, k)
        return cls("q8", q.contiguous(), d.squeeze(-1).half().float().contiguous())

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().reshape(n, k // 32, 32) * self.scale.unsqueeze(-1)
        if self.minimum is not None:
            w = w + self.minimum.unsqueeze(-1)
        return w.reshape(n, k)

    def pack_int8_activations(self) -> torch.Tensor:
        """The int8-activation kernel's layout: [N/16, K/32, 6 (q4) or 9 (q8) lines, 64] uint8; in each line
        output j owns bytes 4j..4j+3 (see kernels/small_gemm.cpp ``a8_linear``)."""
        n, k = self.q.shape
        nb = k // 32

        def per_block(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n // 16, 16, nb).transpose(1, 2).contiguous().view(torch.uint8)

        if self.kind == "q4":  # (panel, j, block, line g, half h, t): k = 32 b + 8 g + 4 h + t
            q = self.q.reshape(n // 16, 16, nb, 4, 2, 4)
            lines = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // 16, nb, 256)
            rec = torch.cat([per_block(self.scale), per_block(self.minimum), lines], dim=-1)
        else:  # (panel, j, block, line g, t): k = 32 b + 4 g + t, stored + 128 as unsigned
            q = (self.q.to(torch.int16) + 128).to(torch.uint8).reshape(n // 16, 16, nb, 8, 4)
            rec = torch.cat([per_block(self.scale), q.permute(0, 2, 3, 1, 4).reshape(n // 16, nb, 512)], dim=-1)
        return rec.reshape(n // 16, nb, -1, 64).contiguous()


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


def int8_activation_layout(packed: torch.Tensor) -> bool:
    """Whether ``packed`` is for the int8-activation kernel: 4-D records, or segments of them (an int8 buffer)."""
    return packed.dim() == 4 or (packed.dim() == 1 and packed.dtype == torch.int8)


def takes_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether ``x @ W^T`` goes through the packed kernel (inference only: the kernel has no backward): few rows,
    or any rows for int8-activation records, whose precision must not depend on the batch."""
    return (packed is not None and x.dim() == 2 and 0 < x.shape[0]
            and (x.shape[0] <= MAX_ROWS or int8_activation_layout(packed))
            and not x.requires_grad and x.dtype == torch.float32)  # (under autocast x may arrive in bfloat16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` from ``packed``: float32 panels [N/16, K, 16], block records [N/16, K/32, bytes]
    (layers/block_formats.py) or int8-activation records [N/16, K/32, lines, 64]; the kernel tells them apart."""
    y = _ext.packed_linear(x.contiguous(), packed)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in one C++ call (kernels/decode_ops.cpp) for CPU float32 inference; torch's otherwise."""
    if _ext is not None and x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad:
        return _ext.rms_norm(x.contiguous(), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def attention_rows(q, k_cache, v_cache, rows, spans, slots, scale: float, out: torch.Tensor) -> None:
    """Fill ``out[rows[r]]`` ([T, H, D]) with row ``rows[r]``'s attention over the float32 cache slots
    ``slots[spans[r, 0]:spans[r, 1]]`` (kernels/decode_ops.cpp; see attention.AttentionMetadata.kernel_rows)."""
    _ext.attention_rows(q, k_cache, v_cache, rows, spans, slots, scale, out)


def attention_rows_i8(q, k_plane, v_plane, rows, spans, slots, scale: float, out: torch.Tensor) -> None:
    """:func:`attention_rows` over an int8 cache (kv_quant.QuantizedKV planes with 16 channels per scale), reading
    the int8 rows directly; ``q`` must already be in the cache's basis, and ``out`` is in it too."""
    _ext.attention_rows_i8(q, k_plane.data, k_plane.scale, v_plane.data, v_plane.scale, rows, spans, slots, scale,
                           out)  # fmt: skip


def int8_kv_kernels(plane) -> bool:
    """Whether the int8 C++ ops serve this kv_quant.QuantizedKV plane (CPU, 16 channels per scale, kernel built)."""
    return _ext is not None and plane.data.device.type == "cpu" and plane.scale.shape[-1] * 16 == plane.data.shape[-1]


def quantize_kv_rows(x: torch.Tensor, plane, slots: torch.Tensor) -> None:
    """kv_quant.QuantizedKV.write in one C++ call: shift, smooth, rotate, quantize x [T, Hkv, D] into the plane."""
    empty = x.new_empty(0)
    _ext.quantize_kv_rows(x.float().contiguous(), empty if plane.shift is None else plane.shift.contiguous(),
                          empty if plane.smooth is None else plane.smooth.contiguous(),
                          empty if plane.rotation is None else plane.rotation.contiguous(), slots, plane.data,
                          plane.scale)  # fmt: skip


def int8_activation_isa() -> str | None:
    """What the int8-activation kernel was built for on this CPU: "avx512-vnni", "avx2" (the same integer sums
    by vpmaddubsw, bit-identical), "portable" (a scalar reference loop, several times slower than float32), or
    None without the kernel."""
    ext = load_kernel()
    return None if ext is None else ext.a8_isa()


def pack_rows(lm_head: torch.nn.Module, rows: torch.Tensor | None, weight: torch.Tensor,
              int8_activations: bool = False) -> torch.Tensor | None:
    """A packed copy of ``weight`` = rows ``rows`` (None = all) of an LM head's weight, for the kernel: from the
    head's checkpoint records when the loader kept them (for the int8-activation kernel if asked), else float32
    panels; None without the kernel."""
    if load_kernel() is None or not packable(weight):
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
        bq = BlockQuantized(bq.kind, *[None if t is None else t.index_select(0, rows.to(t.device)).contiguous()
                                       for t in (bq.q, bq.scale, bq.minimum)])  # fmt: skip
    if bq is None or not int8_activations:
        return pack(weight)
    return bq.pack_int8_activations()


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, num_heads: int) -> None:
    """RoPE in place on the first ``num_heads`` heads of each row of a fused [T, W] QKV (decode_ops.cpp)."""
    _ext.rope_(qkv, cos, sin_signed, num_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [T, 2I] projection -> [T, I] (decode_ops.cpp)."""
    return _ext.silu_mul(gate_up.contiguous())


def decoder_layer(*args) -> torch.Tensor:
    """One decoder layer for few-token rows in one C++ call (see models/llama.py ``DecoderLayer._fused``)."""
    return _ext.decoder_layer(*args)


def rotate_rows(x: torch.Tensor, smooth: torch.Tensor | None, rotation: torch.Tensor | None,
                transpose: bool) -> torch.Tensor:
    """``(x * smooth) @ R`` (or ``x @ R.T``) for rows x [T, H, D] in one C++ call: the int8 KV cache's query and
    output basis changes, shared by the per-op path and the fused layer so both round alike (decode_ops.cpp)."""
    empty = x.new_empty(0)
    return _ext.rotate_rows(x, empty if smooth is None else smooth, empty if rotation is None else rotation,
                            transpose)


def decoder_layer_i8(*args) -> torch.Tensor:
    """:func:`decoder_layer` over an int8 KV cache (kv_quant.QuantizedKV planes), bitwise equal to the per-op path."""
    return _ext.decoder_layer_i8(*args)


@dataclass
class StackWeights:
    """The per-layer arguments of :func:`decoder_stack` that do not change between steps, flattened once."""

    weights: list[torch.Tensor]  # 6 per layer, as decoder_layer takes them
    biases: list[torch.Tensor]  # 1 per layer; empty = no QKV bias
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float


@dataclass
class LayerStack:
    """One step's :func:`decoder_stack` arguments: the weights, and this step's caches -- 2 float32 tensors (K, V)
    or 4 int8 planes (k data, k scales, v data, v scales) per layer, with 4 transforms per layer for int8."""

    weights: StackWeights
    caches: list[torch.Tensor]
    transforms: list[torch.Tensor]


def stack_weights(layer_args: list[tuple]) -> StackWeights:
    """Flatten ``DecoderLayer.fused_args()`` of consecutive layers (which share heads, eps and scale)."""
    heads = {a[2:] for a in layer_args}
    if len(heads) != 1:
        raise ValueError(f"decoder_stack needs layers of one shape, got {sorted(heads)}")
    empty = torch.empty(0)
    return StackWeights([w for a in layer_args for w in a[0]], [empty if a[1] is None else a[1] for a in layer_args],
                        *heads.pop())  # fmt: skip


def decoder_stack(x: torch.Tensor, stack: LayerStack, cos: torch.Tensor, sin_signed: torch.Tensor,
                  slot_mapping: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Run a stack of decoder layers for one step of few-token rows in one C++ call (``decoder_layer`` or
    ``decoder_layer_i8`` per layer, so bitwise the per-layer result); see models/llama.py ``_layer_stack``."""
    w = stack.weights
    return _ext.decoder_stack(x, w.weights, w.biases, cos, sin_signed, stack.caches, stack.transforms, slot_mapping,
                              *rows, w.num_heads, w.num_kv_heads, w.eps, w.scale)  # fmt: skip


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
        return A8_KIND_OF_LINES[p.shape[2]] + "-int8act"
    return RECORD_KINDS[p.shape[2]]
