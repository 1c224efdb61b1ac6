"""Decode time per token against context length, with the KV of all layers on the device or only the last N.

The layer tier (``LLM(kv_device_layers=N)``, engine/kv_cache.py) keeps the first ``L - N`` layers' KV in host
memory and fetches the slots each step reads. This measures what the fetch costs: for each context length one
request is prefilled, then ``--decode`` greedy tokens are timed (time per output token after the first, from the
request's own metrics); every context and engine runs once per round, the median over rounds is reported, with the
KV bytes a step fetches and the rate that implies, and "vs first context" is the median over rounds of each
round's own ratio to the first context (paired, so a slow spell of a shared machine does not skew it).

On a CPU the host tier is the same memory, so the fetch is pure overhead (an extra gather per layer); it pays only
where the device pool is the scarce resource -- an accelerator whose memory bounds the batch -- and the link is
fast enough for the bytes fetched per step. The printed fetch rate lets you compare with a link's bandwidth.

Run: ``python -m leapdecode.eval.kv_tier_bench`` (bundled model; contexts 256,2048,6144; tiers all,8,4);
``--tiers all --kv-cache-dtype int8`` gives decode time against context for the int8 cache.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--contexts", default="256,2048,6144", help="comma list of prompt lengths (tokens)")
    ap.add_argument("--tiers", default="all,8,4", help="comma list of kv_device_layers values ('all' = no tier)")
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens timed per request")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (float32) or int8 (then --tiers all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from leapdecode import LLM, SamplingParams

    contexts = [int(c) for c in a.contexts.split(",")]
    tiers = [None if t == "all" else int(t) for t in a.tiers.split(",")]
    blocks = -(-(max(contexts) + a.decode) // 16) + 2
    engines = {t: LLM(model=a.model, kv_cache_blocks=blocks, max_num_seqs=1, enable_prefix_caching=False,
                      kv_device_layers=t, max_model_len=max(contexts) + a.decode + 16, kv_cache_dtype=a.kv_cache_dtype)
               for t in tiers}  # fmt: skip
    cfg = next(iter(engines.values())).engine.model_config
    layers = cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=a.decode, temperature=0.0, ignore_eos=True)
    head = ("context", "device layers", "ms/token", "vs all", "fetched MB/step", "fetch GB/s", "vs first context")
    prompts = {ctx: torch.randint(100, cfg.vocab_size, (ctx,), generator=gen).tolist() for ctx in contexts}
    # rounds outermost, every context and engine once per round: a slow spell of the machine then hits all of them
    # alike, and "vs first context" is the median over rounds of the within-round ratio (paired, robust to drift)
    times: dict[tuple[int, int | None], list[float]] = {(c, t): [] for c in contexts for t in tiers}
    for _ in range(a.rounds + 1):  # the first round warms up
        for ctx in contexts:
            for t, llm in engines.items():
                out = llm.generate([{"prompt_token_ids": prompts[ctx]}], params, use_tqdm=False)[0]
                m = out.metrics
                times[ctx, t].append((m.e2e_s - m.ttft_s) / max(1, m.num_output_tokens - 1))
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (8, 13, 9, 7, 16, 11, 17), strict=True)))
    for ctx in contexts:
        base = statistics.median(times[ctx, tiers[0]][1:])
        for t in tiers:
            ms = statistics.median(times[ctx, t][1:])
            kv = engines[t].engine.kv_cache
            per_token_layer = kv.nbytes / (kv.num_blocks * kv.block_size) / layers
            fetched = (layers - kv.device_layers) * per_token_layer * (ctx + a.decode / 2)
            extra = ms - base
            rate = f"{fetched / extra / 1e9:11.1f}" if t is not None and extra > 0 else f"{'-':>11}"
            paired = statistics.median(x / y for x, y in zip(times[ctx, t][1:], times[contexts[0], t][1:]))
            print(f"{ctx:>8} {kv.device_layers:>13} {ms * 1e3:>9.2f} {ms / base:>6.2f}x {fetched / 1e6:>16.1f} {rate} "
                  f"{paired:>16.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
