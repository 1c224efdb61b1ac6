"""Tensor-parallel context.

leapdecode runs on one device today, but every linear layer, the embedding and the KV cache are written against
this rank/size pair so that tensor parallelism over ``torch.distributed`` (gloo on CPU, NCCL on GPU) lands without
a rewrite: column-parallel layers own a slice of output rows, row-parallel layers a slice of input columns followed
by an all-reduce, and each rank caches only its own KV heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d
