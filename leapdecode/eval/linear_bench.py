"""Micro-benchmark: few-row projections, torch's ``linear`` vs the packed kernels (layers/small_gemm.py).

Run: ``python -m leapdecode.eval.linear_bench`` (about a minute on 2 cores). It streams a set of distinct weight
matrices larger than the last-level cache (by default 90 x [3072, 576] float32 = 637 MB, SmolLM2-135M's gate/up
shape), so every call reads its weights from memory as a decode step does, and prints the median milliseconds per
matrix for each row count M, with the effective weight bandwidth. The block-quantized kernels (GGUF Q4_1 and Q8_0
blocks, bit-identical to the float32 kernel on the dequantised weights) stream as many bytes in more, smaller
copies. Every kernel result is checked before it is timed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from leapdecode.kernels import extension
from leapdecode.layers import int8_gemm, small_gemm


def _median_ms_per_matrix(fn, n_mats: int, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3 / n_mats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,12,16,32,64", help="comma list of row counts M")
    p.add_argument("--out-features", type=int, default=3072)
    p.add_argument("--in-features", type=int, default=576)
    p.add_argument("--matrices", type=int, default=90, help="distinct weights streamed per timing (exceed the LLC)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ext = extension.load_kernel(required=True)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(a.out_features, a.in_features, generator=g) for _ in range(a.matrices)]
    packed = [small_gemm.pack(w) for w in weights]
    mb = weights[0].numel() * 4 / 1e6
    blocks = {}
    for fmt, kernel in (("Q4_1", ext.q4_linear), ("Q8_0", ext.q8_linear)):
        from gguf import GGMLQuantizationType, quants

        raw = quants.quantize(weights[0].numpy(), getattr(GGMLQuantizationType, fmt))
        bq = int8_gemm.BlockQuantized.from_gguf(fmt, np.asarray(raw), (a.out_features, a.in_features))
        one = bq.pack()
        copies = a.matrices * weights[0].numel() * 4 // one.numel()  # the same bytes as the float32 set
        blocks[fmt] = (kernel, [one.clone() for _ in range(copies)], bq.dequantize(), one.numel() / 1e6)
        a8 = bq.pack_int8_activations()  # the same blocks for the int8-activation kernel (opt-in, lossy)
        blocks[fmt + " int8-act"] = (ext.a8_linear, [a8.clone() for _ in range(copies)], None, a8.numel() / 1e6)
    print(f"{a.matrices} x [{a.out_features}, {a.in_features}] float32 ({mb:.1f} MB each), "
          f"{torch.get_num_threads()} threads; median ms per matrix")
    print("| rows | torch linear ms | packed f32 ms | packed Q4_1 ms | packed Q8_0 ms | Q4_1 int8-act ms |"
          " Q8_0 int8-act ms | torch / f32 | torch / Q4_1 | torch / Q4_1 int8-act | f32 GB/s | Q4_1 GB/s |"
          " Q4_1 int8-act GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in (int(r) for r in a.rows.split(",")):
        x = torch.randn(m, a.in_features, generator=g)
        torch.testing.assert_close(ext.small_linear(x, packed[0]), F.linear(x, weights[0]),
                                   rtol=1e-5, atol=5e-6 * a.in_features**0.5)
        t_torch = _median_ms_per_matrix(lambda x=x: [F.linear(x, w) for w in weights], a.matrices, a.repeats)
        t_kern = _median_ms_per_matrix(lambda x=x: [ext.small_linear(x, pw) for pw in packed], a.matrices, a.repeats)
        t_blocks = {}
        for fmt, (kernel, copies, dequant, _) in blocks.items():
            if dequant is not None:  # the float-activation block kernels are exact; int8-act is tested elsewhere
                assert torch.equal(kernel(x, copies[0]), ext.small_linear(x, small_gemm.pack(dequant))), fmt
            t_blocks[fmt] = _median_ms_per_matrix(lambda x=x, k=kernel, c=copies: [k(x, p) for p in c], len(copies),
                                                  a.repeats)
        q4, q8, q4a, q8a = (t_blocks[f] for f in ("Q4_1", "Q8_0", "Q4_1 int8-act", "Q8_0 int8-act"))
        print(f"| {m} | {t_torch:.3f} | {t_kern:.3f} | {q4:.3f} | {q8:.3f} | {q4a:.3f} | {q8a:.3f} | "
              f"{t_torch / t_kern:.2f}x | {t_torch / q4:.2f}x | {t_torch / q4a:.2f}x | {mb / t_kern:.1f} | "
              f"{blocks['Q4_1'][3] / q4:.1f} | {blocks['Q4_1 int8-act'][3] / q4a:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
