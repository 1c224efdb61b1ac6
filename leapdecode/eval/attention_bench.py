"""Micro-benchmark: one layer's decode attention, plain paged path vs split-KV, at several context lengths.

Run: ``python -m leapdecode.eval.attention_bench`` (about a minute on 2 cores). Shapes default to
SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64). Layouts: ``contig`` (one sequence whose blocks are
adjacent: the plain path reads a view), ``frag`` (every other block: the plain path gathers the whole
context), ``batchN`` (N sequences decoding together with interleaved blocks: the padded group gathers).
Times are per layer call; a decode step runs one per layer (30 for SmolLM2). Every split result is checked
against the plain one (1e-5) before it is timed.
"""

from __future__ import annotations

import argparse
import time

import torch

from leapdecode.layers import split_kv
from leapdecode.layers.attention import SeqAttention, build_attention_metadata, paged_attention
from leapdecode.layers.kv_quant import QuantizedKV, quantize

BLOCK = 16


def _tables(layout: str, ctx: int) -> list[list[int]]:
    nb = -(-ctx // BLOCK)
    if layout == "contig":
        return [list(range(nb))]
    if layout == "frag":
        return [list(range(0, 2 * nb, 2))]
    n = int(layout.removeprefix("batch"))
    return [list(range(j, n * nb, n)) for j in range(n)]


def _time_interleaved(fns: dict[str, object], iters: int) -> dict[str, float]:
    """Min seconds per call of each fn; calls interleaved round-robin so load changes hit all variants."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(iters):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)  # shared machine: min = least disturbed
    return best


def bench_case(
    ctx: int, layout: str, kv: str, chunks: list[int], iters: int, heads: int, kv_heads: int, dim: int
) -> dict[str, float]:
    """Median seconds per layer call for the plain path and for split-KV at each chunk size."""
    tables = _tables(layout, ctx)
    slots = 2 * max(max(t) for t in tables) * BLOCK + 2 * BLOCK
    torch.manual_seed(0)
    k_pool = torch.randn(slots, kv_heads, dim)
    v_pool = torch.randn(slots, kv_heads, dim)
    if kv == "int8":
        kq, ks = quantize(k_pool)
        vq, vs = quantize(v_pool)
        k_cache, v_cache = QuantizedKV(kq, ks), QuantizedKV(vq, vs)
    else:
        k_cache, v_cache = k_pool, v_pool
    seqs = [SeqAttention(i, 1, ctx, t, BLOCK) for i, t in enumerate(tables)]
    slot_mapping = torch.cat([s.slots()[-1:] for s in seqs])
    n = len(seqs)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    group = heads // kv_heads
    scale = dim**-0.5
    names = ("SPLIT_KV_MIN_CONTEXT", "SPLIT_KV_MIN_BATCH_TOKENS", "SPLIT_KV_CHUNK", "SPLIT_KV_BATCH_CHUNK")
    saved = {name: getattr(split_kv, name) for name in names}
    fns = {}
    try:
        split_kv.SPLIT_KV_MIN_CONTEXT = split_kv.SPLIT_KV_MIN_BATCH_TOKENS = 1 << 60
        meta = build_attention_metadata(seqs, slot_mapping, group, torch.device("cpu"))
        ref = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
        fns["plain"] = lambda m=meta: paged_attention(q, k, v, k_cache, v_cache, m, scale)
        split_kv.SPLIT_KV_MIN_CONTEXT = split_kv.SPLIT_KV_MIN_BATCH_TOKENS = 0
        for c in chunks:
            split_kv.SPLIT_KV_CHUNK = split_kv.SPLIT_KV_BATCH_CHUNK = c
            meta = build_attention_metadata(seqs, slot_mapping, group, torch.device("cpu"))
            if meta.groups[-1].split is None:
                continue  # too short to split at this chunk size
            got = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            fns[f"split{c}"] = lambda m=meta: paged_attention(q, k, v, k_cache, v_cache, m, scale)
    finally:
        for name, value in saved.items():
            setattr(split_kv, name, value)
    out = _time_interleaved(fns, iters)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="256,2048,6144")
    ap.add_argument("--layouts", default="contig,frag,batch8")
    ap.add_argument("--kv", default="float32", help="comma list of float32,int8")
    ap.add_argument("--chunks", default="512,1024,2048")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shape", default="9,3,64", help="heads,kv_heads,head_dim")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    heads, kv_heads, dim = (int(x) for x in a.shape.split(","))
    chunks = [int(c) for c in a.chunks.split(",")]
    print(f"threads={torch.get_num_threads()} shape={heads}/{kv_heads}x{dim}; microseconds per layer call")
    cols = ["plain", *[f"split{c}" for c in chunks]]
    print(f"{'kv':8}{'layout':8}{'ctx':>6}  " + "".join(f"{c:>11}" for c in cols) + "   best/plain")
    for kv in a.kv.split(","):
        for layout in a.layouts.split(","):
            for ctx in (int(c) for c in a.contexts.split(",")):
                r = bench_case(ctx, layout, kv, chunks, a.iters, heads, kv_heads, dim)
                best = min((r[c] for c in cols[1:] if c in r), default=float("nan"))
                print(
                    f"{kv:8}{layout:8}{ctx:>6}  "
                    + "".join(f"{r.get(c, float('nan')) * 1e6:>11.0f}" for c in cols)
                    + f"   {best / r['plain']:.2f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
