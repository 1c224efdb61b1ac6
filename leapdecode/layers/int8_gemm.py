"""Python side of kernels/int8_gemm.cpp: the int8-activation layout (``linear_kernel="packed-int8act"``, lossy,
llama.cpp's arithmetic): each input row rounded to int8 per 32 values and multiplied with integer weight codes
by AVX-512 VNNI or AVX2. ``BlockQuantized`` holds per-32 Q4/Q8 blocks and packs them for that kernel; GGUF
records have their own int8 forms (layers/block_formats.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from leapdecode.kernels import extension

# 64-byte lines per record of the int8-activation layout (kernels/int8_gemm.cpp), and the kind each one holds
A8_Q4_LINES, A8_Q8_LINES, A8_Q4K_LINES, A8_Q6K_LINES, A8_Q4H_LINES = 6, 9, 38, 53, 5
A8_KIND_OF_LINES = {A8_Q4_LINES: "q4", A8_Q8_LINES: "q8", A8_Q4K_LINES: "q4k", A8_Q6K_LINES: "q6k", A8_Q4H_LINES: "q4h"}


@dataclass
class BlockQuantized:
    """A weight as a GGUF checkpoint stores it: ``w[n, k] = scale[n, k // 32] * q[n, k] + minimum[n, k // 32]``.

    ``kind`` "q4": q in 0..15 (Q4_1; Q4_0's ``d * (q - 8)`` is kept with ``minimum = -8 d``, the same float32
    value); "q8": q in -128..127 and no minimum (Q8_0). Scales are fp16 values held as float32, so ``scale * q`` is
    exact and ``dequantize`` reproduces gguf's float32 dequantisation bit for bit.
    """

    kind: str
    q: torch.Tensor  # [N, K] uint8 (q4) or int8 (q8)
    scale: torch.Tensor  # [N, K/32] float32
    minimum: torch.Tensor | None = None  # [N, K/32] float32 (q4)

    @classmethod
    def quantize_q8(cls, weight: torch.Tensor) -> BlockQuantized:
        """Q8_0 blocks of a float weight [N, K] (K a multiple of 32) exactly as gguf / llama.cpp make them: per
        block of 32 inputs d = amax / 127, q = w / d rounded half away from zero, d stored as fp16."""
        n, k = weight.shape
        w = weight.detach().float().reshape(n, k // 32, 32)
        d = w.abs().amax(dim=-1, keepdim=True) / 127.0
        x = w * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = (x.sign() * (x.abs() + 0.5).floor()).to(torch.int8).reshape(n, k)
        return cls("q8", q.contiguous(), d.squeeze(-1).half().float().contiguous())

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().reshape(n, k // 32, 32) * self.scale.unsqueeze(-1)
        if self.minimum is not None:
            w = w + self.minimum.unsqueeze(-1)
        return w.reshape(n, k)

    def pack_int8_activations(self) -> torch.Tensor:
        """The int8-activation kernel's layout: [N/16, K/32, 6 (q4) or 9 (q8) lines, 64] uint8; in each line
        output j owns bytes 4j..4j+3 (see kernels/small_gemm.cpp ``a8_linear``)."""
        n, k = self.q.shape
        nb = k // 32

        def per_block(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n // 16, 16, nb).transpose(1, 2).contiguous().view(torch.uint8)

        if self.kind == "q4":  # (panel, j, block, line g, half h, t): k = 32 b + 8 g + 4 h + t
            q = self.q.reshape(n // 16, 16, nb, 4, 2, 4)
            lines = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // 16, nb, 256)
            rec = torch.cat([per_block(self.scale), per_block(self.minimum), lines], dim=-1)
        else:  # (panel, j, block, line g, t): k = 32 b + 4 g + t, stored + 128 as unsigned
            q = (self.q.to(torch.int16) + 128).to(torch.uint8).reshape(n // 16, 16, nb, 8, 4)
            rec = torch.cat([per_block(self.scale), q.permute(0, 2, 3, 1, 4).reshape(n // 16, nb, 512)], dim=-1)
        return rec.reshape(n // 16, nb, -1, 64).contiguous()


def int8_activation_layout(packed: torch.Tensor) -> bool:
    """Whether ``packed`` is for the int8-activation kernel: 4-D records, or segments of them (an int8 buffer)."""
    return packed.dim() == 4 or (packed.dim() == 1 and packed.dtype == torch.int8)


def int8_activation_isa() -> str | None:
    """What the int8-activation kernel was built for on this CPU: "avx512-vnni", "avx2" (the same integer sums
    by vpmaddubsw, bit-identical), "portable" (a scalar reference loop, several times slower than float32), or
    None without the kernel."""
    ext = extension.load_kernel()
    return None if ext is None else ext.a8_isa()



# row counts the start-up measurement times the two int8 paths at (the one-row step stays on the VNNI loop)
AMX_PROBE_ROWS = (2, 4, 8, 16, 32, 64)


def amx_rows() -> int:
    """The fewest rows the int8-activation kernel gives to AMX tiles here (0: never, or no AMX-INT8 here)."""
    ext = extension.load_kernel()
    return 0 if ext is None else int(ext.a8_amx_rows())


def choose_amx_rows(packed: torch.Tensor, repeats: int = 5) -> int:
    """Time the VNNI loop against AMX tiles on ``packed`` (int8-activation records) at each of AMX_PROBE_ROWS
    and set the kernel's threshold to the fewest rows from which tiles are faster at every larger count (0 where
    they never are, or where this CPU or OS has none). Both paths give bitwise the same results, so the choice,
    however noisy the machine, changes speed only. Returns the threshold."""
    ext = extension.load_kernel()
    if ext is None or not ext.a8_amx_available():
        return 0
    k = packed.shape[1] * (256 if packed.shape[2] in (A8_Q4K_LINES, A8_Q6K_LINES) else 32)
    faster = []
    for rows in AMX_PROBE_ROWS:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        cost = {}
        for path in (0, 1):  # amx_rows 0: the VNNI loop; 1: tiles
            ext.a8_linear(x, packed, amx_rows=path)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                ext.a8_linear(x, packed, amx_rows=path)
                times.append(time.perf_counter() - t0)
            cost[path] = statistics.median(times)
        faster.append(cost[1] < cost[0])
    threshold = 0
    for rows, fast in zip(reversed(AMX_PROBE_ROWS), reversed(faster)):
        if not fast:
            break
        threshold = rows
    ext.set_a8_amx_rows(threshold)
    return threshold
