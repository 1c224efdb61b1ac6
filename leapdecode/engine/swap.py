"""Tiered KV cache: a second, larger block pool in host memory that preempted sequences swap into.

Without it, a preempted sequence loses its KV and recomputes its whole prompt + output on resumption (a
prefill, cheap on a GPU, expensive on a CPU for long contexts). With ``LLM(swap_space_gb=G)`` the scheduler
first tries to *swap out*: the sequence's computed blocks are copied into free host blocks, its device blocks
freed; when it is admitted again, fresh device blocks are allocated and the K/V copied back, so it resumes
exactly where it stopped (identical output, no recompute).

The host pool mirrors each of the cache's slot tensors (``KVCache.slot_tensors``: ``pool[layer, K|V, slot,
kv_head, head_dim]``, int8 ``scales``, the host layer tier), so a block moves with one ``index_copy_`` per
tensor. On CUDA the host pool is pinned memory (fast, async-capable copies); on CPU it is a separate tensor, or
file-backed ones (``swap_path``, ``swap_path.1``, ...) so swapped KV can live on disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from leapdecode.engine.kv_cache import KVCache


@dataclass
class SwapHandle:
    """Where a swapped-out sequence's KV is: host blocks, in table order, holding ``num_tokens`` positions."""

    host_blocks: list[int]
    num_tokens: int


class HostKVPool:
    def __init__(self, kv: KVCache, num_blocks: int, path: str | os.PathLike | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("swap space too small for one KV block; raise swap_space_gb")
        self.kv = kv
        self.num_blocks = num_blocks
        self.block_size = kv.block_size
        pin = kv.pool.device.type == "cuda"
        # one host mirror per cache tensor with a slot axis (pool, int8 scales, host layer tier)
        self.mirrors: list[torch.Tensor] = []
        for i, t in enumerate(kv.slot_tensors()):
            shape = list(t.shape)
            shape[2] = num_blocks * kv.block_size
            file = None if path is None else (str(path) if i == 0 else f"{path}.{i}")  # path, path.1, ...
            self.mirrors.append(self._alloc(shape, t.dtype, pin, file))
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    @staticmethod
    def _alloc(shape, dtype, pin: bool, path) -> torch.Tensor:
        if path is not None:
            n = 1
            for s in shape:
                n *= s
            return torch.from_file(str(path), shared=True, size=n, dtype=dtype).view(*shape)
        return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def _slots(self, blocks: list[int], device: torch.device) -> torch.Tensor:
        b = torch.tensor(blocks, dtype=torch.long)
        return (b.unsqueeze(1) * self.block_size + torch.arange(self.block_size)).view(-1).to(device)

    def swap_out(self, device_blocks: list[int], num_tokens: int) -> SwapHandle | None:
        """Copy ``device_blocks`` to host blocks; None (nothing copied) when the host pool is full."""
        if len(device_blocks) > len(self.free):
            return None
        host = [self.free.pop() for _ in device_blocks]
        dst = self._slots(host, torch.device("cpu"))
        for mirror, t in zip(self.mirrors, self.kv.slot_tensors(), strict=True):
            mirror.index_copy_(2, dst, t.index_select(2, self._slots(device_blocks, t.device)).to("cpu"))
        self.num_swapped_out += 1
        return SwapHandle(host, num_tokens)

    def swap_in(self, handle: SwapHandle, device_blocks: list[int]) -> None:
        """Copy a swapped sequence's KV into ``device_blocks`` (same count, table order) and free its host blocks."""
        assert len(device_blocks) >= len(handle.host_blocks)
        src = self._slots(handle.host_blocks, torch.device("cpu"))
        for mirror, t in zip(self.mirrors, self.kv.slot_tensors(), strict=True):
            dst = self._slots(device_blocks[: len(handle.host_blocks)], t.device)
            t.index_copy_(2, dst, mirror.index_select(2, src).to(t.device, non_blocking=True))
        self.release(handle)
        self.num_swapped_in += 1

    def release(self, handle: SwapHandle) -> None:
        self.free.extend(reversed(handle.host_blocks))
        handle.host_blocks = []
