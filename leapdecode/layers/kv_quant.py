"""INT8 KV cache planes, and the read/write helpers attention uses for any cache plane.

Layout. A quantized plane (one layer's K or V) is two tensors over the same slots::

    data[slot, kv_head, :]       int8 in [-127, 127]  = round(y / scale[group])       y = T(x), below
    scale[slot, kv_head, group]  float16              = absmax(y[16 channels of the group]) / 127

so a token's 64-channel head row costs 64 bytes plus four float16 scales: 72 bytes against 256 in float32
(3.56x) or 128 in float16. ``T`` maps a row into the basis the cache stores:

    values:  T(v) = v @ R
    keys:    T(k) = ((k - mu) / s) @ R            mu, s: per layer, KV head and channel (calibrated; 0 and 1 by default)

``R`` is a fixed orthogonal ``head_dim x head_dim`` rotation (a Hadamard matrix with random signs; a seeded
random orthogonal matrix when head_dim is not a power of two), shared by every plane of the cache.

Why per token: a scale that is final the moment its token is written keeps a write one scatter and makes
rollback of rejected drafts free. KIVI-style per-channel key scales are statistics over a group of tokens, so
they need a float residual for the open group and requantization on every group boundary -- heavy in a paged
cache filled token by token by decode, drafts and trees. The calibrated ``mu`` and ``s`` buy most of what
per-channel scales buy, as constants known before the first token:

- ``R`` (the QuaRot/QuIP trick): per-token absmax wastes levels when one channel dominates a row; rotating
  spreads every row's energy over the channels, so the absmax is close to the row's RMS.
- ``mu``: keys share a large per-channel offset across tokens (post-RoPE keys of the slow-rotating channels
  barely move), which sets every row's absmax while carrying no information: ``q.(k - mu) = q.k - q.mu`` shifts a
  query's scores over all keys by the same amount, and softmax ignores that -- so the cache stores ``k - mu`` and
  nothing ever adds ``mu`` back.
- ``s`` (SmoothQuant's migration, here between K and Q): channels whose keys vary most are divided by
  ``s = sqrt(range)`` (normalised to mean 1) and the queries multiplied by it, so ``(q s).(k / s) = q.k``.
- groups of 16 channels per scale: one large rotated channel costs only its group resolution.

Attention maps the few new query rows into the cache basis (:meth:`QuantizedKV.query_to_cache_basis`: ``(q s)
@ R``), attends there, and rotates the output back (``sum p vR = (sum p v) R``) -- the long cached context is
never transformed back. Keys are the sensitive half: with K kept in float32 and V in int8 the teacher-forced KL
falls ~9x. Measured on SmolLM2-135M (16 MT-Bench prompts x 64 greedy tokens, teacher-forced next-token KL
against the float32 cache): per-token int8 1.0e-3; rotated 2.4e-4; rotated + calibrated mu + 16-channel groups
1.05e-4; + smoothing s 7.4e-5 (top-1 agreement 99.9%). Calibration (engine/kv_calibration.py) runs at start-up.

On CPU the write is one C++ call (``int8_kv.quantize_kv_rows``, the same arithmetic) and decode rows attend
through ``attention_rows.attention_rows_i8``, which reads the int8 rows directly (kernels/attention_rows_i8.cpp).

Float caches stay plain tensors; the helpers below dispatch on the type, so the float path costs one type
check.
"""

from __future__ import annotations

import torch

from leapdecode.layers import int8_kv

QMAX = 127
GROUP = 16  # channels per int8 scale
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


def scale_groups(head_dim: int) -> int:
    """int8 scales per token and head: one per GROUP channels (one per row when head_dim is not a multiple)."""
    return head_dim // GROUP if head_dim % GROUP == 0 else 1


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) takes for one KV head, including the int8 scales."""
    if dtype == torch.int8:
        return head_dim + scale_groups(head_dim) * torch.empty((), dtype=SCALE_DTYPE).element_size()
    return head_dim * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token across all layers: what one more token of context costs."""
    return 2 * num_layers * num_kv_heads * bytes_per_token_head(head_dim, dtype)


def quantize(x: torch.Tensor, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] float -> (int8 [..., D], float16 scale [..., groups]); symmetric absmax over each group of
    ``D / groups`` consecutive channels (default :func:`scale_groups`).

    The scale is rounded to float16 *before* dividing, so dequantization uses exactly the scale quantization
    assumed and the only error is the int8 rounding (<= scale / 2 per element).
    """
    d = x.shape[-1]
    groups = scale_groups(d) if groups is None else groups
    xg = x.detach().float().reshape(*x.shape[:-1], groups, d // groups)
    scale = (xg.abs().amax(dim=-1) / QMAX).clamp(max=_SCALE_MAX).to(SCALE_DTYPE)
    q = (xg / scale.float().clamp(min=_TINY).unsqueeze(-1)).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`, in ``dtype``."""
    out = q.to(dtype)
    groups = scale.shape[-1]
    # in place on the grouped view: one context-sized buffer, not two
    out.view(*q.shape[:-1], groups, q.shape[-1] // groups).mul_(scale.to(dtype).unsqueeze(-1))
    return out


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
    """One layer's K or V cache plane in int8 with per-(slot, kv_head, group) scales; see the module docstring.

    ``data`` and ``scale`` are views into the cache's pools, so writes land in the shared storage. :meth:`write`
    takes rows in the model's basis and stores ``T(x)``; the reads return that *cache* basis (what attention
    consumes): queries enter it through :meth:`query_to_cache_basis` (key planes), outputs leave it through
    :meth:`unrotate` (value planes). ``shift`` (mu) and ``smooth`` (s), [kv_heads, head_dim], make a key plane;
    they are views the cache's calibration updates in place, and must not change while the plane holds tokens.
    """

    dtype = torch.int8

    def __init__(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        rotation: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
        smooth: torch.Tensor | None = None,
        rotation_t: torch.Tensor | None = None,
    ) -> None:
        if data.dtype != torch.int8 or data.dim() != 3 or scale.shape[:-1] != data.shape[:-1]:
            raise ValueError("QuantizedKV needs int8 data [slots, heads, dim] and scale [slots, heads, groups]")
        if data.shape[-1] % scale.shape[-1]:
            raise ValueError(f"{scale.shape[-1]} scale groups do not divide head_dim {data.shape[-1]}")
        for name, r in (("rotation", rotation), ("rotation_t", rotation_t)):
            if r is not None and r.shape != (data.shape[-1],) * 2:
                raise ValueError(f"{name} must be [{data.shape[-1]}, {data.shape[-1]}]")
        if rotation_t is not None and rotation is None:
            raise ValueError("rotation_t is the rotation's transpose: give the rotation too")
        for name, t in (("shift", shift), ("smooth", smooth)):
            if t is not None and t.shape != data.shape[1:]:
                raise ValueError(f"{name} must be [kv_heads, head_dim] = {list(data.shape[1:])}")
        self.data, self.scale, self.rotation = data, scale, rotation
        # R^T, contiguous, for the outputs' way back (unrotate): given by a cache whose planes share one R, else made
        if rotation is not None and rotation_t is None:
            rotation_t = rotation.T.contiguous()
        self.rotation_t = rotation_t
        self.shift, self.smooth = shift, smooth
        # calibration: while a dict, write() accumulates per-channel statistics of the rows it is given
        self.observed: dict[str, torch.Tensor] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def to_cache_basis(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x [T, Hkv, D] (model basis) as stored, before rounding: ``((x - mu) / s) @ R`` in float32."""
        x = x.float()
        if self.shift is not None:
            x = x - self.shift
        if self.smooth is not None:
            x = x / self.smooth
        return x if self.rotation is None else x @ self.rotation

    def query_to_cache_basis(self, q: torch.Tensor) -> torch.Tensor:
        """Query rows q [T, H, D] mapped so that their dot product with stored keys equals ``q.(k - mu)``:
        ``(q s) @ R`` (the H query heads share the Hkv scale rows in groups, as they share KV heads)."""
        x = q.float()
        if self.observed is not None:  # calibration also needs the queries' per-channel energy
            g = x.view(q.shape[0], self.data.shape[1], -1, q.shape[-1])
            self.observed["q_count"] += g.shape[0] * g.shape[2]
            self.observed["q_sumsq"] += g.square().sum((0, 2))
        if int8_kv.int8_kv_kernels(self) and q.dtype == torch.float32:  # the fused C++ layer's own routine
            return int8_kv.rotate_rows(x, self.smooth, self.rotation, transpose=False)
        if self.smooth is not None:
            x = (x.view(q.shape[0], self.smooth.shape[0], -1, q.shape[-1]) * self.smooth.unsqueeze(1)).view(q.shape)
        return (x if self.rotation is None else x @ self.rotation).to(q.dtype)

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rows read from a value plane (or attention outputs over them), back in the model's basis."""
        if self.rotation is None:
            return x
        if int8_kv.int8_kv_kernels(self) and x.dtype == torch.float32 and x.dim() == 3:
            return int8_kv.rotate_rows(x, None, self.rotation_t, transpose=False)
        return (x.float() @ self.rotation.T).to(x.dtype)

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [T, Hkv, D] (model basis) and store it at ``slots`` [T]."""
        if self.observed is not None:
            self._observe(x)
        if int8_kv.int8_kv_kernels(self):  # the same arithmetic in one C++ call instead of ~12 torch ops
            int8_kv.quantize_kv_rows(x, self, slots.to(torch.long).contiguous())
            return
        q, s = quantize(self.to_cache_basis(x), self.scale.shape[-1])
        self.data.index_copy_(0, slots, q)
        self.scale.index_copy_(0, slots, s)

    def _observe(self, x: torch.Tensor) -> None:
        xf, obs = x.detach().float(), self.observed
        assert obs is not None
        obs["count"] += xf.shape[0]
        obs["sum"] += xf.sum(0)
        obs["sumsq"] += xf.square().sum(0)
        obs["max"] = torch.maximum(obs["max"], xf.amax(0))
        obs["min"] = torch.minimum(obs["min"], xf.amin(0))

    def start_observing(self) -> None:
        """Begin accumulating per-channel statistics of the rows written and of the queries mapped into this
        plane's basis (calibration)."""
        z = torch.zeros(self.data.shape[1:], device=self.data.device)
        self.observed = {"count": torch.zeros((), device=z.device), "sum": z.clone(), "sumsq": z.clone(),
                         "max": torch.full_like(z, -torch.inf), "min": torch.full_like(z, torch.inf),
                         "q_count": torch.zeros((), device=z.device), "q_sumsq": z.clone()}

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
