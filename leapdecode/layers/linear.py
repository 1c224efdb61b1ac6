"""Shard-aware linear layers and embeddings.

With tensor-parallel size 1 these are plain ``F.linear`` / ``F.embedding``. Each parameter carries
``shard_dim`` (which dimension a rank slices, or None for replicated) so the loader can cut a full checkpoint tensor
into this rank's piece; fused layers (QKV, gate+up) record the sizes of their parts in ``shard_parts`` so each
part is cut separately before concatenation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leapdecode.layers import small_gemm
from leapdecode.parallel import all_gather_last_dim, all_reduce, divide, tp_rank, tp_size


def shard_tensor(full: torch.Tensor, shard_dim: int | None, parts: list[int] | None = None) -> torch.Tensor:
    """This rank's piece of a full checkpoint tensor (each fused part is split separately)."""
    if shard_dim is None or tp_size() == 1:
        return full
    if parts is None:
        parts = [full.shape[shard_dim]]
    pieces = []
    for chunk in torch.split(full, parts, dim=shard_dim):
        n = divide(chunk.shape[shard_dim], tp_size(), "sharded dimension")
        pieces.append(chunk.narrow(shard_dim, tp_rank() * n, n))
    return torch.cat(pieces, dim=shard_dim)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), with W's output rows split across ranks; the output stays sharded."""

    def __init__(self, in_features: int, out_parts: list[int], bias: bool = False) -> None:
        super().__init__()
        self.out_parts = [divide(p, tp_size(), "output features") for p in out_parts]
        self.weight = nn.Parameter(torch.empty(sum(self.out_parts), in_features), requires_grad=False)
        self.weight.shard_dim, self.weight.shard_parts = 0, list(out_parts)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(self.out_parts)), requires_grad=False)
            self.bias.shard_dim, self.bias.shard_parts = 0, list(out_parts)
        self.packed: torch.Tensor | None = None  # few-row kernel layout (small_gemm.py), set by the engine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_gemm.linear(x, self.weight, self.bias, self.packed)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks, then summed over ranks."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, divide(in_features, tp_size(), "input features")), requires_grad=False
        )
        self.weight.shard_dim, self.weight.shard_parts = 1, None
        # decided once: a decode step calls this 60 times, and asking torch.distributed each time is not free
        self.reduce = tp_size() > 1
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = small_gemm.linear(x, self.weight, None, self.packed)
        return all_reduce(y) if self.reduce else y


class ReplicatedLinear(nn.Module):
    """y = x W^T, the whole W on every rank (small layers that are not worth splitting, e.g. a feature draft's
    input projection); takes the few-row kernel like the parallel layers."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.shard_dim, self.weight.shard_parts = None, None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_gemm.linear(x, self.weight, None, self.packed)


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split across ranks (masked lookup + all-reduce)."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = divide(vocab_size, tp_size(), "vocab_size") if tp_size() > 1 else vocab_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, dim), requires_grad=False)
        self.weight.shard_dim, self.weight.shard_parts = 0, None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        lo = tp_rank() * self.shard_size
        local = ids - lo
        inside = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * inside.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(nn.Module):
    """Vocabulary-parallel output projection; logits are gathered to full width."""

    def __init__(self, vocab_size: int, dim: int, tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tied_to = tied_to
        if tied_to is None:
            shard = divide(vocab_size, tp_size(), "vocab_size") if tp_size() > 1 else vocab_size
            self.weight = nn.Parameter(torch.empty(shard, dim), requires_grad=False)
            self.weight.shard_dim, self.weight.shard_parts = 0, None
        self.packed: torch.Tensor | None = None

    def get_weight(self) -> torch.Tensor:
        return self.tied_to.weight if self.tied_to is not None else self.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(small_gemm.linear(h, self.get_weight(), None, self.packed))
