"""What a benchmark says about the machine and the model it ran on: the hardware line every table header carries,
the measured read bandwidth, and the weight bytes a decode step reads."""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch


def machine_info() -> str:
    """The hardware line every table and plot carries: CPU model and cores, torch and its threads, Python, GPU."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}{gpu}")


def measure_bandwidth_gbps(device: torch.device, mb: int = 512) -> float:
    """Achievable read bandwidth: median time to sum a buffer larger than the caches."""
    x = torch.ones(mb * (1 << 20) // 4, device=device)
    ts = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.sum().item()
        ts.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every matrix once (a tied embedding is read by the LM head), in the
    form its kernel reads it (float32 panels or the checkpoint's blocks, layers/block_formats.py)."""
    seen, total = set(), 0
    for mod in model.modules():
        packed = getattr(mod, "packed", None)
        if packed is not None:
            owner = mod.owner() if hasattr(mod, "owner") else mod  # a tied LM head reads the embedding's weight
            seen.add(id(getattr(owner, "weight", None)))
            total += packed.numel() * packed.element_size()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


__all__ = ["machine_info", "measure_bandwidth_gbps", "weight_bytes_per_step"]
