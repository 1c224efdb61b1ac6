"""The preallocated KV pool and how big to make it.

One tensor holds every layer's keys and values::

    pool[layer, 0 = K | 1 = V, slot, kv_head, head_dim]      slot = block_id * block_size + offset

Under tensor parallelism each rank allocates only its own ``kv_heads / tp_size`` heads, so the layout shards along
the head axis without changing slot arithmetic.
"""

from __future__ import annotations

import torch

from leapdecode.models.config import ModelConfig
from leapdecode.parallel import divide, tp_size


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemFree"])
    except OSError:
        return 4 << 30


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads = divide(cfg.num_key_value_heads, tp_size(), "num_key_value_heads")
        self.pool = torch.zeros(
            cfg.num_hidden_layers, 2, num_blocks * block_size, self.num_kv_heads, cfg.head_dim,
            dtype=dtype, device=device,
        )
        self.layers = [(self.pool[i, 0], self.pool[i, 1]) for i in range(cfg.num_hidden_layers)]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        heads = cfg.num_key_value_heads // tp_size()
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * heads * cfg.head_dim * elem

    @staticmethod
    def auto_num_blocks(
        cfg: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        memory_fraction: float,
    ) -> int:
        """Enough blocks for ``max_num_seqs`` full-length sequences, capped by a share of free memory."""
        per_block = KVCache.bytes_per_block(cfg, block_size, dtype)
        wanted = max_num_seqs * -(-max_model_len // block_size)
        afford = int(available_memory_bytes(device) * memory_fraction) // per_block
        return max(1, min(wanted, afford))
