"""GGUF weights kept in their blocks: the record formats the few-row CPU kernels compute from.

A quantized GGUF tensor is repacked once at load time (``kernels/gguf_blocks.cpp``, straight from the memory-mapped
file) into records of 16 output rows x 32 inputs that hold the same codes and scales, laid out so one record is a
few contiguous cache lines for the kernel (``kernels/block_formats.h`` has the table). No float32 copy of the
weight is made: decode steps and verification read the records; the few paths that need float rows (embedding
lookups, prompts longer than the kernels' row limit, a drafter reading a subset of the LM head) rebuild exactly
those rows. Every path rebuilds bitwise the float32 weights that gguf's own dequantisation gives, so the model
*is* the dequantised checkpoint; the int8-activation mode (``linear_kernel="packed-int8act"``) is the one lossy
option.

Bits per weight in memory (the GGUF type's own in brackets): Q4_K 4.75 (4.5), Q4_0/Q4_1 5 (4.5/5), Q6_K 6.6
(6.56), Q8_0 9 (8.5), Q5_0 9 (5.5), Q5_1/Q5_K 10 (5.5-6), Q3_K 9.5 (3.4), Q2_K 7 (2.6). A fused projection whose
parts have different kinds (Q4_K_M gives some layers' V a Q6_K beside Q4_K Q and K) keeps each part's own records,
as segments of one packed weight (:class:`SegmentedWeight`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from leapdecode.kernels import extension
from leapdecode.layers import int8_gemm, small_gemm

# ggml type ids -> names, of the types computed from their blocks; F32/F16/BF16 are float weights
GGML_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
              14: "Q6_K"}  # fmt: skip
TYPE_IDS = {name: i for i, name in GGML_TYPES.items()}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*FLOAT_TYPES, *TYPE_IDS)
KINDS = ("q4", "q8", "q8m", "q8s", "q4s", "q4k", "q6k", "q4h")  # block_formats.h RecordKind order
KIND_OF_TYPE = {"Q4_0": "q4h", "Q4_1": "q4h", "Q4_K": "q4k", "Q8_0": "q8", "Q5_0": "q8", "Q5_1": "q8m", "Q5_K": "q8m",
                "Q6_K": "q6k", "Q3_K": "q8s", "Q2_K": "q4s"}  # fmt: skip
SPAN = {k: 256 if k in ("q4k", "q6k") else 32 for k in KINDS}  # inputs per record
KIND_OF_RECORD = small_gemm.RECORD_KINDS
RECORD_BYTES = {k: b for b, k in KIND_OF_RECORD.items()}
# each record is a run of fields [count][16] (the last index is the panel's row); (element dtype, count) per field
FIELDS = {
    "q4": [(torch.float32, 1), (torch.float32, 1), (torch.uint8, 16)],
    "q8": [(torch.float32, 1), (torch.uint8, 32)],
    "q8m": [(torch.float32, 1), (torch.float32, 1), (torch.uint8, 32)],
    "q8s": [(torch.float32, 1), (torch.uint8, 2), (torch.uint8, 32)],
    "q4s": [(torch.float32, 1), (torch.float32, 1), (torch.uint8, 2), (torch.uint8, 2), (torch.uint8, 16)],
    "q4h": [(torch.float16, 1), (torch.float16, 1), (torch.uint8, 16)],
    "q4k": [(torch.float32, 1), (torch.float32, 1), (torch.uint8, 8), (torch.uint8, 8), (torch.uint8, 128)],
    "q6k": [(torch.float32, 1), (torch.uint8, 16), (torch.uint8, 128), (torch.uint8, 64)],
}


def _nibble_codes(pairs: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes [n, k] in input order from per-row nibble pairs (low nibble = input 2i, high = 2i + 1)."""
    pairs = pairs.reshape(n, k // 32, 16)
    return torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(n, k)


def _ext():
    ext = extension.load_kernel()
    if ext is None:
        raise RuntimeError("GGUF weights kept in their blocks need the CPU kernel, which could not be built")
    return ext


@dataclass
class QuantizedWeight:
    """A weight [N, K] as kernel records [N/16, K/32, bytes] (uint8), with the GGUF type(s) it came from."""

    records: torch.Tensor
    shape: tuple[int, int]
    source: str  # the GGUF type, e.g. "Q4_K", or "+"-joined types of a fused weight

    @property
    def kind(self) -> str:
        return KIND_OF_RECORD[self.records.shape[-1]]

    @property
    def nbytes(self) -> int:
        return self.records.numel()

    @staticmethod
    def supported(type_name: str, shape: tuple[int, ...]) -> bool:
        """Whether a GGUF tensor of this type and shape [N, K] becomes records (else it is loaded as float)."""
        return type_name in TYPE_IDS and len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 32 == 0

    @staticmethod
    def records_shape(type_name: str, rows: int, k: int) -> tuple[int, int, int]:
        """The record tensor's shape of ``rows`` rows of ``k`` inputs of GGUF type ``type_name``."""
        kind = KIND_OF_TYPE[type_name]
        return rows // 16, k // SPAN[kind], RECORD_BYTES[kind]

    @staticmethod
    def held_bytes(parts: list[tuple[str, tuple[int, int]]]) -> int:
        """Bytes held for a weight fused from ``parts`` (GGUF type, shape [N_i, K]), as :meth:`from_gguf` holds
        them (``plan`` counts with this, reading nothing but the file's header)."""
        shapes = [QuantizedWeight.records_shape(run[0][0], sum(p[1][0] for p in run), run[0][1][1])
                  for run in _runs_of_one_kind(parts)]  # fmt: skip
        return int(np.prod(shapes[0])) if len(shapes) == 1 else small_gemm.segment_bytes(shapes)

    @classmethod
    def from_gguf(cls, parts: list[tuple]) -> QuantizedWeight:
        """Records of the row-concatenation of ``parts``, each (type name, raw blocks [N_i, row bytes], shape
        [N_i, K]) and optionally the order to read its rows in: one part for a plain projection, several for a
        fused one (QKV, gate/up), written straight into one tensor; parts of different kinds keep their own, as
        a :class:`SegmentedWeight`."""
        if len({KIND_OF_TYPE[p[0]] for p in parts}) > 1:
            return SegmentedWeight.from_gguf(parts)
        return cls._repack(parts, torch.empty(cls._parts_shape(parts), dtype=torch.uint8))

    @staticmethod
    def _parts_shape(parts: list[tuple]) -> tuple[int, int, int]:
        return QuantizedWeight.records_shape(parts[0][0], sum(p[2][0] for p in parts), parts[0][2][1])

    @classmethod
    def _repack(cls, parts: list[tuple], records: torch.Tensor) -> QuantizedWeight:
        """``parts`` of one kind repacked into ``records`` (of :meth:`records_shape`)."""
        ext = _ext()
        n, k = sum(p[2][0] for p in parts), parts[0][2][1]
        row = 0
        for type_name, raw, shape, *order in parts:
            with warnings.catch_warnings():  # a read-only view of the mapped file: repack only reads it
                warnings.simplefilter("ignore", UserWarning)
                src = torch.from_numpy(np.ascontiguousarray(raw))
            order = order[0] if order else None
            rows = torch.empty(0, dtype=torch.long) if order is None else torch.from_numpy(np.asarray(order, np.int64))
            ext.repack_gguf(src, TYPE_IDS[type_name], rows, records[row // 16: (row + shape[0]) // 16])
            row += shape[0]
        return cls(records, (n, k), "+".join(p[0] for p in parts))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 rows (all by default), bitwise gguf's dequantisation of the source blocks."""
        if rows is None:
            rows = torch.arange(self.shape[0])
        return _ext().unpack_records(self.records, rows.reshape(-1).cpu())

    def select_rows(self, rows: torch.Tensor) -> QuantizedWeight | None:
        """The weight of rows ``rows`` (e.g. a drafter's vocabulary subset of an LM head) as records of the same
        kind, or None when their count is not a multiple of 16."""
        if rows.numel() % 16:
            return None
        fields = [f[rows.cpu()] for f in self._row_fields()]
        return QuantizedWeight(_join_fields(fields, self.kind), (rows.numel(), self.shape[1]), self.source)

    def _row_fields(self) -> list[torch.Tensor]:
        """The record fields per row: [N, K/32, count] tensors of each field's element type."""
        p, nb, _ = self.records.shape
        out, off = [], 0
        for dtype, count in FIELDS[self.kind]:
            size = torch.empty(0, dtype=dtype).element_size() * count * 16
            f = self.records[:, :, off: off + size].contiguous().view(dtype).reshape(p, nb, count, 16)
            out.append(f.permute(0, 3, 1, 2).reshape(p * 16, nb, count))
            off += size
        return out

    def int8_activation_records(self) -> torch.Tensor:
        """This weight for the int8-activation kernel (``linear_kernel="packed-int8act"``, kernels/int8_gemm.cpp):
        q4k, q6k and q4h keep their records' header (super-block scales, or the file's fp16 scale and minimum)
        followed by code lines the kernel multiplies as integers (4.75, 6.6 and 5 bits per weight, as their float
        records); q4 / q8 keep their codes; the other kinds are rounded once more, to Q8_0 (8-bit codes per 32
        inputs: at most ~0.56 of a step of a block's max|w| / 127 on top of the file's own rounding)."""
        n, k = self.shape
        if self.kind in ("q4k", "q4h"):
            lines = self.to_block_quantized().pack_int8_activations()[:, :, 2:]  # drop the per-32 d and m lines
            if self.kind == "q4h":
                return torch.cat([self.records[:, :, :64], lines.reshape(n // 16, k // 32, 256)], dim=-1).reshape(
                    n // 16, k // 32, -1, 64).contiguous()
            codes = lines.reshape(n // 16, k // 256, 8 * 4 * 64)
            header = self.records[:, :, :384]
            return torch.cat([header, codes], dim=-1).reshape(n // 16, k // 256, -1, 64).contiguous()
        if self.kind == "q6k":
            return self._q6k_int8_activation_records()
        bq = self.to_block_quantized() or int8_gemm.BlockQuantized.quantize_q8(self.dequantize())
        return bq.pack_int8_activations()

    def _q6k_int8_activation_records(self) -> torch.Tensor:
        """q6k for the int8-activation kernel: the record's header (d, the 16 sub-block scales), then per
        sub-block of 32 inputs the codes u = q + 32 as 4 lines of low nibbles (the Q4 layout) and 2 lines of their
        top 2 bits (line h, byte (j, t), bits 2s..2s+1: input 16 h + 4 s + t)."""
        n, k = self.shape
        nb = k // 32
        fields = self._row_fields()
        low = _nibble_codes(fields[2], n, k)
        high = fields[3].reshape(n, nb, 8)  # byte i of a sub-block: inputs 4i .. 4i+3, two bits each
        high = torch.stack([(high >> (2 * s)) & 3 for s in range(4)], dim=-1).reshape(n, k)
        lo = low.reshape(n // 16, 16, nb, 4, 2, 4)  # (panel, j, block, line g, half h, t): k = 32 b + 8 g + 4 h + t
        nibble_lines = (lo[..., 0, :] | (lo[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // 16, nb, 256)
        hi = high.reshape(n // 16, 16, nb, 2, 4, 4)  # (panel, j, block, line h, s, t): k = 32 b + 16 h + 4 s + t
        top_lines = (hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6))
        top_lines = top_lines.permute(0, 2, 3, 1, 4).reshape(n // 16, nb, 128)
        codes = torch.cat([nibble_lines, top_lines], dim=-1).reshape(n // 16, k // 256, 8 * 384)
        return torch.cat([self.records[:, :, :320], codes], dim=-1).reshape(n // 16, k // 256, -1, 64).contiguous()

    def to_block_quantized(self) -> int8_gemm.BlockQuantized | None:
        """The q4 / q4k / q8 kinds as int8_gemm.BlockQuantized (for the int8-activation layout, whose blocks
        are 32 inputs with one scale and minimum); None for the others."""
        if self.kind not in ("q4", "q4h", "q4k", "q8"):
            return None
        fields = self._row_fields()
        n, k = self.shape
        if self.kind == "q4k":  # per sub-block of 32: scale d * sc, minimum -(dmin * mq), as gguf computes them
            scale = (fields[0] * fields[2].float()).reshape(n, k // 32)
            return int8_gemm.BlockQuantized("q4", _nibble_codes(fields[4], n, k), scale,
                                             -(fields[1] * fields[3].float()).reshape(n, k // 32))
        if self.kind in ("q4", "q4h"):
            scale, minimum = (f[..., 0].float().contiguous() for f in fields[:2])  # q4h: the file's fp16
            return int8_gemm.BlockQuantized("q4", _nibble_codes(fields[2], n, k), scale, minimum)
        q = fields[1].view(torch.int8).reshape(n, k)
        return int8_gemm.BlockQuantized("q8", q.contiguous(), fields[0][..., 0].contiguous())


@dataclass
class SegmentedWeight(QuantizedWeight):
    """A weight fused from parts whose GGUF types have different record kinds (Q4_K_M gives some layers' V a Q6_K
    beside Q4_K Q and K): each run of parts of one kind keeps its own records (``segments``, in rows order), all in
    one packed buffer (``records``, :func:`small_gemm.segment_buffer`) whose segments the kernel computes one by
    one. Nothing is widened to a common kind, so each part reads the bytes it would alone."""

    segments: list[QuantizedWeight] = field(default_factory=list)

    @classmethod
    def from_gguf(cls, parts: list[tuple]) -> SegmentedWeight:
        runs = _runs_of_one_kind(parts)
        buf, views = small_gemm.segment_buffer([QuantizedWeight._parts_shape(run) for run in runs], False)
        segments = [QuantizedWeight._repack(run, view) for run, view in zip(runs, views)]
        shape = (sum(s.shape[0] for s in segments), segments[0].shape[1])
        return cls(buf, shape, "+".join(p[0] for p in parts), segments)

    @property
    def kind(self) -> str:
        return "+".join(s.kind for s in self.segments)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        full = torch.cat([s.dequantize() for s in self.segments])
        return full if rows is None else full[rows.reshape(-1).cpu()]

    def select_rows(self, rows: torch.Tensor) -> None:
        return None  # only LM heads are cut to a vocabulary subset, and they are never fused

    def int8_activation_records(self) -> torch.Tensor:
        return small_gemm.join_segments([s.int8_activation_records() for s in self.segments], True)

    def to_block_quantized(self) -> None:
        return None


def _runs_of_one_kind(parts: list[tuple]) -> list[list[tuple]]:
    """``parts`` (each starting with its GGUF type name) grouped into consecutive runs of one record kind."""
    runs: list[list[tuple]] = []
    for part in parts:
        if runs and KIND_OF_TYPE[runs[-1][0][0]] == KIND_OF_TYPE[part[0]]:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def _join_fields(fields: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Inverse of QuantizedWeight._row_fields: per-row fields [N, K/32, count] -> records [N/16, K/32, bytes]."""
    n, nb = fields[0].shape[:2]
    parts = [f.reshape(n // 16, 16, nb, -1).permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(n // 16, nb, -1)
             for f in fields]  # fmt: skip
    out = torch.cat(parts, dim=-1).contiguous()
    assert out.shape[-1] == RECORD_BYTES[kind]
    return out
