"""AMX tiles for int8 activations (kernels/amx_int8.cpp): a NumPy model of how a tile multiply reads the records
(runs everywhere; it also checks the rows' int8 rounding, kernels/quantize_rows.cpp), and, where this CPU has
AMX-INT8, bitwise equality with the VNNI loop for every record kind and row count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leapdecode.kernels import extension
from leapdecode.layers import int8_gemm
from leapdecode.layers.block_formats import QuantizedWeight

from .test_block_formats import random_blocks

ext = extension.load_kernel()
# every int8-activation record kind: its source type, and how the record is made from it
KINDS = {"q4h": "Q4_1", "q8": "Q8_0", "q4k": "Q4_K", "q6k": "Q6_K", "q4": "Q4_K"}


def _records(kind: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8-activation records of kind ``kind`` for a random [n, k] weight, and the weight they hold."""
    qw = QuantizedWeight.from_gguf([(KINDS[kind], random_blocks(KINDS[kind], n, k, seed), (n, k))])
    if kind == "q4":  # Q4_K's per-32 form (BlockQuantized "q4")
        bq = qw.to_block_quantized()
        return bq.pack_int8_activations(), bq.dequantize()
    packed = qw.int8_activation_records()
    assert int8_gemm.A8_KIND_OF_LINES[packed.shape[2]] == kind
    return packed, qw.dequantize()


def _quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] as int8 codes per 32 inputs and their scales [M, K/32] (the kernel's rounding, in float32)."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.rint(xb * inv).astype(np.int8).reshape(x.shape), (amax / np.float32(127))[..., 0]


def _b_rows(kind: str, rec: np.ndarray, sb: int) -> np.ndarray:
    """A block's weight codes as tile B rows [8, 64] (u8): row kk holds inputs 4kk .. 4kk+3 of each output j at
    bytes 4j .. 4j+3, read from the record's code lines as amx_int8.cpp reads them."""
    if kind == "q8":
        return rec[1:9]
    if kind == "q6k":
        lines = rec[5 + 6 * sb: 11 + 6 * sb]
        low = np.stack([lines[kk // 2] >> (4 * (kk % 2)) & 15 for kk in range(8)])
        top = np.stack([lines[4 + kk // 4] >> (2 * (kk % 4)) & 3 for kk in range(8)])
        return low | top << 4
    first = {"q4": 2, "q4h": 1, "q4k": 6 + 4 * sb}[kind]
    lines = rec[first: first + 4]
    return np.stack([lines[kk // 2] >> (4 * (kk % 2)) & 15 for kk in range(8)])


def _tile_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """TDPBSUD: C[m, j] = sum over rows kk of B and t < 4 of A[m, 4kk + t] (s8) * B[kk, 4j + t] (u8), exactly."""
    return np.einsum("mkt,kjt->mj", a.reshape(a.shape[0], -1, 4).astype(np.int64),
                     b.reshape(b.shape[0], 16, 4).astype(np.int64))


def _header(kind: str, rec: np.ndarray, sb: int) -> tuple[np.ndarray, np.ndarray]:
    """The 16 outputs' scale and minimum of sub-block sb (q6k: its two int8 half scales, no minimum)."""
    f32 = rec[:2].reshape(-1).view(np.float32).astype(np.float64)
    if kind == "q4h":
        half = rec[0].view(np.float16).astype(np.float64)
        return half[:16], half[16:]
    if kind == "q4k":
        flat = rec.reshape(-1)
        return f32[:16] * flat[128 + 16 * sb: 144 + 16 * sb], -(f32[16:] * flat[256 + 16 * sb: 272 + 16 * sb])
    if kind == "q6k":
        sc = rec.reshape(-1)[64 + 32 * sb: 96 + 32 * sb].view(np.int8).astype(np.float64).reshape(2, 16)
        return f32[:16] * sc, np.zeros(16)
    return f32[:16], (f32[16:] if kind == "q4" else np.zeros(16))


def _emulated(kind: str, packed: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y of the int8-activation definition computed from tile-model integer sums of the records, in float64."""
    xq, dx = _quantize(x)
    super_block = kind in ("q4k", "q6k")
    y = np.zeros((x.shape[0], packed.shape[0] * 16))
    for p in range(packed.shape[0]):
        for b in range(x.shape[1] // 32):
            rec, sb = (packed[p, b // 8], b % 8) if super_block else (packed[p, b], 0)
            a, brows = xq[:, 32 * b: 32 * b + 32], _b_rows(kind, rec, sb)
            scale, minimum = _header(kind, rec, sb)
            xsum = a.astype(np.int64).sum(1, keepdims=True)
            if kind == "q6k":  # each half of 16 inputs: sum(u * x) - 32 sum(x), weighed by its own int8 scale
                part = sum((_tile_dot(a[:, 16 * h: 16 * h + 16], brows[4 * h: 4 * h + 4])
                            - 32 * a[:, 16 * h: 16 * h + 16].astype(np.int64).sum(1, keepdims=True)) * scale[h]
                           for h in range(2))
            else:
                isum = _tile_dot(a, brows) - (128 * xsum if kind == "q8" else 0)
                part = isum * scale + xsum * minimum
            y[:, 16 * p: 16 * p + 16] += part * dx[:, b: b + 1]
    return y


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_tile_model_of_the_records_gives_the_int8_activation_product(kind: str) -> None:
    """Reading a record's code lines as tile B rows (Q8 as stored; nibbles and Q6_K's top bits unpacked) gives
    each block's integer sums, hence the int8-activation product of the weights the records hold."""
    n, k = 32, 512
    packed, w = _records(kind, n, k, seed=11)
    x = np.random.default_rng(3).standard_normal((5, k)).astype(np.float32)
    x[2, 64:96] = 0.0
    xq, dx = _quantize(x)
    ref = (xq.astype(np.float64).reshape(5, -1, 32) * dx[..., None]).reshape(5, k) @ w.double().numpy().T
    got = _emulated(kind, packed.numpy(), x)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


@pytest.mark.skipif(ext is None, reason="the CPU kernels are not built here")
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_int8_rounding_is_the_definition_however_many_rows_are_rounded_together(kind: str) -> None:
    """The rows of x are rounded to int8 a group of blocks at a time (16 with AVX-512, 8 with AVX2) and block by
    block for the rest: a row alone (24 blocks: with AVX-512 a group and 8 single blocks) and 70 rows together
    (every block in a group) give bitwise the same products, which are the definition's (the NumPy model's codes and
    integer sums, in float64). test_int8_activations covers rows of 18 blocks, with single blocks on both."""
    packed, _ = _records(kind, 32, 768, seed=2)
    x = torch.randn(70, 768, generator=torch.Generator().manual_seed(6)) * torch.logspace(-2, 1, 70).view(-1, 1)
    x[3, 512:544] = 0.0  # an all-zero block, inside a group of 16 when the rows are rounded together
    together = ext.a8_linear(x, packed, amx_rows=0)
    alone = torch.cat([ext.a8_linear(x[i : i + 1].contiguous(), packed, amx_rows=0) for i in range(70)])
    assert torch.equal(together, alone)
    ref = _emulated(kind, packed.numpy(), x.numpy())
    # a code off by one moves its product by ~1e-3 of the largest output; float32 sums stay within ~1e-6
    err = np.abs(together.double().numpy() - ref) / np.abs(ref).max(axis=1, keepdims=True)
    assert float(err.max()) < 1e-5


needs_amx = pytest.mark.skipif(ext is None or not ext.a8_amx_available(),
                               reason="no AMX-INT8 tiles on this CPU (or the OS does not grant them)")


@needs_amx
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_amx_tiles_are_bitwise_the_vnni_loop_for_every_row_count(kind: str) -> None:
    n, k = 48, 512
    packed, _ = _records(kind, n, k, seed=5)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 1, 70).view(-1, 1)
    x[9, 32:64] = 0.0  # an all-zero block of x
    vnni = ext.a8_linear(x, packed, amx_rows=0)
    for m in range(1, 71):
        assert torch.equal(ext.a8_linear(x[:m].contiguous(), packed, amx_rows=1), vnni[:m]), m
    assert torch.equal(ext.a8_linear(x[17:50].contiguous(), packed, amx_rows=1), vnni[17:50])


@needs_amx
def test_amx_row_setting_is_checked_and_reported() -> None:
    before = ext.a8_amx_rows()
    try:
        ext.set_a8_amx_rows(5)
        assert ext.a8_amx_rows() == 5
        with pytest.raises(RuntimeError, match="rows must be >= 0"):
            ext.set_a8_amx_rows(-1)
    finally:
        ext.set_a8_amx_rows(before)


@needs_amx
def test_start_up_measurement_sets_the_threshold() -> None:
    packed, _ = _records("q4h", 64, 512, seed=1)
    before = ext.a8_amx_rows()
    try:
        rows = int8_gemm.choose_amx_rows([packed], repeats=1)
        assert rows in (0, *int8_gemm.AMX_PROBE_ROWS) and ext.a8_amx_rows() == int8_gemm.amx_rows() == rows
    finally:
        ext.set_a8_amx_rows(before)
