"""What a benchmark says about the machine and the model it ran on: the hardware line every table header carries,
the measured read bandwidth and arithmetic peak, and what a step of the model must read (weight bytes) and
compute (multiply-adds per row): together the floor under a step's time."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Literal

import torch

from leapdecode.kernels import extension
from leapdecode.models.config import ModelConfig

PeakKind = Literal["int8", "float32"]


# the CPU features the kernels dispatch on, as /proc/cpuinfo spells them, and how the hardware line names them
ISA_FLAGS = (("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("amx_int8", "AMX"))


def cpu_description(cpuinfo: str) -> str:
    """The CPU of a /proc/cpuinfo text: its model name, the x86 family and model (a VM often reports a bare "AMD
    EPYC", and the generations differ in what they run fast), and the vector features the kernels use (AVX2 where
    AVX-512 is absent)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "cpu family", "model", "flags") and key not in fields:
            fields[key] = value.strip()
    if "model name" not in fields:
        return ""
    out = fields["model name"]
    if "cpu family" in fields and "model" in fields:
        out += f" (family {fields['cpu family']} model {fields['model']})"
    flags = set(fields.get("flags", "").split())
    isa = [name for flag, name in ISA_FLAGS if flag in flags] or (["AVX2"] if "avx2" in flags else [])
    return out + (", " + " + ".join(isa) if isa else "")


def machine_info() -> str:
    """The hardware line every table and plot carries: the CPU (cpu_description) and cores, torch and its threads,
    Python, GPU."""
    try:
        cpu = cpu_description(open("/proc/cpuinfo").read())
    except OSError:
        cpu = ""
    cpu = cpu or platform.processor() or platform.machine()
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


def measure_peak_macs(kind: PeakKind, seconds: float = 0.2) -> float | None:
    """Multiply-adds per second that all threads reach together with the instruction the projection kernels are
    built on, doing nothing else: ``"int8"`` (AVX-512 VNNI, or AVX2's three-instruction form), ``"float32"`` (FMA).
    None where the kernels are not built, or are the portable loop (no fixed instruction to measure)."""
    ext = extension.load_kernel()
    rate = ext.isa_peak_macs(kind, seconds) if ext is not None else 0.0
    return rate or None


def macs_per_row(cfg: ModelConfig) -> int:
    """Multiply-adds of one row through a decoder's projections: per layer QKV, the attention output, gate/up and
    down; then the LM head (attention itself, norms and activations are not counted)."""
    hidden, d = cfg.hidden_size, cfg.head_dim
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    per_layer = hidden * (heads + 2 * kv_heads) * d + heads * d * hidden + 3 * hidden * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer + cfg.vocab_size * hidden


__all__ = ["PeakKind", "cpu_description", "machine_info", "macs_per_row", "measure_bandwidth_gbps", "measure_peak_macs",
           "weight_bytes_per_step"]
