"""Tensor-parallel context: the process group, this process's rank and size, and the collectives.

Every linear layer, the embedding and the KV cache are written against the rank/size pair read here: column-
parallel layers own a slice of output rows, row-parallel layers a slice of input columns followed by an
all-reduce, and each rank caches only its own KV heads. A layer reads the pair once, when it is built, and keeps
it: a drafter built inside :func:`replicated` is whole on every rank and never joins a collective, while the
target beside it stays split (docs/tensor_parallel.md). With no process group (the default) the size is 1 and
every collective is a no-op.

The group is started by ``engine/executor.py`` (the engine's own worker processes) or by ``torchrun`` (the
environment's ``RANK``/``WORLD_SIZE``; the whole world is the tensor-parallel group). gloo serves a CPU, NCCL a
GPU. Every collective has the group's timeout, so a rank that stops answering is an error, not a hang.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

# collectives give up after this long (a dead peer usually fails them at once, when its sockets close)
DEFAULT_TIMEOUT_S = float(os.environ.get("LEAPDECODE_TP_TIMEOUT_S", "60"))


class _Scopes(threading.local):
    """How deep this thread is in :func:`replicated` and :func:`solo` blocks: per thread, so that a one-rank engine
    stepped in one thread never takes the collectives away from a tensor-parallel engine stepped in another."""

    replicated = 0
    solo = 0


_scopes = _Scopes()


def group_size() -> int:
    """Ranks in the process group (1 without one, or inside :func:`solo`), whatever :func:`replicated` says."""
    if _scopes.solo:
        return 1
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextmanager
def solo() -> Iterator[None]:
    """Inside this block the process acts as if it had no group: a one-rank engine built and stepped beside a
    tensor-parallel one in the same process never joins the other's collectives."""
    _scopes.solo += 1
    try:
        yield
    finally:
        _scopes.solo -= 1


def tp_rank() -> int:
    """This process's rank for layers built now (0 inside :func:`replicated`)."""
    if _scopes.replicated or group_size() == 1:
        return 0
    return dist.get_rank()


def tp_size() -> int:
    """How many ways layers built now are split (1 inside :func:`replicated`)."""
    return 1 if _scopes.replicated else group_size()


@contextmanager
def replicated() -> Iterator[None]:
    """Layers built (and checkpoints sharded) inside this block are whole on every rank: drafters that every rank
    runs in full on the same inputs, so they need no collective."""
    _scopes.replicated += 1
    try:
        yield
    finally:
        _scopes.replicated -= 1


def backend_for(device: torch.device) -> str:
    """gloo on a CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, size: int, store: dist.Store | None, device: torch.device,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group as ``rank`` of ``size``: through ``store`` (the engine's own workers) or, with
    ``store=None``, through torchrun's environment variables."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already running in this process")
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else rank % torch.cuda.device_count())
    if store is None:
        if int(os.environ.get("WORLD_SIZE", "1")) != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE="
                             f"{os.environ.get('WORLD_SIZE')} processes; they must be equal")
        dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def destroy_tensor_parallel() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks in place (the caller decides that its layer is split)."""
    if group_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension, in rank order."""
    if group_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def rank0_value(value: float) -> float:
    """Rank 0's ``value`` on every rank: a measurement (a step's duration) that steers a decision every rank must
    take alike, such as the speculative cost model's draft length. Every rank must call it at the same point."""
    if group_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(t, src=0)
    return float(t.item())


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` of any rank (e.g. KV blocks, so every rank's pool holds the same blocks)."""
    if group_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def rank_path(path: str | None) -> str | None:
    """A file of this rank's own (``path.rank1``) where a one-process engine would use ``path``: the ranks of a
    group hold different data (their KV heads) and must not share a file."""
    if path is None or group_size() == 1:
        return path
    return f"{path}.rank{dist.get_rank()}"


def shard_range(units: int, unit_size: int = 1) -> tuple[int, int]:
    """(start, length) in elements of this rank's share of ``units`` units of ``unit_size`` elements: as even as
    the units allow, the first ranks taking one unit more when they do not divide (3 KV heads over 2 ranks: 2 and
    1), so a model whose head count the rank count does not divide still splits."""
    size = tp_size()
    if size > units:
        raise ValueError(f"cannot split {units} units (heads) over {size} tensor-parallel ranks")
    base, extra = divmod(units, size)
    rank = tp_rank()
    start = rank * base + min(rank, extra)
    return start * unit_size, (base + (rank < extra)) * unit_size


def kv_head_range(num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, KV heads) of this rank: a rank keeps whole KV heads with their query heads."""
    return shard_range(num_kv_heads)


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d
