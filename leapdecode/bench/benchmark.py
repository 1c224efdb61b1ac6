"""``leapdecode bench``: every system and method on the same prompts, side by side in one run.

Rows are measured one after another in this process with the same prompts and token budget; ratios (speedup over
``none``, batched over batch-1) come from the same run, which is what makes them meaningful on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from leapdecode.bench.external import peak_rss_mb, run_hf, run_isolated, run_llamacpp
from leapdecode.bench.hardware import machine_info, measure_bandwidth_gbps, weight_bytes_per_step
from leapdecode.bench.methods import LOSSY_DEFAULTS, METHOD_DEFAULTS
from leapdecode.bench.report import add_report_args, check_report_args, cmd_report
from leapdecode.bench.report_plots import pyplot
from leapdecode.bench.rows import Row, explain_rows, median, paired_ratio, start_cold, warm_up
from leapdecode.bench.workload import AgentLoop, Run, Workload, load_workload, speedup_by_turn
from leapdecode.cli_args import add_tensor_parallel_arg
from leapdecode.config import KV_CACHE_DTYPES
from leapdecode.eval.kv_agreement import identical_prefix
from leapdecode.eval.perplexity import completion_nll
from leapdecode.gc_heap import startup_heap_frozen
from leapdecode.layers import int8_gemm
from leapdecode.layers.small_gemm import packed_formats
from leapdecode.llm import LLM
from leapdecode.sampling_params import SamplingParams
from leapdecode.speculative.policy import StepCostModel, scratch_step
from leapdecode.threads import THREADS_HELP

BATCHED_ROUNDS = 3  # batched rows: the median of this many runs per engine, interleaved like batch-1 requests


def run_leapdecode(engines: list[tuple[str, object]], workload: Workload, params,
                   batched: bool) -> list[tuple[Row, Row | None]]:
    """Batch-1 rows for every (label, LLM) in ``engines``, interleaved: request i runs on every engine in turn
    (starting with engine i mod n), so a slow or fast spell of a shared machine lands on all of them alike and the
    ratios between rows hold even when absolute speed drifts. Then batched rows (every wave of requests at once),
    the median of ``BATCHED_ROUNDS`` rounds over the engines in rotating order (one run each varied by +-20% here).
    Each engine's batch-1 run and each round start cold (:func:`rows.start_cold`); an agent loop's sessions go on
    in each engine with its own answers."""
    n = len(engines)
    runs = [Run() for _ in range(n)]
    outs: list[list] = [[] for _ in range(n)]
    wall: list[list[float]] = [[] for _ in range(n)]
    for _, llm in engines:
        start_cold(llm)
    bar = tqdm(total=n * workload.num_requests, desc="batch 1, interleaved", leave=False)
    for i in range(workload.num_requests):  # numbered so that a session's turns come in order
        for j in [(i + k) % n for k in range(n)]:
            ids = workload.prompt_ids(runs[j], i)
            t0 = time.perf_counter()
            out = engines[j][1].generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            wall[j].append(time.perf_counter() - t0)
            outs[j].append(out)
            workload.record(runs[j], i, out.outputs[0].text)
            bar.update(1)
    bar.close()
    brows: list[list[Row]] = [[] for _ in range(n)]
    if batched and workload.batch > 1:  # every wave at once, BATCHED_ROUNDS times per engine, rotating order
        for r in tqdm(range(BATCHED_ROUNDS), desc="batched rounds", leave=False):
            for j in [(r + k) % n for k in range(n)]:
                brows[j].append(_batched_row(engines[j][1], engines[j][0], workload, params))
    result = []
    for (label, _), o, w, b in zip(engines, outs, wall, brows):
        row = _batch1_row(label, o, w)
        brow = sorted(b, key=lambda x: x.tok_per_s)[len(b) // 2] if b else None  # the median round
        if brow is not None:
            brow.paired_tok_per_s = [x.tok_per_s for x in b]  # in round order
        print(f"  {label}: {row.tok_per_s:.1f} tok/s at batch 1" + (
            f", {brow.tok_per_s:.1f} tok/s at batch {brow.batch}" if brow else ""), file=sys.stderr, flush=True)
        result.append((row, brow))
    return result


def _amx_note(model) -> str:
    """Where the int8-activation kernel takes AMX tiles (kernel_plan measures from how many rows at start-up)."""
    rows = int8_gemm.amx_rows() if getattr(model, "int8_activations", False) else 0
    return f", AMX tiles from {rows} rows" if rows else ""


def _batch1_row(label: str, outs: list, wall: list[float]) -> Row:
    tps = [len(o.outputs[0].token_ids) / w for o, w in zip(outs, wall)]
    tpot = [(w - o.metrics.ttft_s) * 1e3 / (len(o.outputs[0].token_ids) - 1)
            for o, w in zip(outs, wall) if len(o.outputs[0].token_ids) > 1]
    row = _row(label, 1, outs, median(tps), median(tpot))
    row.paired_tok_per_s = tps
    return row


def paired_speedup(row: Row, base: Row) -> float:
    """``row``'s speed over ``base``'s (:func:`rows.paired_ratio`), paired only between rows of one batch size
    (external systems carry no pairs: the ratio of their tok/s)."""
    pairs = row.paired_tok_per_s if row.batch == base.batch else []
    return paired_ratio(pairs, base.paired_tok_per_s, row.tok_per_s, base.tok_per_s)


def _batched_row(llm, label: str, workload: Workload, params) -> Row:
    """All requests, each wave submitted at once after the one before, started cold (the batch-1 rows and earlier
    rounds left every prompt cached and every answer in suffix's global trie)."""
    start_cold(llm)
    run, outs = Run(), {}
    t0 = time.perf_counter()
    for wave in workload.waves:
        got = llm.generate([{"prompt_token_ids": workload.prompt_ids(run, i)} for i in wave], params, use_tqdm=False)
        for i, o in zip(wave, got):
            outs[i] = o
            workload.record(run, i, o.outputs[0].text)
    w = time.perf_counter() - t0
    ordered = [outs[i] for i in range(workload.num_requests)]
    tpot = [(o.metrics.e2e_s - o.metrics.ttft_s) * 1e3 / max(1, len(o.outputs[0].token_ids) - 1) for o in ordered]
    return _row(label, workload.batch, ordered, sum(len(o.outputs[0].token_ids) for o in ordered) / w, median(tpot))


def _row(label: str, batch: int, outs: list, tok_per_s: float, tpot_ms: float) -> Row:
    """What batch-1 and batched rows share: token counts, median TTFT, tokens per target step, the tokens."""
    steps = sum(o.metrics.num_target_steps for o in outs)
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    return Row("leapdecode", label, batch, len(outs), ntok, tok_per_s, median([o.metrics.ttft_s * 1e3 for o in outs]),
               tpot_ms, ntok / steps if steps else 1.0, token_ids=[o.outputs[0].token_ids for o in outs],
               prompt_ids=[list(o.prompt_token_ids) for o in outs],
               num_lossy_tokens=sum(o.metrics.num_lossy_tokens for o in outs),
               num_draft_tokens=sum(o.metrics.num_draft_tokens for o in outs),
               routes=dict(Counter(o.metrics.route for o in outs if o.metrics.route)),
               draft_methods=dict(sum((Counter(o.metrics.draft_methods) for o in outs), Counter())),
               compute_paths=dict(sum((Counter(o.metrics.compute_paths) for o in outs), Counter())))


CEILING_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 65)  # verified rows per step at which the target's step is timed


def target_step_costs(llm, context: int, repeats: int = 9):
    """The target's step time by verified rows at ``context`` cached tokens, measured as the engine's own cost
    model measures it (``StepCostModel``: median of ``repeats``, made non-decreasing, piecewise linear)."""
    eng, bm = llm.engine, llm.engine.block_manager
    torch.set_num_threads(eng.num_threads)  # every granted thread, whatever a tuner last left (scratch steps bypass it)
    # only sizes whose scratch sequence fits the idle pool: scratch_step skips the others, which would time nothing
    sizes = tuple(n for n in CEILING_ROWS if bm.blocks_needed(context + n) <= bm.num_free_blocks)
    return StepCostModel.calibrate(lambda n: scratch_step(eng.runner, bm, n, context), sizes=sizes,
                                   repeats=repeats)


def add_ceiling(rows: list[Row], costs) -> None:
    """Fill verified rows and the free-drafting ceiling of the batch-1 leapdecode rows run under ``costs``.
    Rows per step are the mean over the row's steps; the cost curve is near-linear in rows here, so t(mean rows)
    is close to the mean of t(rows) (exact for fixed-size drafts)."""
    for r in rows:
        if r.system != "leapdecode" or r.batch != 1:
            continue
        steps = r.output_tokens / r.mean_accepted
        r.verified_rows = 1.0 + r.num_draft_tokens / steps if steps else 1.0
        r.ceiling = r.mean_accepted * costs(1) / costs(r.verified_rows)


def run_prefix_reuse(llm, prefix_ids: list[list[int]], question: str) -> str:
    """Two requests that share a long prefix: the second reuses the cached blocks and its TTFT drops."""
    tok = llm.get_tokenizer()
    shared = [t for ids in prefix_ids for t in ids][: llm.engine.max_model_len // 2]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.engine.block_manager.reset_prefix_cache()
    lines = ["| run | prompt tokens | cached prompt tokens | TTFT ms |", "|---|---|---|---|"]
    for label, tail in (("cold", " First question?"), ("warm", " " + question)):
        ids = shared + tok.encode(tail)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        m = out.metrics
        lines.append(f"| {label} | {m.num_prompt_tokens} | {m.num_cached_prompt_tokens} | {m.ttft_s * 1e3:.0f} |")
    return "\n".join(lines)


def add_drift(rows: list[Row], engine) -> None:
    """Fill the drift columns of every leapdecode row against plain greedy decoding at the same batch size:
    identical-prefix agreement, the share of top-choice tokens (1 - lossy tokens / output tokens) and the
    target's perplexity of the produced text given the prompts the row sent (``eval.perplexity.completion_nll``)."""
    ref = {r.batch: r for r in rows if r.system == "leapdecode" and r.method == "none"}
    for r in rows:
        base = ref.get(r.batch)
        if r.system != "leapdecode" or base is None:
            continue
        fracs = [identical_prefix(a, b) / max(1, len(b)) for a, b in zip(r.token_ids, base.token_ids)]
        r.agreement = sum(fracs) / max(1, len(fracs))
        scored = [completion_nll(engine, p, o, top1=True) for p, o in zip(r.prompt_ids, r.token_ids)]
        r.ppl = math.exp(sum(s[0] for s in scored) / max(1, sum(s[1] for s in scored)))
        if r.kernel:  # another precision: which of its tokens the reference model would have chosen, teacher-forced
            r.top1_share = sum(s[2] for s in scored) / max(1, sum(s[1] for s in scored))
        else:  # the reference model's own run: exactly the tokens no lossy acceptance rule let through
            r.top1_share = 1.0 - r.num_lossy_tokens / max(1, r.output_tokens)


def _cells(values: tuple[tuple[float | None, str], ...]) -> str:
    return "".join(f" {'' if v is None else f'{v:{fmt}}'} |" for v, fmt in values)


def format_table(rows: list[Row]) -> str:
    drift = any(r.ppl is not None for r in rows)
    ceiling = any(r.ceiling is not None for r in rows)
    memory = any(r.peak_rss_mb is not None for r in rows)
    extra = ((" verified rows | ceiling (free drafting) |" if ceiling else "")
             + (" greedy agreement | top-1 share | ppl |" if drift else "")
             + (" load s | peak RSS MiB |" if memory else ""))
    head = ("| system | method | batch | tok/s | TTFT ms | TPOT ms | mean accepted | speedup | identical to none "
            "| weight GB/s |" + extra)
    lines = [head, "|" + "---|" * (10 + extra.count("|"))]
    for r in rows:
        line = (
            f"| {r.system} | {r.method} | {r.batch} | {r.tok_per_s:.1f} | {r.ttft_ms:.0f} | {r.tpot_ms:.1f} | "
            f"{r.mean_accepted:.2f} | {'' if r.speedup is None else f'{r.speedup:.2f}x'} | {r.identical} | "
            f"{'' if r.gb_per_s is None else f'{r.gb_per_s:.1f}'} |"
        )
        if ceiling:
            line += _cells(((r.verified_rows, ".2f"), (r.ceiling, ".2f")))
        if drift:
            line += _cells(((r.agreement, ".3f"), (r.top1_share, ".3f"), (r.ppl, ".3f")))
        if memory:
            line += _cells(((r.load_s, ".2f"), (r.peak_rss_mb, ".0f")))
        lines.append(line)
    return "\n".join(lines)


def write_plot(path: Path, title: str, rows: list[Row], step_costs: dict[str, list[tuple[int, float]]]) -> None:
    """A PNG beside the tables: batch-1 tok/s per system (and kernel), and with --ceiling each step-cost curve
    relative to its own 1-row step."""
    plt = pyplot()
    ones = [r for r in rows if r.batch == 1]
    fig, axes = plt.subplots(1, 2 if step_costs else 1, figsize=(11 if step_costs else 6, 3.8), squeeze=False)
    ax = axes[0][0]
    labels = [f"{r.system}\n{r.method}" + (f"\n[{r.kernel}]" if r.kernel else "") for r in ones]
    ax.bar(range(len(ones)), [r.tok_per_s for r in ones], color=["#4c72b0" if r.system == "leapdecode" else "#c44e52"
                                                                  for r in ones])  # fmt: skip
    ax.set_xticks(range(len(ones)), labels, fontsize=7)
    ax.set_ylabel("tok/s (batch 1, median)")
    ax.set_title(title, fontsize=9)
    if step_costs:
        ax = axes[0][1]
        for tag, pts in step_costs.items():
            ax.plot([n for n, _ in pts], [t / pts[0][1] for _, t in pts], marker="o", label=tag)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows evaluated in one step")
        ax.set_ylabel("step time / 1-row step")
        ax.set_title("verification cost (flat = cheap drafts)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_methods(spec: str, overrides: dict) -> list[str]:
    """The method labels of ``--methods`` (``none`` first, added if left out); a label that is not a method must
    be configured in full by ``--method-config``."""
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    for m in methods:
        # a label of one's own names a configuration given in full by --method-config (e.g. several blockwise k)
        if m not in METHOD_DEFAULTS and "method" not in overrides.get(m, {}):
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHOD_DEFAULTS)}, or give the label "
                             'a full configuration in --method-config, e.g. \'{"bw4": {"method": "blockwise", '
                             '"num_speculative_tokens": 4}}\'')
    if "none" not in methods:
        methods.insert(0, "none")
    return methods


def bench_header(args: argparse.Namespace, num_prompts: int, command: str, base: LLM, wbytes: int, bw: float,
                 load: tuple[float, float]) -> list[str]:
    """The lines above the table: the command, the machine, the model, the bandwidth, load time and memory."""
    eng = base.engine
    load_s, peak_mb = load
    return [
        f"# leapdecode bench — {args.prompts} ({num_prompts} prompts, {args.max_tokens} max new tokens, greedy)",
        "",
        f"- command: `{command}`",
        f"- machine: {machine_info()}",
        f"- model: {eng.model_path} ({wbytes / 1e6:.0f} MB of weights read per decode step; {args.dtype} compute, "
        f"kernel formats {packed_formats(eng.model) or 'none (torch linear)'}{_amx_note(eng.model)})",
        f"- measured read bandwidth: {bw:.1f} GB/s (sum over a 512 MB buffer)",
        f"- leapdecode load: {load_s:.2f} s; peak RSS after load and one request: {peak_mb:.0f} MiB (KV pool "
        f"{eng.kv_cache.nbytes / 2**20:.0f} MiB, {args.kv_cache_dtype} cache)",
        "",
    ]


def external_rows(rows: list[Row], compare: list[str], base: LLM, prompts_ids: list[list[int]],
                  args: argparse.Namespace, ceiling_context: int) -> list[tuple[int, float]]:
    """--compare: HF transformers' and llama.cpp's batch-1 rows, appended to ``rows``; returns llama.cpp's step
    costs by rows at ``ceiling_context`` cached tokens (none when 0 or not compared)."""
    eng = base.engine
    eos = [] if args.ignore_eos else list(eng.eos_token_ids)
    if "hf" in compare:
        rows.append(run_hf(eng.model_path, prompts_ids, args.max_tokens, eos, eng.device, base.config.torch_dtype))
    if "llama.cpp" in compare:
        r = run_isolated(run_llamacpp, eng.model_path, prompts_ids, args.max_tokens, eos, args.threads,
                         ceiling_context, what="llama.cpp")
        if r:
            rows.append(r[0])
            return r[1]
    return []


def method_engines(base: LLM, args: argparse.Namespace, kernels: list[str], methods: list[str], overrides: dict,
                   warm: tuple[list[int], SamplingParams]) -> tuple[list[tuple[str, str, LLM]], dict[str, LLM]]:
    """(label, kernel tag, LLM) for every kernel and method, and each kernel's plain engine by tag. Every further
    kernel gets its own engine (its weights are packed differently); its rows are labelled and checked for identity
    against its own ``none``, their speedup is against the first kernel's ``none``."""
    engines: list[tuple[str, str, LLM]] = []
    kernel_llms: dict[str, LLM] = {}
    for kernel in kernels:
        kbase = base if kernel == kernels[0] else LLM(model=args.model, dtype=args.dtype, device=args.device,
                                                      max_num_seqs=base.engine.config.max_num_seqs,
                                                      linear_kernel=kernel, num_threads=args.threads,
                                                      kv_cache_dtype=args.kv_cache_dtype)
        if kbase is not base:
            warm_up(kbase, *warm)
        tag = "" if kernel == kernels[0] else kernel
        kernel_llms[tag] = kbase
        for m in methods:
            cfg = METHOD_DEFAULTS.get(m, {})
            if cfg is not None:
                cfg = {**cfg, **overrides.get(m, {})}
            llm = kbase if cfg is None else LLM.from_engine_of(kbase, speculative_config=cfg)
            engines.append((f"{m} [{tag}]" if tag else m, tag, llm))
    return engines, kernel_llms


def score_rows(rows: list[Row], wbytes: int) -> None:
    """Each row's speedup and token identity against its ``none`` (see the notes under the table), and at batch 1
    its weight bytes streamed per second."""
    plain = {(r.kernel, r.batch): r for r in rows if r.system == "leapdecode" and r.method.split(" [")[0] == "none"}
    ref = {b: r for (k, b), r in plain.items() if k == ""}
    for r in rows:
        base_row = ref.get(r.batch) if r.system == "leapdecode" else ref.get(1)
        if base_row is not None:
            r.speedup = paired_speedup(r, base_row)
            cmp = plain.get((r.kernel, r.batch), base_row) if r.system == "leapdecode" else ref[1]
            if cmp is r:  # a `none` row: the first kernel's is the reference, a further kernel's is compared to it
                cmp = base_row if r.kernel else None
            if cmp is not None:
                same = sum(a == b for a, b in zip(r.token_ids, cmp.token_ids))
                r.identical = f"{same}/{len(r.token_ids)}"
        if r.batch == 1 and r.system == "leapdecode":
            r.gb_per_s = wbytes / (r.tpot_ms / 1e3) / 1e9 / r.mean_accepted


def ceiling_costs(kernel_llms: dict[str, LLM], rows: list[Row], context: int) -> dict[str, list[tuple[int, float]]]:
    """--ceiling: each kernel's target step cost by verified rows at ``context`` cached tokens, measured after the
    runs (so the caches and the allocator are as warm as they were for the rows), and its rows' ceilings."""
    step_costs: dict[str, list[tuple[int, float]]] = {}
    for tag, kllm in kernel_llms.items():
        costs = target_step_costs(kllm, context)
        add_ceiling([r for r in rows if r.kernel == tag], costs)
        step_costs[tag] = costs.points
        print(f"target step time by verified rows{f' [{tag}]' if tag else ''} at {context} cached tokens: "
              + ", ".join(f"{n}: {t * 1e3:.2f} ms ({t / costs(1):.2f}x)" for n, t in costs.points), flush=True)
    return step_costs


def bench_notes(rows: list[Row], step_costs: dict[str, list[tuple[int, float]]], explain: bool) -> list[str]:
    """What the table's columns mean, as printed under it."""
    notes = [
        "",
        "tok/s at batch 1 is the median over requests of output tokens / end-to-end time; batch-1 requests are "
        "interleaved (each prompt runs on every engine in turn, so a slow spell of a shared machine hits all rows "
        "alike; external systems run after them). Batched rows are total output tokens / wall time with all "
        f"requests submitted at once (agent_loop: each turn of every session at once, turn after turn; median of "
        f"{BATCHED_ROUNDS} rounds, engines in rotating order). Every engine's batch-1 run and every round start "
        "with an empty prefix cache and no earlier request's text in a drafter. "
        "speedup is against leapdecode `none` at the "
        "same batch size (the median of the two rows' tok/s ratios on the same prompt at batch 1, in the same round "
        "batched; external systems against leapdecode batch 1). weight GB/s = weight bytes per target step / "
        "time per target step. Rows labelled [kernel] ran with that linear_kernel; their `identical` column compares "
        "with `none` under the same kernel (their speedup is still against the first `none`), and `none [kernel]`'s "
        "own column compares it with the first `none`.",
    ]
    if any(r.ppl is not None for r in rows):
        notes.append("Drift (lossy methods): greedy agreement = mean share of plain greedy's completion reproduced "
                     "before the first differing token; top-1 share = share of emitted tokens that were the target's "
                     "top choice given the text before them; ppl = the target's perplexity of the produced "
                     "completions given their prompts (the `none` row is the reference).")
    if step_costs:
        notes.append("Ceiling (--ceiling): verified rows = tokens the target checks per step (1 + drafts), mean over "
                     "the row's steps; ceiling = mean accepted x t(1) / t(verified rows), the speedup this acceptance "
                     "would give if drafting and the engine's bookkeeping cost nothing, with t the target's step "
                     "time measured after the runs: " + "; ".join(
                         (f"[{tag}] " if tag else "") + ", ".join(f"{n} rows {t * 1e3:.2f} ms" for n, t in pts)
                         for tag, pts in step_costs.items()) + ".")
    if explain:
        notes += ["", "Routes of the speculative `auto` router (--explain):", "", *explain_rows(rows)]
    return notes


def write_outputs(out: Path, text: str, meta: dict, rows: list[Row]) -> None:
    """OUT.md (the header, table and notes) and OUT.json (``meta`` and the rows without their tokens)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({
        **meta, "rows": [{k: v for k, v in asdict(r).items() if k not in ("token_ids", "prompt_ids")} for r in rows]},
        indent=2))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> int:
    check_report_args(args)
    if args.plot:
        pyplot()  # a missing matplotlib fails before the runs, not after them
    if args.report:
        return cmd_report(args)
    overrides = json.loads(args.method_config) if args.method_config else {}
    methods = bench_methods(args.methods, overrides)
    compare = [c.strip() for c in (args.compare or "").split(",") if c.strip()]
    for c in compare:
        if c not in ("hf", "llama.cpp"):
            raise ValueError(f"--compare takes hf and/or llama.cpp, got {c!r}")
    command = "leapdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if args.command_line is None \
        else args.command_line
    kernels = [k.strip() for k in (args.linear_kernels or "auto").split(",") if k.strip()]
    t_load = time.perf_counter()
    if args.tensor_parallel_size > 1 and (methods != ["none"] or len(kernels) > 1):
        raise ValueError("--tensor-parallel-size > 1 benchmarks plain decoding with one kernel (--methods none): "
                         "the other rows share the first engine's weights, which live in its worker processes")
    base = LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(64, args.num_prompts or 0),
               linear_kernel=kernels[0], num_threads=args.threads, tensor_parallel_size=args.tensor_parallel_size,
               kv_cache_dtype=args.kv_cache_dtype)
    load_s = time.perf_counter() - t_load
    eng = base.engine
    workload = load_workload(base, args.prompts, args.num_prompts, args.raw, args.max_prompt_tokens)
    first = workload.first_prompt()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    base.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    peak_mb = peak_rss_mb()  # load + one full request, before the bandwidth probe's buffer
    # the bandwidth probe streams 512 MB, which evicts the Q4 weights (112 MB for SmolLM2) from a large L3: probe
    # first, then warm up with one full-length request, so the first measured row does not pay for refilling the
    # caches, first-touch page faults of the KV pool or the allocator's growth
    bw = measure_bandwidth_gbps(eng.device)
    warm_up(base, first, params)
    wbytes = weight_bytes_per_step(eng.model)
    header = bench_header(args, workload.num_requests, command, base, wbytes, bw, (load_s, peak_mb))
    print("\n".join(header), flush=True)
    engines, kernel_llms = method_engines(base, args, kernels, methods, overrides, (first, params))
    with startup_heap_frozen():  # no full collection of the start-up heap inside a timed request (gc_heap.py)
        results = run_leapdecode([(label, llm) for label, _, llm in engines], workload, params,
                                 batched=not args.no_batched)
    rows: list[Row] = []
    for (_, tag, _), (r1, rb) in zip(engines, results):
        for r in (r1, rb):
            if r:
                r.kernel = tag
                rows.append(r)
    first_none = next(r for r in rows if r.method == "none" and r.batch == 1 and not r.kernel)
    first_none.load_s, first_none.peak_rss_mb = load_s, peak_mb
    prompts_ids = first_none.prompt_ids  # what plain decoding was sent (an agent loop's turns carry its answers)
    context = int(statistics.median(len(ids) for ids in prompts_ids)) + args.max_tokens // 2
    llamacpp_costs = external_rows(rows, compare, base, prompts_ids, args, context if args.ceiling else 0)
    score_rows(rows, wbytes)
    if args.drift or any(r.num_lossy_tokens for r in rows):  # every lossy run reports its drift
        add_drift(rows, eng)
    step_costs = ceiling_costs(kernel_llms, rows, context) if args.ceiling else {}
    if args.ceiling and llamacpp_costs:
        step_costs["llama.cpp"] = llamacpp_costs
    table = format_table(rows)
    if args.prefix_reuse:
        table += "\n\nPrefix caching (a long shared prefix, then a second request with a different question):\n\n"
        table += run_prefix_reuse(base, prompts_ids, "Second question?")
    notes = bench_notes(rows, step_costs, args.explain)
    if isinstance(workload, AgentLoop):
        notes += speedup_by_turn(rows, first_none, workload)
    print(table)
    print("\n".join(notes))
    if args.out:
        write_outputs(Path(args.out), "\n".join(header) + "\n" + table + "\n" + "\n".join(notes) + "\n", {
            "command": command, "machine": machine_info(), "bandwidth_gbps": bw, "weight_bytes": wbytes,
            "prompts": args.prompts, "num_prompts": workload.num_requests, "max_tokens": args.max_tokens,
            "step_costs_s": step_costs}, rows)
    if args.plot:
        curves = {(k if k == "llama.cpp" else f"leapdecode {k}".strip()): v for k, v in step_costs.items()}
        write_plot(Path(args.plot), Path(str(eng.model_path)).name, rows, curves)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark methods and systems side by side on a prompt set",
        description="Runs each decoding method (and optionally HF transformers / llama.cpp) on the same prompts "
        "in one process and prints tokens/s, TTFT, time per output token, mean accepted tokens, speedup over "
        "plain decoding and whether the output is token-identical to it.",
    )
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP + " (also llama.cpp's with --compare)")
    add_tensor_parallel_arg(p)
    p.add_argument("--prompts", default="mt_bench",
                   help="mt_bench (default), grounded (summaries/extraction over WikiText passages), mixed (the two "
                   "alternating: some requests copy, some chat), agentic (coding-agent requests over HumanEval "
                   "functions: a shared system prompt and tools, a function pasted back, an edit asked), "
                   "agent_loop (the same agent as sessions of three turns over each function: every request resends "
                   "the session so far with the engine's own earlier answers, so the prefix cache and the drafters "
                   "see what a coding agent's server sees; batched rows send each turn of all sessions at once), or "
                   "a question.jsonl path (Spec-Bench style 'turns', or 'prompt' records)")
    p.add_argument("--num-prompts", type=int, default=8, help="requests (agent_loop: turns over all sessions)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="keep only the last N prompt tokens")
    p.add_argument("--methods", default="none",
                   help=f"comma list of: {', '.join(METHOD_DEFAULTS)}, or labels configured by --method-config; with "
                   f"--report every method when left out, and also the lossy {', '.join(LOSSY_DEFAULTS)}")
    p.add_argument("--method-config", default=None,
                   help='JSON of per-method overrides, e.g. \'{"draft_model": {"model": "path"}}\'; a label that '
                   'is not a method needs a "method" key, e.g. \'{"bw4topk": {"method": "blockwise", '
                   '"num_speculative_tokens": 4, "acceptance": "topk", "top_k": 2}}\'')
    p.add_argument("--drift", action="store_true",
                   help="report drift from plain greedy (agreement, top-1 share, perplexity) for every row; "
                   "automatic when a row used a lossy acceptance rule")
    p.add_argument("--compare", default=None, help="comma list: hf (HF transformers generate), llama.cpp")
    p.add_argument("--no-batched", action="store_true", help="skip the all-prompts-at-once batched rows")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-tokens tokens whatever the model says (every system alike): for speed runs "
                        "on random-weight models, whose text is noise")
    p.add_argument("--raw", action="store_true", help="feed prompts as raw text instead of chat-templated")
    p.add_argument("--prefix-reuse", action="store_true",
                   help="also time a cold and a warm request sharing a long prefix (prefix-cache TTFT)")
    p.add_argument("--linear-kernels", default="auto",
                   help="comma list of linear_kernel settings, each run with every method in its own engine, e.g. "
                   "'auto,packed-int8act' (int8 activations: lossy against float32, opt-in)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="every engine's KV cache, as serve's flag: auto (the model dtype), float32, float16, "
                   "bfloat16, or int8 (quantized on write: lossy, so rows compare with plain decoding over the same "
                   "cache)")
    p.add_argument("--ceiling", action="store_true",
                   help="time the target's step by verified rows and give each batch-1 row the speedup its "
                   "acceptance would reach if drafting were free (mean accepted x t(1) / t(rows)): whether a "
                   "drafter could pay on this machine at all, apart from its own cost")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    p.add_argument("--explain", action="store_true",
                   help="say which route the speculative \"auto\" router took per request, and which methods drafted")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw the batch-1 tok/s and (with --ceiling) the step-cost curves to PNG (needs matplotlib)")
    p.add_argument("--command-line", default=None, help=argparse.SUPPRESS)
    add_report_args(p)
    p.set_defaults(func=cmd_bench)
