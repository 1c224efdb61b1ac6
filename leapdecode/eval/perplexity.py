"""Perplexity measured through the engine itself: its model, its paged KV cache, its attention path.

Why not a plain ``model(input_ids)`` loop: the point is to measure what the *engine* computes, including how the
KV cache stores keys and values (``kv_cache_dtype="int8"`` quantizes them on write, and every query -- in
prefill as in decode -- attends to what the cache holds). Each window is run through ``ModelRunner.execute`` on
blocks borrowed from the engine's block manager and returned afterwards, so the engine stays usable and leak-free.

Text is cut into non-overlapping windows of ``window`` tokens, each scored from scratch (its first token is
context only). ``step`` feeds each window in pieces of that many tokens (``step=1`` is pure decode: every token
attends to the int8 cache of all earlier ones exactly as in generation); the default is one prefill per window.

Run: ``python -m leapdecode.eval.perplexity --kv-cache-dtype auto,int8`` (bundled model, first 4096 tokens of
``../shared/data/wikitext2/test.txt``, windows of 512); ``--linear-kernel auto,packed-int8act`` measures int8
activations.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from leapdecode.engine.model_runner import ForwardItem

DEFAULT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "wikitext2" / "test.txt"


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    num_predicted: int
    num_windows: int
    window_nll: list[float]  # mean NLL per window
    seconds: float


def load_tokens(tokenizer, path: str | Path = DEFAULT_DATA, max_tokens: int = 4096) -> list[int]:
    """The first ``max_tokens`` tokens of a text file (no special tokens), reading only as much as needed."""
    text = Path(path).read_text(encoding="utf-8")
    chars = max_tokens * 8  # generous: English text is ~4 characters per token
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) > max_tokens or chars >= len(text):
            return ids[:max_tokens]
        chars *= 2


@torch.inference_mode()
def window_nll(engine, tokens: list[int], step: int | None = None) -> tuple[float, int]:
    """Summed NLL (nats) of tokens[1:] given their prefix, and how many were scored, via the engine's runner."""
    with engine.block_manager.borrowed(len(tokens), f"a {len(tokens)}-token window") as table:
        step = step or len(tokens)
        total, count = 0.0, 0
        for start in range(0, len(tokens), step):
            piece = tokens[start : start + step]
            # logits of every piece row that has a next token inside the window
            rows = [i for i in range(len(piece)) if start + i + 1 < len(tokens)]
            if not rows:
                break
            (res,) = engine.runner.execute([ForwardItem(table, start, piece, rows)])
            targets = torch.tensor([tokens[start + i + 1] for i in rows], device=res.logits.device)
            total += F.cross_entropy(res.logits.float(), targets, reduction="sum").item()
            count += len(rows)
        return total, count


@torch.inference_mode()
def completion_nll(engine, prompt: list[int], output: list[int], top1: bool = False):
    """Summed NLL (nats) of ``output`` given ``prompt`` and the output before each token, and how many tokens
    were scored: the target's own judgement of text a (possibly lossy) decoding method produced. One prefill
    through the engine's runner on borrowed blocks. ``top1`` adds a third value: how many output tokens were the
    target's top choice given the text before them."""
    if not output:
        return (0.0, 0, 0) if top1 else (0.0, 0)
    tokens = list(prompt) + list(output)
    with engine.block_manager.borrowed(len(tokens), f"scoring {len(tokens)} tokens") as table:
        rows = list(range(len(prompt) - 1, len(tokens) - 1))
        (res,) = engine.runner.execute([ForwardItem(table, 0, tokens, rows)])
        targets = torch.tensor(output, device=res.logits.device)
        nll = F.cross_entropy(res.logits.float(), targets, reduction="sum").item()
        if top1:
            return nll, len(output), int((res.logits.argmax(-1) == targets).sum())
        return nll, len(output)


def perplexity(engine, tokens: list[int], window: int = 512, step: int | None = None) -> PerplexityResult:
    """Perplexity of ``tokens`` in non-overlapping windows (see the module docstring)."""
    if window < 2:
        raise ValueError("window must be >= 2 tokens")
    t0 = time.perf_counter()
    sums, counts = [], []
    for w0 in range(0, len(tokens) - 1, window):
        chunk = tokens[w0 : w0 + window]
        if len(chunk) < 2:
            break
        s, n = window_nll(engine, chunk, step)
        sums.append(s)
        counts.append(n)
    nll = sum(sums) / sum(counts)
    return PerplexityResult(
        perplexity=math.exp(nll),
        nll=nll,
        num_predicted=sum(counts),
        num_windows=len(sums),
        window_nll=[s / n for s, n in zip(sums, counts, strict=True)],
        seconds=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: bundled SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto", help="comma list, e.g. auto,int8 (the first is the baseline)")
    ap.add_argument("--linear-kernel", default="auto",
                    help="comma list, e.g. auto,packed-int8act (int8 activations); every KV dtype runs with each")
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--step", type=int, default=None, help="tokens per forward inside a window (1 = decode)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from leapdecode import LLM

    results: dict[str, PerplexityResult] = {}
    tokens: list[int] = []
    blocks = -(-a.window // 16) + 1
    kernels = a.linear_kernel.split(",")
    for kernel in kernels:
        for kv in a.kv_cache_dtype.split(","):
            llm = LLM(model=a.model, dtype=a.dtype, kv_cache_blocks=blocks, kv_cache_dtype=kv, linear_kernel=kernel)
            tokens = tokens or load_tokens(llm.get_tokenizer(), a.data, a.max_tokens)
            label = kv if len(kernels) == 1 else f"{kv} linear_kernel={kernel}"
            results[label] = perplexity(llm.engine, tokens, a.window, a.step)
            del llm
    base = next(iter(results.values()))
    if a.json:
        print(json.dumps({k: asdict(r) | {"delta": r.perplexity - base.perplexity} for k, r in results.items()}))
        return 0
    print(f"{len(tokens)} tokens of {a.data}, windows of {a.window}, step {a.step or a.window}")
    for kv, r in results.items():
        print(
            f"kv_cache_dtype={kv:8} ppl {r.perplexity:.4f}  (delta {r.perplexity - base.perplexity:+.4f}, "
            f"{100 * (r.perplexity / base.perplexity - 1):+.2f}%)  nll {r.nll:.5f}  {r.seconds:.1f}s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
