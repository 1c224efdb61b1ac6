"""How many KV blocks fit on a GPU under ``gpu_memory_utilization`` (the fraction vLLM's option of that name means).

The fraction caps everything this engine instance holds on the GPU, not the KV pool alone: the weights, the
activations of the largest step, what the CUDA context and other processes already took, and the pool. So the
pool gets ``total * utilization - in use after loading - peak activations``. The activation peak is measured, as
vLLM does, by one profiling forward pass of ``max_num_batched_tokens`` tokens (the largest step the scheduler
builds) over a scratch cache just big enough for it. The pool is never made larger than ``max_num_seqs``
sequences of ``max_model_len`` tokens need (unlike vLLM, which takes the whole budget): a small model would
otherwise claim most of a large GPU for blocks it can never fill.
"""

from __future__ import annotations

import torch

from leapdecode.engine.kv_cache import KVCache
from leapdecode.layers.attention import SeqAttention, build_attention_metadata
from leapdecode.models.config import ModelConfig


def kv_budget_bytes(total: int, utilization: float, in_use: int, activation_peak: int) -> int:
    """Bytes left for the KV pool: ``total * utilization`` minus what is already held and the activation peak.
    Raises when nothing is left (the weights alone exceed the fraction, say)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    budget = int(total * utilization) - in_use - activation_peak
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache: {total * utilization / 2**30:.2f}"
            f" GiB allowed, {in_use / 2**30:.2f} GiB in use after loading the model, {activation_peak / 2**30:.2f}"
            " GiB of activations at the largest step; raise it or lower max_num_batched_tokens"
        )
    return budget


def blocks_within(budget: int, per_block: int, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks the budget pays for, capped at what ``max_num_seqs`` full-length sequences need."""
    wanted = max_num_seqs * -(-max_model_len // block_size)
    return max(1, min(wanted, budget // per_block))


@torch.inference_mode()
def profile_activation_peak(model: torch.nn.Module, cfg: ModelConfig, num_tokens: int, block_size: int,
                            dtype: torch.dtype, device: torch.device) -> int:  # fmt: skip
    """Peak bytes one forward pass of ``num_tokens`` prompt tokens allocates beyond what was held before it (a
    scratch cache for those tokens included, so the estimate errs high by that much). CUDA only."""
    if device.type != "cuda":
        raise ValueError("profile_activation_peak measures a CUDA device")
    blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    scratch = KVCache(cfg, blocks, block_size, dtype, device)
    seq = SeqAttention(0, num_tokens, num_tokens, list(range(blocks)), block_size)
    slots = seq.slots().to(device)
    meta = build_attention_metadata([seq], slots, cfg.num_attention_heads // cfg.num_key_value_heads, device,
                                    windows=cfg.attention_windows())
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), scratch.layers, meta)
    model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch, hidden
    torch.cuda.empty_cache()
    return peak


def num_blocks_for_utilization(model: torch.nn.Module, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                               device: torch.device, utilization: float, max_num_seqs: int, max_model_len: int,
                               max_num_batched_tokens: int, device_layers: int | None = None) -> int:  # fmt: skip
    """The KV pool size on a CUDA device: profile the largest step, then size the pool from what is left."""
    peak = profile_activation_peak(model, cfg, min(max_num_batched_tokens, max_model_len), block_size, dtype, device)
    free, total = torch.cuda.mem_get_info(device)
    per_block = KVCache.bytes_per_block(cfg, block_size, dtype)
    if device_layers is not None:  # the host layer tier holds the other layers' KV
        per_block = max(1, per_block * device_layers // cfg.num_hidden_layers)
    budget = kv_budget_bytes(total, utilization, total - free, peak)
    return blocks_within(budget, per_block, max_num_seqs, max_model_len, block_size)
