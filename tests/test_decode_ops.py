"""The decode-step C++ ops (kernels/decode_ops.cpp): RMSNorm and one token's paged attention equal torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leapdecode.layers import small_gemm

ext = small_gemm.load_kernel()
pytestmark = pytest.mark.skipif(ext is None, reason="no C++ toolchain to build the kernels")


@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 40), (100, 64)])  # 100 rows: the threaded (prefill) path
def test_rms_norm_matches_torch_and_rows_are_independent(rows: int, dim: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    y = small_gemm.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, F.rms_norm(x, (dim,), w, 1e-5), rtol=1e-5, atol=1e-6)
    assert torch.equal(small_gemm.rms_norm(x[-1:].contiguous(), w, 1e-5), y[-1:])
    xg = x.clone().requires_grad_()  # training keeps torch's differentiable op
    small_gemm.rms_norm(xg, w, 1e-5).sum().backward()
    assert xg.grad is not None


@pytest.mark.parametrize("n", [1, 15, 17, 200, 3000])  # 3000 x 3 query heads per KV head: the threaded path
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: a vector plus a scalar tail
@pytest.mark.parametrize("gather", [True, False])
def test_decode_attention_matches_sdpa(n: int, head_dim: int, gather: bool) -> None:
    g = torch.Generator().manual_seed(n + head_dim)
    hkv, group, num_slots = 3, 3, 4096
    k_cache = torch.randn(num_slots, hkv, head_dim, generator=g)
    v_cache = torch.randn(num_slots, hkv, head_dim, generator=g)
    q = torch.randn(hkv * group, head_dim, generator=g) * 2
    if gather:
        slots, start = torch.randperm(num_slots, generator=g)[:n], 0
    else:
        start = 100
        slots = torch.arange(start, start + n)
    scale = head_dim**-0.5
    got = small_gemm.decode_attention(q, k_cache, v_cache, start, slots if gather else torch.empty(0, dtype=torch.long),
                                      n, scale)
    kg, vg = k_cache[slots].transpose(0, 1).unsqueeze(0), v_cache[slots].transpose(0, 1).unsqueeze(0)
    want = F.scaled_dot_product_attention(q.view(1, hkv, group, head_dim), kg, vg, scale=scale).view_as(q)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
