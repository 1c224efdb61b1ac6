"""One measured row of ``leapdecode bench`` (a system, a method, a batch size), shared by the engine's runs and
the external systems it is compared with."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Row:
    system: str
    method: str
    batch: int
    num_requests: int
    output_tokens: int
    tok_per_s: float  # batch 1: median over requests of tokens / e2e; batched: total tokens / wall time
    ttft_ms: float  # median
    tpot_ms: float  # median time per output token after the first
    mean_accepted: float = 1.0
    speedup: float | None = None
    identical: str = ""
    gb_per_s: float | None = None
    # drift, filled when some method's output differs from plain greedy (a lossy method such as blockwise top-k):
    agreement: float | None = None  # mean share of the greedy completion reproduced before the first divergence
    top1_share: float | None = None  # share of emitted tokens that were the target's top choice in their context
    ppl: float | None = None  # the target's perplexity of the produced completions (given their prompts)
    token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # each request's prompt as this row sent it (an agent loop's later turns carry the row's own earlier answers)
    prompt_ids: list[list[int]] = field(default_factory=list, repr=False)
    num_lossy_tokens: int = 0
    kernel: str = ""  # the engine's linear_kernel when a run compares several (--linear-kernels); "" = the first
    # --ceiling (batch-1 rows): tokens the target verifies per step (1 + drafts), and the speedup the row's
    # acceptance would give if drafting and bookkeeping were free: mean accepted x t(1) / t(verified rows), with t
    # the target's measured step time. A ceiling under a bar means no drafter of this acceptance reaches it here.
    verified_rows: float | None = None
    ceiling: float | None = None
    num_draft_tokens: int = 0
    # what the speedup pairs with `none`'s: at batch 1 each request's tokens / e2e in prompt order, batched each
    # round's tok/s in round order (the engines ran each prompt, each round, one after another)
    paired_tok_per_s: list[float] = field(default_factory=list, repr=False)
    load_s: float | None = None  # the system's model load time (first `none` row and external systems)
    peak_rss_mb: float | None = None  # its process's peak resident memory after load and the first request
    # speculative "auto" (--explain): requests per route the router took, target steps drafted per method
    routes: dict[str, int] = field(default_factory=dict)
    draft_methods: dict[str, int] = field(default_factory=dict)
    compute_paths: dict[str, int] = field(default_factory=dict)  # auto's difficulty path: steps per path


def explain_rows(rows: list[Row]) -> list[str]:
    """``--explain``: for each row that ran the router, its routes (with how many requests took each) and the
    target steps each method drafted."""
    lines = []
    for r in rows:
        if not r.routes:
            continue
        steps = ", ".join(f"{k} {v}" for k, v in sorted(r.draft_methods.items())) or "none"
        paths = ", ".join(f"{k} {v}" for k, v in sorted(r.compute_paths.items()))
        lines.append(f"- {r.method} at batch {r.batch}: steps drafted by method: {steps}"
                     + (f"; steps per compute path: {paths}" if paths else ""))
        lines += [f"  - {n} request(s): {route}" for route, n in sorted(r.routes.items(), key=lambda x: -x[1])]
    return lines


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired_ratio(pairs: list[float], base_pairs: list[float], tok_per_s: float, base_tok_per_s: float) -> float:
    """A row's speed over its plain row's: the median of their paired tok/s (``Row.paired_tok_per_s``: per prompt
    at batch 1, per round batched, each pair run back to back so both met the same spell of a shared machine),
    or the ratio of their tok/s where nothing pairs. The ratio of two medians mixed prompts of different lengths
    and rounds of different spells: a method that drafted nothing measured 0.94-1.06x of plain decoding at batch
    1 and 1.08x at batch 16 from one run to the next. The bench's speedup column and ``batch_plot`` both read it."""
    if pairs and len(pairs) == len(base_pairs):
        return statistics.median(x / y for x, y in zip(pairs, base_pairs))
    return tok_per_s / base_tok_per_s


def warm_up(llm, ids: list[int], params) -> None:
    """One full-length request, then :func:`start_cold`: the first timed prompt's prefill is cold on this engine as
    on every other (the plain engine's first prompt was warm)."""
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    start_cold(llm)


def start_cold(llm) -> None:
    """Nothing of earlier requests helps the next ones: the prefix cache empty and no drafter keeping their text
    (suffix's global trie had drafted a repeated prompt's whole answer from the warm-up's or an earlier round's)."""
    llm.engine.block_manager.reset_prefix_cache()
    spec = llm.engine.speculator
    for p in spec.proposers.values() if spec is not None else ():
        p.forget_requests()
