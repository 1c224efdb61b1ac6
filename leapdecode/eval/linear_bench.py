"""Micro-benchmark: the few-row projection kernels on a GGUF file's own matrices, per type and shape.

Run: ``python -m leapdecode.eval.linear_bench --model FILE.gguf`` (default: the bundled model). For each group of
the file's 2-D quantized tensors of one type and shape, up to ``--matrices`` of them are repacked into the kernel
records (layers/block_formats.py) and streamed one after another, so each call reads its weights from memory as a
decode step does (pick enough to exceed the last-level cache). It prints the median milliseconds per matrix for
each row count M and the weight bytes read per second, for the lossless float-activation kernel and, with
``--kernels float,int8``, the int8-activation one. Every float result is checked against the dequantised weight
(bitwise against the float32 kernel, and within float32 summation error of a float64 product) before it is timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGUFReader

from leapdecode.kernels import extension
from leapdecode.layers import small_gemm
from leapdecode.layers.block_formats import QuantizedWeight
from leapdecode.models.loader import bundled_model_path


def median_ms(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` timings of ``fn`` (after one warm-up), in milliseconds per one of its ``calls``."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3 / calls


def file_matrices(path: str, types: set[str] | None, limit: int) -> dict[tuple[str, int, int], list[QuantizedWeight]]:
    """Up to ``limit`` record weights per (GGUF type, N, K) of the file's quantized 2-D tensors."""
    groups: dict[tuple[str, int, int], list[QuantizedWeight]] = {}
    for t in GGUFReader(path).tensors:
        name, shape = t.tensor_type.name, (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else ()
        if not shape or (types and name not in types) or not QuantizedWeight.supported(name, shape):
            continue
        group = groups.setdefault((name, *shape), [])
        if len(group) < limit:
            group.append(QuantizedWeight.from_gguf([(name, np.asarray(t.data), shape)]))
    return groups


def check(x: torch.Tensor, qw: QuantizedWeight) -> None:
    """The float-activation kernel on ``qw`` is the float32 kernel on its dequantised weight, bit for bit."""
    w = qw.dequantize()
    y = small_gemm.packed_linear(x, qw.records, None)
    if not torch.equal(y, small_gemm.packed_linear(x, small_gemm.pack(w), None)):
        raise AssertionError(f"{qw.source} {qw.shape}: block kernel differs from the float32 kernel")
    ref = x.double() @ w.double().T
    if not ((y.double() - ref).abs() <= 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-6).all():
        raise AssertionError(f"{qw.source} {qw.shape}: off the float64 product")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled model)")
    p.add_argument("--types", default="", help="comma list of GGUF types to time, e.g. Q4_K,Q6_K (default: all)")
    p.add_argument("--rows", default="1,2,4,8,16", help="comma list of row counts M")
    p.add_argument("--matrices", type=int, default=40, help="distinct matrices streamed per timing, per group")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--kernels", default="float", help="comma list of: float (lossless), int8 (int8 activations)")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    extension.load_kernel(required=True)
    path = a.model or str(bundled_model_path())
    groups = file_matrices(path, {t for t in a.types.split(",") if t} or None, a.matrices)
    kernels = [k for k in a.kernels.split(",") if k]
    if not groups or not set(kernels) <= {"float", "int8"}:
        p.error("no quantized 2-D tensors of those types in the file" if not groups else "--kernels: float, int8")
    print(f"{path}: {torch.get_num_threads()} threads; median ms per matrix, weight GB/s read")
    print("| type | N x K | matrices | kernel | " + " | ".join(f"M={m}" for m in a.rows.split(",")) + " |")
    print("|---|---|---|---|" + "---|" * len(a.rows.split(",")))
    g = torch.Generator().manual_seed(0)
    for (type_name, n, k), qws in sorted(groups.items()):
        for kernel in kernels:
            packed = [q.records if kernel == "float" else q.int8_activation_records() for q in qws]
            nbytes = sum(w.numel() for w in packed) / len(packed)
            cells = []
            for m in (int(r) for r in a.rows.split(",")):
                x = torch.randn(m, k, generator=g)
                if kernel == "float":
                    check(x, qws[0])
                ms = median_ms(lambda x=x, packed=packed: [small_gemm.packed_linear(x, w, None) for w in packed],
                               len(packed), a.repeats)
                cells.append(f"{ms:.3f} ({nbytes / ms / 1e6:.0f})")
            print(f"| {type_name} | {n} x {k} | {len(packed)} | {kernel} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
