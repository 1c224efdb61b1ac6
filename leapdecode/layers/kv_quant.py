"""INT8 KV cache planes, and the read/write helpers attention uses for any cache plane.

Layout. A quantized plane (one layer's K or V) is two tensors over the same slots::

    data[slot, kv_head, :]   int8 in [-127, 127]  = round((x @ R) / scale)
    scale[slot, kv_head]     float16              = absmax(x @ R) / 127

``R`` is a fixed orthogonal ``head_dim x head_dim`` rotation (a Hadamard matrix with random signs; a seeded
random orthogonal matrix when head_dim is not a power of two), shared by every plane of the cache.

Why per token per head: a scale that is final the moment its token is written keeps a write one scatter and
makes rollback of rejected drafts free. KIVI-style per-channel key scales are statistics over a group of tokens,
so they need a float residual for the open group and requantization on every group boundary -- heavy in a
paged cache filled token by token by decode, drafts and trees.

Why the rotation: per-token absmax quantization wastes levels when one channel dominates a row (keys have such
channels). Rotating spreads every row's energy evenly over the channels (the QuaRot/QuIP trick), so the absmax is
close to the row's RMS and the rounding error shrinks. It is free at attention time: ``q.k = (qR).(kR)`` and
``sum p v = (sum p vR) R^T``, so attention rotates the few new query rows, attends in the rotated basis, and
rotates the output back -- the long cached context is never un-rotated. Measured on SmolLM2-135M (24 MT-Bench
prompts, teacher-forced next-token KL against the float32 cache): per-token int8 1.0e-3; with the rotation
2.4e-4 (top-1 agreement 98.0% -> 99.3%; bfloat16 KV: 2.9e-5 / 99.7%).

Bytes per token per KV head: ``head_dim`` int8 + 2 (the float16 scale): for head_dim 64, 66 bytes against
256 in float32 (3.88x) or 128 in float16 (1.94x). ``R`` is one small matrix per cache.

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
    return q.to(dtype).mul_(scale.to(dtype).unsqueeze(-1))  # in place: one context-sized buffer, not two


def rotation_matrix(dim: int, device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    """Orthogonal [dim, dim] float32 ``R`` (``R @ R.T = I``): a random-sign Hadamard matrix for power-of-two
    ``dim``, else the Q of a seeded Gaussian matrix. Deterministic, so a cache can be rebuilt identically."""
    gen = torch.Generator().manual_seed(seed)
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1
        r = signs.unsqueeze(1) * h / dim**0.5
    else:
        r, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen))
    return r.to(device)


class QuantizedKV:
    """One layer's K or V cache plane in int8 with per-(slot, kv_head) scales; see the module docstring.

    ``data`` and ``scale`` are views into the cache's pools, so writes land in the shared storage. With a
    ``rotation`` R, :meth:`write` takes rows in the model's basis and stores ``x @ R``; the reads return the
    *rotated* basis (what attention consumes); :meth:`unrotate` maps such rows back.
    """

    dtype = torch.int8

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, rotation: torch.Tensor | None = None) -> None:
        if data.dtype != torch.int8 or scale.shape != data.shape[:-1]:
            raise ValueError("QuantizedKV needs int8 data [slots, heads, dim] and scale [slots, heads]")
        if rotation is not None and rotation.shape != (data.shape[-1],) * 2:
            raise ValueError(f"rotation must be [{data.shape[-1]}, {data.shape[-1]}]")
        self.data, self.scale, self.rotation = data, scale, rotation

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rows read from this plane, back in the model's basis."""
        return x if self.rotation is None else (x.float() @ self.rotation.T).to(x.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [T, Hkv, D] (model basis) and store it at ``slots`` [T]."""
        q, s = quantize(x if self.rotation is None else x.float() @ self.rotation)
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
