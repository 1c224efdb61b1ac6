"""The preallocated KV pool and how big to make it.

One tensor holds every layer's keys and values::

    pool[layer, 0 = K | 1 = V, slot, kv_head, head_dim]      slot = block_id * block_size + offset

An int8 cache (``kv_cache_dtype="int8"``) keeps the same ``pool`` in int8 plus float16
``scales[layer, 0|1, slot, kv_head]`` (per token per head; :mod:`leapdecode.layers.kv_quant` says why), and
its ``layers`` entries are :class:`~leapdecode.layers.kv_quant.QuantizedKV` planes that quantize on write and
dequantize on read. Float caches hand attention plain tensor views, exactly as before.

Under tensor parallelism each rank allocates only its own ``kv_heads / tp_size`` heads, so the layout shards along
the head axis without changing slot arithmetic.
"""

from __future__ import annotations

import torch

from leapdecode.layers.kv_quant import SCALE_DTYPE, KVPlane, QuantizedKV, bytes_per_token_head, rotation_matrix
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
    """``dtype`` is the storage dtype: a float dtype, or ``torch.int8`` for the quantized cache."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.num_kv_heads = divide(cfg.num_key_value_heads, tp_size(), "num_key_value_heads")
        slots = num_blocks * block_size
        self.pool = torch.zeros(
            cfg.num_hidden_layers, 2, slots, self.num_kv_heads, cfg.head_dim, dtype=dtype, device=device
        )
        self.scales: torch.Tensor | None = None
        self.rotation: torch.Tensor | None = None
        self.layers: list[tuple[KVPlane, KVPlane]]
        if dtype == torch.int8:
            self.scales = torch.zeros(
                cfg.num_hidden_layers, 2, slots, self.num_kv_heads, dtype=SCALE_DTYPE, device=device
            )
            self.rotation = rotation_matrix(cfg.head_dim, device)  # shared by all planes (see kv_quant)
            self.layers = [
                tuple(QuantizedKV(self.pool[i, j], self.scales[i, j], self.rotation) for j in (0, 1))  # type: ignore[misc]
                for i in range(cfg.num_hidden_layers)
            ]
        else:
            self.layers = [(self.pool[i, 0], self.pool[i, 1]) for i in range(cfg.num_hidden_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated (values and, for int8, scales)."""
        n = self.pool.numel() * self.pool.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * self.scales.element_size())

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V (and int8 scales) from slots ``src`` to ``dst``, e.g. to compact accepted
        tree nodes; use this rather than indexing ``pool`` so quantized caches move their scales too."""
        self.pool.index_copy_(2, dst, self.pool.index_select(2, src))
        if self.scales is not None:
            self.scales.index_copy_(2, dst, self.scales.index_select(2, src))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        heads = cfg.num_key_value_heads // tp_size()
        return 2 * cfg.num_hidden_layers * block_size * heads * bytes_per_token_head(cfg.head_dim, dtype)

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
