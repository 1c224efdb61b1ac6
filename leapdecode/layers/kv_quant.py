"""INT8 KV cache planes, and the read/write helpers attention uses for any cache plane.

Layout. A quantized plane (one layer's K or V) is two tensors over the same slots::

    data[slot, kv_head, head_dim]   int8, symmetric, in [-127, 127]
    scale[slot, kv_head]            float16, = absmax(x[slot, kv_head, :]) / 127

One scale per token per KV head ("per-token-per-head"). Why this and not KIVI (keys per channel, values
per token): a per-channel key scale is a statistic over many tokens, so it is only final once a group of
tokens is complete; KIVI keeps the incomplete group in full precision and requantizes it. In a paged cache
whose blocks are filled one token at a time by decode, drafts and trees (and rolled back on rejection), that
needs a second, float residual cache and rewrites on every block boundary. A per-token scale is final the
moment the token is written, so writes stay a single scatter and rollback is free. The cost is precision for
keys with outlier channels; measured greedy agreement with float KV is in the issue report.

Bytes per token per KV head: ``head_dim`` int8 + 2 (the float16 scale) — for head_dim 64 that is 66 bytes
against 256 in float32 (3.88x) or 128 in float16 (1.94x).

Float caches stay plain tensors; the helpers below dispatch on the type, so the float path costs one type
check.
"""

from __future__ import annotations

import torch

QMAX = 127
SCALE_DTYPE = torch.float16
_SCALE_MAX = torch.finfo(SCALE_DTYPE).max
_TINY = 1e-12

KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}


def resolve_kv_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """``"auto"`` means the model's own dtype (the cache then stores exactly what attention computes with)."""
    if isinstance(kv_cache_dtype, torch.dtype):
        return kv_cache_dtype
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be 'auto' or one of {sorted(KV_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return KV_DTYPES[kv_cache_dtype]


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) takes for one KV head, including the int8 scale."""
    if dtype == torch.int8:
        return head_dim + torch.empty((), dtype=SCALE_DTYPE).element_size()
    return head_dim * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token across all layers: what one more token of context costs."""
    return 2 * num_layers * num_kv_heads * bytes_per_token_head(head_dim, dtype)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] float -> (int8 [..., D], float16 scale [...]); symmetric absmax over the last axis.

    The scale is rounded to float16 *before* dividing, so dequantization uses exactly the scale quantization
    assumed and the only error is the int8 rounding (<= scale / 2 per element).
    """
    amax = x.detach().abs().amax(dim=-1).float()
    scale = (amax / QMAX).clamp(max=_SCALE_MAX).to(SCALE_DTYPE)
    q = (x.float() / scale.float().clamp(min=_TINY).unsqueeze(-1)).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`, in ``dtype``."""
    return q.to(dtype) * scale.to(dtype).unsqueeze(-1)


class QuantizedKV:
    """One layer's K or V cache plane in int8 with per-(slot, kv_head) scales; see the module docstring.

    ``data`` and ``scale`` are views into the cache's pools, so writes land in the shared storage.
    """

    dtype = torch.int8

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        if data.dtype != torch.int8 or scale.shape != data.shape[:-1]:
            raise ValueError("QuantizedKV needs int8 data [slots, heads, dim] and scale [slots, heads]")
        self.data, self.scale = data, scale

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [T, Hkv, D] and store it at ``slots`` [T]."""
        q, s = quantize(x)
        self.data.index_copy_(0, slots, q)
        self.scale.index_copy_(0, slots, s)

    def read_range(self, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized slots start .. start+n-1 as [n, Hkv, D] in ``dtype``."""
        return dequantize(self.data[start : start + n], self.scale[start : start + n], dtype)

    def read_slots(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows at ``slots`` [N] as [N, Hkv, D] in ``dtype``."""
        return dequantize(self.data.index_select(0, slots), self.scale.index_select(0, slots), dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move cached rows (e.g. accepted tree nodes) without a requantization round trip."""
        self.data.index_copy_(0, dst, self.data.index_select(0, src))
        self.scale.index_copy_(0, dst, self.scale.index_select(0, src))


KVPlane = torch.Tensor | QuantizedKV


def write_kv(cache: KVPlane, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store new K or V rows x [T, Hkv, D] at ``slots`` in a float or int8 plane."""
    if isinstance(cache, torch.Tensor):
        cache.index_copy_(0, slots, x.to(cache.dtype))
    else:
        cache.write(slots, x)


def read_kv_range(cache: KVPlane, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Slots start .. start+n-1 as [n, Hkv, D]; a float plane of the same dtype returns a view (no copy)."""
    if isinstance(cache, torch.Tensor):
        return cache[start : start + n].to(dtype)
    return cache.read_range(start, n, dtype)


def read_kv_slots(cache: KVPlane, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows at ``slots`` [N] as [N, Hkv, D] (a gather)."""
    if isinstance(cache, torch.Tensor):
        return cache.index_select(0, slots).to(dtype)
    return cache.read_slots(slots, dtype)
