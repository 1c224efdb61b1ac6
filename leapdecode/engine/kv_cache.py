"""The preallocated KV pool and how big to make it.

One tensor holds every layer's keys and values::

    pool[layer, 0 = K | 1 = V, slot, kv_head, head_dim]      slot = block_id * block_size + offset

An int8 cache (``kv_cache_dtype="int8"``) keeps the same ``pool`` in int8 plus float16
``scales[layer, 0|1, slot, kv_head, group]`` (per token, head and 16 channels) and, for the keys,
``key_shift`` / ``key_smooth[layer, kv_head, head_dim]`` set once by calibration (:mod:`leapdecode.layers.kv_quant`
says why; :mod:`leapdecode.engine.kv_calibration` runs it). Its ``layers`` entries are
:class:`~leapdecode.layers.kv_quant.QuantizedKV` planes that quantize on write and dequantize on read. Float
caches hand attention plain tensor views.

Layer tier (``kv_device_layers=N``: keep the most recent layers' KV on the fast device, where memory rather than
bandwidth binds): only the last N layers live in ``pool`` on the device; the first ``L - N`` live in ``host_pool``
(pinned CPU memory on CUDA), and attention fetches the slots a step reads, layer by layer::

    host_pool[0 .. L-N-1, K|V, slot, ...]   -- read_slots(...).to(device) per step -->  attention of layers 0..L-N-1
    pool     [0 .. N-1,   K|V, slot, ...]   (device)                                    attention of layers L-N..L-1

Slot arithmetic is shared, so a block id means the same slots in both; block-level moves (tree compaction, swap)
go through :meth:`KVCache.slot_tensors`, which lists every tensor with a slot axis.

Under tensor parallelism each rank allocates only its own ``kv_heads / tp_size`` heads, so the layout shards along
the head axis without changing slot arithmetic.
"""

from __future__ import annotations

import torch

from leapdecode import huge_pages
from leapdecode.layers.kv_quant import (
    SCALE_DTYPE,
    KVPlane,
    QuantizedKV,
    bytes_per_token_head,
    rotation_matrix,
    scale_groups,
)
from leapdecode.models.config import ModelConfig
from leapdecode.parallel import kv_head_range


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


class HostLayerKV:
    """One layer's K or V plane kept in host memory (the layer tier): writes land in the host tensor, reads return
    the requested slots copied to ``device`` -- the "fetch per step". Attention treats it like any non-tensor
    plane (kv_quant's read/write helpers), so the layer takes the general SDPA path rather than the CPU row
    kernels, which read a float tensor in place."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device, self.dtype = host, device, host.dtype

    @property
    def shape(self) -> torch.Size:
        return self.host.shape

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        self.host.index_copy_(0, slots.to(self.host.device), x.to(self.host.device, self.host.dtype))

    def read_range(self, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host[start : start + n].to(self.device, dtype, non_blocking=True)

    def read_slots(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = self.host.index_select(0, slots.to(self.host.device))
        return rows.to(self.device, dtype, non_blocking=True)


class KVCache:
    """``dtype`` is the storage dtype: a float dtype, or ``torch.int8`` for the quantized cache.
    ``device_layers``: how many of the last layers keep their KV on ``device`` (None = all; see the layer tier
    above); the rest live in host memory."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        device_layers: int | None = None,
    ) -> None:
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.num_kv_heads = kv_head_range(cfg.num_key_value_heads)[1]  # this rank's heads (parallel.py)
        slots = num_blocks * block_size
        n_layers = cfg.num_hidden_layers
        self.device_layers = n_layers if device_layers is None else device_layers
        if not 1 <= self.device_layers <= n_layers:
            raise ValueError(f"kv_device_layers must be in 1..{n_layers} (the model's layers), got {device_layers}")
        if self.device_layers < n_layers and dtype == torch.int8:
            raise ValueError("kv_device_layers (the host layer tier) does not support kv_cache_dtype='int8' yet")
        self.host_pool: torch.Tensor | None = None
        host_layers = n_layers - self.device_layers
        if host_layers:
            self.host_pool = torch.zeros(host_layers, 2, slots, self.num_kv_heads, cfg.head_dim, dtype=dtype,
                                         pin_memory=device.type == "cuda")  # fmt: skip
        pool_shape = (self.device_layers, 2, slots, self.num_kv_heads, cfg.head_dim)
        # on a CPU, on 2 MB pages: a batched step reads every sequence's K/V from its own blocks
        self.pool = (huge_pages.zeros(pool_shape, dtype) if device.type == "cpu"
                     else torch.zeros(pool_shape, dtype=dtype, device=device))
        self.scales: torch.Tensor | None = None
        self.rotation: torch.Tensor | None = None
        self.key_shift: torch.Tensor | None = None
        self.key_smooth: torch.Tensor | None = None
        self.calibrated_tokens = 0
        self.layers: list[tuple[KVPlane, KVPlane]]
        if dtype == torch.int8:
            layers, heads, dim = cfg.num_hidden_layers, self.num_kv_heads, cfg.head_dim
            self.scales = torch.zeros(layers, 2, slots, heads, scale_groups(dim), dtype=SCALE_DTYPE, device=device)
            self.rotation = rotation_matrix(dim, device)  # shared by all planes (see kv_quant)
            # identity until calibrate_keys(): mu = 0, s = 1
            self.key_shift = torch.zeros(layers, heads, dim, device=device)
            self.key_smooth = torch.ones(layers, heads, dim, device=device)
            pool, sc, rot = self.pool, self.scales, self.rotation
            rot_t = rot.T.contiguous()
            self.layers = [
                (
                    QuantizedKV(pool[i, 0], sc[i, 0], rot, self.key_shift[i], self.key_smooth[i], rot_t),
                    QuantizedKV(pool[i, 1], sc[i, 1], rot, rotation_t=rot_t),
                )
                for i in range(layers)
            ]
        else:
            host: list[tuple[KVPlane, KVPlane]] = [
                (HostLayerKV(self.host_pool[i, 0], device), HostLayerKV(self.host_pool[i, 1], device))  # type: ignore[misc]
                for i in range(host_layers)
            ]
            self.layers = host + [(self.pool[i, 0], self.pool[i, 1]) for i in range(self.device_layers)]

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding per-slot state, slot axis at dim 2: the device pool, int8 scales, the host
        layer tier. Block-level copies (compaction, swap) must move all of them."""
        return [t for t in (self.pool, self.scales, self.host_pool) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the cache in all tiers (values and, for int8, scales)."""
        return sum(t.numel() * t.element_size() for t in self.slot_tensors())

    @property
    def device_nbytes(self) -> int:
        """Bytes on the primary device: everything but the host layer tier."""
        return self.nbytes - (0 if self.host_pool is None else self.host_pool.numel() * self.host_pool.element_size())

    def observe_keys(self, on: bool) -> None:
        """Start (``True``) or stop accumulating per-channel statistics of every key written (int8 only)."""
        for k, _ in self.layers:
            if isinstance(k, QuantizedKV):
                if on:
                    k.start_observing()
                else:
                    k.observed = None

    def calibrate_keys(self) -> int:
        """Set each layer's key shift mu (the mean key) and smoothing s (mean 1 per head) from the statistics
        gathered since ``observe_keys(True)``; stops observing. ``s = sqrt(rms(k - mu) / rms(q))`` per channel
        minimises the expected error of the attention scores q.k when the rotation spreads each row's rounding
        error evenly over its channels (the error is ~ sum_c (q_c s_c)^2 * sum_c (k_c / s_c)^2, smallest, by
        Cauchy-Schwarz, at s_c^2 ~ rms_k / rms_q); keys written with no query seen (no attention ran) fall back to
        ``s = sqrt(max |k - mu|)``. Only valid while the cache holds no tokens (stored keys would no longer match
        the queries' basis). Returns the key rows observed per layer."""
        if self.key_shift is None or self.key_smooth is None:
            raise ValueError("only an int8 KV cache has key calibration")
        n = 0
        for i, (k, _) in enumerate(self.layers):
            assert isinstance(k, QuantizedKV)
            obs, k.observed = k.observed, None
            if obs is None or obs["count"] == 0:
                continue
            n = int(obs["count"])
            mu = obs["sum"] / obs["count"]
            if obs["q_count"] > 0:
                k_rms = (obs["sumsq"] / obs["count"] - mu.square()).clamp(min=0).sqrt()
                q_rms = (obs["q_sumsq"] / obs["q_count"]).sqrt()
                floor = 1e-3 * k_rms.mean(-1, keepdim=True), 1e-3 * q_rms.mean(-1, keepdim=True)
                s = (torch.maximum(k_rms, floor[0]) / torch.maximum(q_rms, floor[1])).sqrt()
            else:
                s = torch.maximum(obs["max"] - mu, mu - obs["min"]).clamp(min=1e-6).sqrt()
            self.key_shift[i].copy_(mu)
            self.key_smooth[i].copy_(s / s.mean(-1, keepdim=True))
        self.calibrated_tokens = n
        return n

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V (and int8 scales) from slots ``src`` to ``dst``, e.g. to compact accepted
        tree nodes; use this rather than indexing ``pool`` so quantized caches move their scales too."""
        for t in self.slot_tensors():
            s, d = src.to(t.device), dst.to(t.device)
            t.index_copy_(2, d, t.index_select(2, s))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        heads = kv_head_range(cfg.num_key_value_heads)[1]
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
        device_layers: int | None = None,
    ) -> int:
        """Enough blocks for ``max_num_seqs`` full-length sequences, capped by a share of free memory (on an
        accelerator, of its memory: the host layer tier does not count against it)."""
        per_block = KVCache.bytes_per_block(cfg, block_size, dtype)
        if device.type != "cpu" and device_layers is not None:
            per_block = max(1, per_block * device_layers // cfg.num_hidden_layers)
        wanted = max_num_seqs * -(-max_model_len // block_size)
        afford = int(available_memory_bytes(device) * memory_fraction) // per_block
        return max(1, min(wanted, afford))
