"""Rotary position embedding (RoPE) with the config's theta and scaling (default, linear, dynamic-free llama3)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # on the CPU whatever the default device: the tables are computed once, then moved (a model built on the meta
    # device would otherwise send these ops through torch's reference implementations, ~1 s of imports)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "freq_factors":  # a GGUF file's rope_freqs: one divisor per frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float64, device="cpu")
        if factors.numel() != inv.numel():
            raise ValueError(f"{factors.numel()} RoPE frequency factors for {inv.numel()} frequencies")
        return inv / factors
    if kind == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        lo_wavelen, hi_wavelen = old_ctx / lo, old_ctx / hi
        scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, and a GGUF "
                     "file's frequency factors)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (the "rotate half" convention of HF Llama).

    ``rotate_half(x) = cat(-x2, x1)`` equals ``roll(x, d/2) * [-1.., +1..]``, so the table stores sin with that
    sign folded in: rotating is then ``x * cos + roll(x) * sin_signed``, three ops instead of seven, which matters
    because a batch-1 decode step on a CPU is dominated by per-op overhead once the weights are read.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float64, device="cpu")
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        sign = torch.cat([-torch.ones(head_dim // 2, device="cpu"), torch.ones(head_dim // 2, device="cpu")]).double()
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin_signed", (emb.sin() * sign).float(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sign-folded sin) rows for ``positions``, shaped [T, 1, d] to broadcast over heads; computed once
        per forward and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Apply RoPE to x [..., T, heads, d] (any number of heads: q and k may be rotated together)."""
    cos, sin_signed = cos_sin
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, d], k: [T, kv_heads, d]."""
    return rotate(q, cos_sin), rotate(k, cos_sin)
