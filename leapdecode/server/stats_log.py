"""The server's log lines about the engine: one summary at start-up (model, kernel paths, KV cache, memory) and, every
``interval`` seconds while there is work, one line of throughput, speculative acceptance and KV usage (as vLLM's
periodic stats line; ``leapdecode serve --log-interval S``, off with ``--disable-log-stats``). Draft and accepted
tokens enter the engine's totals as each request finishes, so the acceptance of a line is that of the requests
that finished in its interval."""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
import time
from dataclasses import dataclass

import torch

from leapdecode.engine.llm_engine import LLMEngine
from leapdecode.server.async_engine import AsyncEngine

logger = logging.getLogger("leapdecode.server.stats")
MIB = 1 << 20


def process_memory_bytes() -> int:
    """The process's peak resident memory (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def startup_summary(engine: LLMEngine, name: str) -> str:
    """One line: what runs, on what, with which kernels, how large the KV cache is and the memory it all takes."""
    cfg, mcfg = engine.config, engine.model_config
    fused = sum(bool(getattr(m, "use_kernel", False)) for m in engine.model.modules())
    bm = engine.block_manager
    spec = cfg.speculative_config.method if cfg.speculative_config is not None else "off"
    if engine.device.type == "cuda":
        memory = f"{torch.cuda.memory_allocated(engine.device) / MIB:,.0f} MiB allocated on {engine.device}"
    else:
        memory = f"{process_memory_bytes() / MIB:,.0f} MiB peak resident"
    return (
        f"model {name!r} ({mcfg.architecture}, {mcfg.num_hidden_layers} layers, {cfg.dtype} on {engine.device}, "
        f"{engine.num_threads} threads); kernels: {engine.num_packed_linears} packed projections, {fused} fused "
        f"modules (linear_kernel={cfg.linear_kernel}); KV cache: {bm.num_blocks} blocks x {bm.block_size} tokens "
        f"= {bm.num_blocks * bm.block_size:,} tokens, {engine.kv_cache.nbytes / MIB:,.1f} MiB "
        f"({cfg.kv_cache_dtype}); max_model_len {engine.max_model_len}; speculative: {spec}; memory: {memory}"
    )


@dataclass
class _Mark:
    at: float
    stats: dict[str, int]


class StatsLogger:
    """Logs :meth:`line` every ``interval_s`` seconds while the engine has had work since the last line."""

    def __init__(self, aengine: AsyncEngine, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"the stats log interval must be > 0 seconds, got {interval_s!r}")
        self.aengine = aengine
        self.interval_s = interval_s
        self.last = _Mark(time.monotonic(), dict(aengine.gauges.stats))

    def line(self, now: float | None = None) -> str | None:
        """The stats since the previous line (None: nothing ran and nothing waits)."""
        now = time.monotonic() if now is None else now
        g = self.aengine.gauges
        s, prev = dict(g.stats), self.last.stats
        delta = {k: s.get(k, 0) - prev.get(k, 0) for k in s}
        elapsed = max(now - self.last.at, 1e-9)
        self.last = _Mark(now, s)
        if not any(delta.values()) and not g.num_running and not g.num_waiting:
            return None
        drafted, accepted = delta.get("num_draft_tokens", 0), delta.get("num_accepted_tokens", 0)
        acceptance = f"{accepted / drafted:.1%} of {drafted} draft tokens" if drafted else "no drafts"
        steps = delta.get("num_target_steps", 0)
        per_step = delta.get("num_output_tokens", 0) / steps if steps else 0.0
        return (
            f"prompt throughput {delta.get('num_prompt_tokens', 0) / elapsed:.1f} tokens/s, generation "
            f"throughput {delta.get('num_output_tokens', 0) / elapsed:.1f} tokens/s; running {g.num_running}, "
            f"waiting {g.num_waiting}; KV cache usage {g.kv_blocks_in_use / max(1, g.kv_blocks_total):.1%}; "
            f"speculative acceptance {acceptance} ({per_step:.2f} tokens per target step); preemptions "
            f"{delta.get('num_preemptions', 0)}"
        )

    async def run(self) -> None:
        """Log until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            text = self.line()
            if text is not None:
                logger.info(text)
