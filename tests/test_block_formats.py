"""GGUF weights kept in their blocks: every supported type repacked into kernel records, rebuilt bitwise as gguf
dequantises it, and multiplied by the few-row kernel bitwise as the float32 panels of the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from leapdecode.kernels import extension
from leapdecode.layers import int8_gemm, small_gemm
from leapdecode.layers.block_formats import KIND_OF_TYPE, KINDS, TYPE_IDS, QuantizedWeight

pytestmark = pytest.mark.skipif(extension.load_kernel() is None, reason="CPU kernel unavailable")

# byte offsets of each block's fp16 scale fields: random bytes elsewhere are valid codes and packed sub-scales
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
               "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}  # fmt: skip


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF blocks [n, row bytes] of random codes and sub-scales with sane fp16 scales."""
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in HALF_FIELDS[type_name]:
        scales = (rng.uniform(0.002, 0.05, size=(n, k // block)) * rng.choice([-1, 1], size=(n, k // block)))
        raw[..., off: off + 2] = scales.astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def reference(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[type_name]), np.float32).reshape(shape))


@pytest.mark.parametrize("type_name", sorted(KIND_OF_TYPE))
def test_records_rebuild_gguf_weights_and_kernel_matches_float_panels(type_name):
    n, k = 48, 512
    raw = random_blocks(type_name, n, k, seed=len(type_name))
    ref = reference(type_name, raw, (n, k))
    qw = QuantizedWeight.from_gguf([(type_name, raw, (n, k))])
    assert qw.kind == KIND_OF_TYPE[type_name] and qw.shape == (n, k)
    assert torch.equal(qw.dequantize(), ref)
    rows = torch.tensor([5, 0, 47, 16])
    assert torch.equal(qw.dequantize(rows), ref[rows])
    panels = small_gemm.pack(ref)
    g = torch.Generator().manual_seed(0)
    for m in (1, 2, 5, 8, 9, 16, 17, 64):
        x = torch.randn(m, k, generator=g)
        y = small_gemm.packed_linear(x, qw.records, None)
        assert torch.equal(y, small_gemm.packed_linear(x, panels, None)), (type_name, m)
        bound = 1e-5 * (x.abs().double() @ ref.abs().double().T) + 1e-6  # float32 summation error, generously
        assert ((y.double() - x.double() @ ref.double().T).abs() <= bound).all(), (type_name, m)
        assert torch.equal(y[:1], small_gemm.packed_linear(x[:1], qw.records, None))  # row-count invariant


def test_fused_parts_of_different_kinds_keep_their_own_records():
    """A fused weight whose parts differ in kind is segments of each part's own records: bitwise the float32
    result of the joined weight, at the bytes of its parts, and its int8-activation form is the parts' own."""
    k = 256
    order = np.random.default_rng(0).permutation(16)  # a part read in another row order (llama.cpp's Q/K)
    parts = [("Q4_K", random_blocks("Q4_K", 32, k, 1), (32, k)), ("Q4_K", random_blocks("Q4_K", 16, k, 4), (16, k)),
             ("Q6_K", random_blocks("Q6_K", 16, k, 2), (16, k)),
             ("Q5_0", random_blocks("Q5_0", 16, k, 3), (16, k), order)]  # fmt: skip
    qw = QuantizedWeight.from_gguf(parts)
    ref = torch.cat([reference(*p[:3]) for p in parts[:3]] + [reference(*parts[3][:3])[order]])
    assert qw.kind == "q4k+q6k+q8" and qw.source == "Q4_K+Q4_K+Q6_K+Q5_0"
    assert qw.nbytes == QuantizedWeight.held_bytes([(p[0], p[2]) for p in parts])
    assert qw.nbytes < 512 + sum(QuantizedWeight.held_bytes([(p[0], p[2])]) for p in parts)
    assert torch.equal(qw.dequantize(), ref) and torch.equal(qw.dequantize(torch.tensor([40, 3, 79])), ref[[40, 3, 79]])
    x = torch.randn(3, k)
    panels = small_gemm.pack(ref)
    assert torch.equal(small_gemm.packed_linear(x, qw.records, None), small_gemm.packed_linear(x, panels, None))
    int8 = qw.int8_activation_records()
    alone = [QuantizedWeight.from_gguf(parts[:2]), QuantizedWeight.from_gguf(parts[2:3]),
             QuantizedWeight.from_gguf(parts[3:])]
    y = torch.cat([small_gemm.packed_linear(x, a.int8_activation_records(), None) for a in alone], dim=1)
    assert torch.equal(small_gemm.packed_linear(x, int8, None), y)
    assert int8_gemm.int8_activation_layout(int8) and not int8_gemm.int8_activation_layout(qw.records)
    assert [tuple(s.shape) for s in small_gemm.segments_of(int8)] == [(3, 1, 38, 64), (1, 1, 53, 64), (1, 8, 9, 64)]
    assert qw.select_rows(torch.arange(16)) is None
    same = QuantizedWeight.from_gguf(parts[:1] * 2)  # parts of one kind keep it
    assert same.kind == "q4k" and torch.equal(same.dequantize(), torch.cat([ref[:32], ref[:32]]))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q2_K"])
def test_select_rows_keeps_the_kind(type_name):
    n, k = 64, 256
    raw = random_blocks(type_name, n, k, seed=7)
    qw = QuantizedWeight.from_gguf([(type_name, raw, (n, k))])
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:32]
    sub = qw.select_rows(rows)
    assert sub.kind == qw.kind and torch.equal(sub.dequantize(), qw.dequantize(rows))
    assert qw.select_rows(rows[:5]) is None


@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0", "Q8_0", "Q5_0"])
def test_int8_activation_layout_from_records(type_name):
    n, k = 32, 256
    raw = random_blocks(type_name, n, k, seed=3)
    qw = QuantizedWeight.from_gguf([(type_name, raw, (n, k))])
    bq = qw.to_block_quantized()
    assert torch.equal(bq.dequantize(), qw.dequantize())


@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0", "Q8_0", "Q5_K"])
def test_int8_activation_records_match_their_q4_or_q8_form(type_name):
    """Q4_K's own int8-activation layout (super-block header kept) gives bitwise what its per-32 Q4 form gives;
    kinds the kernel has no integer form of are rounded to Q8_0 once more: half a step of each block's
    max|w| / 127, plus the fp16 rounding of that step (gguf's own Q8_0)."""
    n, k = 32, 512
    qw = QuantizedWeight.from_gguf([(type_name, random_blocks(type_name, n, k, seed=9), (n, k))])
    packed = qw.int8_activation_records()
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(2))
    y = small_gemm.packed_linear(x, packed, None)
    for m in (1, 3, 7):
        assert torch.equal(small_gemm.packed_linear(x[:m], packed, None), y[:m])
    if type_name == "Q4_K":
        assert packed.shape == (n // 16, k // 256, 38, 64)
        assert torch.equal(y, small_gemm.packed_linear(x, qw.to_block_quantized().pack_int8_activations(), None))
    bq = qw.to_block_quantized() or int8_gemm.BlockQuantized.quantize_q8(qw.dequantize())
    w = qw.dequantize().reshape(n, k // 32, 32)
    err = (bq.dequantize().reshape(n, k // 32, 32) - w).abs()
    assert (err <= w.abs().amax(-1, keepdim=True) * (0.5 + 127 / 2048) / 127 + 1e-7).all()


def _int8_activation_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The int8-activation definition: x rounded to int8 per 32 inputs (scale max|x| / 127), times the weights
    in float64."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(xb * (127 / amax)), torch.zeros_like(xb))
    return (q.double() * (amax / 127).double()).reshape(m, k) @ w.double().T


@pytest.mark.parametrize(("type_name", "lines", "span"), [("Q6_K", 53, 256), ("Q4_0", 5, 32), ("Q4_1", 5, 32)])
def test_int8_activation_layouts_keep_the_files_own_codes(type_name, lines, span):
    """Q6_K (6-bit codes, an int8 scale per 16 inputs) and Q4_0/Q4_1 (fp16 scales) are multiplied in their own
    form, with no second rounding of the weights: the result is the definition's up to float32 sums, and each
    row's is the same whatever the batch. The layout holds as many bytes as the float records."""
    n, k = 48, 512
    qw = QuantizedWeight.from_gguf([(type_name, random_blocks(type_name, n, k, seed=5), (n, k))])
    packed = qw.int8_activation_records()
    assert packed.shape == (n // 16, k // span, lines, 64) and packed.numel() == qw.records.numel()
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 1, 11).view(-1, 1)
    x[3, 32:64] = 0.0  # an all-zero block of x
    y = small_gemm.packed_linear(x, packed, None)
    ref = _int8_activation_reference(x, qw.dequantize())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for m in (1, 3, 8, 9):
        assert torch.equal(small_gemm.packed_linear(x[:m], packed, None), y[:m])
    assert int8_gemm.A8_KIND_OF_LINES[lines] == qw.kind


def test_python_and_kernel_agree_on_each_types_record_kind():
    """The loader plans with KIND_OF_TYPE (``plan`` needs no kernel); the kernel repacks by its own table."""
    ext = extension.load_kernel()
    for type_name, kind in KIND_OF_TYPE.items():
        assert ext.natural_kind(TYPE_IDS[type_name]) == KINDS.index(kind), type_name
    assert ext.natural_kind(0) == -1  # F32 is no record kind
