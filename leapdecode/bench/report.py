"""``leapdecode bench --report DIR``: one latency table and one quality table for every method, with plots.

Latency (per method and batch size, greedy; the methods interleaved group by group): time per output token,
throughput, speedup over plain decoding at the same batch (paired group by group), mean tokens per target step,
and memory: the model's weights (bytes a decode step reads), what the drafter holds of its own
(``Proposer.memory_bytes``) and the KV blocks the batch's sequences occupy at their full length. Quality (batch 1,
greedy): token identity with plain decoding for every method, and for every method whose output differs (the lossy
options) greedy agreement, the target's perplexity of the produced text and the share of its top choices; with
``--code-tasks N``, pass@1 on the first N HumanEval problems with their tests executed. Beside them: acceptance by
draft position, time per token by context length, memory by batch. Every table and plot
names the hardware. Written as report.md, report.json and four PNGs.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from leapdecode.bench.hardware import machine_info, weight_bytes_per_step
from leapdecode.bench.methods import LOSSY_DEFAULTS, METHOD_DEFAULTS
from leapdecode.bench.report_plots import pyplot, write_plots
from leapdecode.bench.rows import median, paired_ratio, start_cold, warm_up
from leapdecode.bench.scored import code_pass_rate, load_code_tasks
from leapdecode.eval.kv_agreement import identical_prefix
from leapdecode.eval.perplexity import completion_nll
from leapdecode.eval.prompts import AGENT_LOOP, load_prompt_set, shared_data_dir
from leapdecode.llm import LLM
from leapdecode.sampling_params import SamplingParams


@dataclass
class LatencyCell:
    """One method at one batch size."""

    method: str
    batch: int
    time_per_token_ms: float  # median over requests of (end-to-end - first token) / (tokens - 1)
    tok_per_s: float  # output tokens of all requests / wall time
    mean_accepted: float  # output tokens per target step
    drafter_mb: float
    kv_mb: float  # KV blocks the largest group of concurrent requests occupies at their full length
    weights_mb: float
    speedup: float | None = None
    identical: str = ""
    token_ids: list[list[int]] = field(default_factory=list, repr=False)
    group_tok_per_s: list[float] = field(default_factory=list, repr=False)  # per group, in the groups' order


@dataclass
class QualityRow:
    method: str
    lossless: bool
    identical: str
    agreement: float | None = None  # mean share of plain greedy's completion reproduced before the first difference
    ppl: float | None = None
    top1_share: float | None = None
    code_pass: str = ""  # "passed/total" on the scored code set


def build_engines(base: LLM, methods: list[str], warm: list[int],
                  params: SamplingParams) -> tuple[dict[str, LLM], dict[str, str]]:
    """An engine per method label sharing ``base``'s weights, each warmed up with one request of ``warm`` (its
    prefix then dropped from the cache); a method that cannot run here (no drafter for this model) is left out
    with the reason."""
    engines: dict[str, LLM] = {}
    missing: dict[str, str] = {}
    for m in tqdm(methods, desc="building engines", leave=False):
        cfg = LOSSY_DEFAULTS.get(m, METHOD_DEFAULTS.get(m))
        try:
            engines[m] = base if cfg is None else LLM.from_engine_of(base, speculative_config=cfg)
        except (ValueError, OSError) as e:
            missing[m] = str(e)
            continue
        warm_up(engines[m], warm, params)
    return engines, missing


def request_groups(prompts_ids: list[list[int]], batch: int) -> list[list[list[int]]]:
    """The prompts in groups of ``batch`` submitted at once (cycled to fill a group when there are fewer)."""
    n = max(len(prompts_ids), batch)
    requests = [prompts_ids[i % len(prompts_ids)] for i in range(n)]
    return [requests[g : g + batch] for g in range(0, n, batch)]


def measure_batch(engines: dict[str, LLM], prompts_ids: list[list[int]], batch: int,
                  params: SamplingParams) -> list[LatencyCell]:
    """Every engine at one batch size, interleaved: group g runs on every engine in turn, starting with engine g
    mod n, so a slow or fast spell of the shared machine lands on all of them alike; each cell keeps its tok/s
    per group, which :func:`compare_to_plain` pairs with plain decoding's on the same group."""
    labels = list(engines)
    groups = request_groups(prompts_ids, batch)
    for llm in engines.values():  # the smaller batches ran these prompts: their answers must not be drafted from
        start_cold(llm)
    outs: dict[str, list] = {m: [] for m in labels}
    walls: dict[str, list[float]] = {m: [] for m in labels}
    bar = tqdm(total=len(labels) * len(groups), desc=f"latency at batch {batch}, interleaved", leave=False)
    for g, group in enumerate(groups):
        for j in [(g + k) % len(labels) for k in range(len(labels))]:
            t0 = time.perf_counter()
            outs[labels[j]].append(engines[labels[j]].generate([{"prompt_token_ids": ids} for ids in group], params,
                                                               use_tqdm=False))
            walls[labels[j]].append(time.perf_counter() - t0)
            bar.update(1)
    bar.close()
    return [_cell(m, engines[m], batch, outs[m], walls[m]) for m in labels]


def _cell(label: str, llm: LLM, batch: int, groups: list[list], walls: list[float]) -> LatencyCell:
    """One method's cell from its groups' outputs and wall times."""
    eng = llm.engine
    per_block = eng.kv_cache.nbytes / eng.block_manager.num_blocks
    bs = eng.config.block_size
    kv = max(sum(math.ceil((len(o.prompt_token_ids) + len(o.outputs[0].token_ids)) / bs) for o in got)
             for got in groups) * per_block / 2**20
    outs = [o for got in groups for o in got]
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = sum(o.metrics.num_target_steps for o in outs)
    tpot = [(o.metrics.e2e_s - o.metrics.ttft_s) * 1e3 / (len(o.outputs[0].token_ids) - 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]
    spec = eng.speculator
    drafter = sum(p.memory_bytes() for p in spec.proposers.values()) / 2**20 if spec is not None else 0.0
    group_tps = [sum(len(o.outputs[0].token_ids) for o in got) / w for got, w in zip(groups, walls)]
    return LatencyCell(label, batch, median(tpot), ntok / sum(walls), ntok / steps if steps else 1.0,
                       drafter, kv, weight_bytes_per_step(eng.model) / 2**20,
                       token_ids=[o.outputs[0].token_ids for o in outs], group_tok_per_s=group_tps)


def compare_to_plain(cells: list[LatencyCell]) -> None:
    """Speedup (the median over groups of a cell's tok/s over plain decoding's on the same group, run back to
    back: :func:`rows.paired_ratio`) and token identity of every cell against plain decoding at its batch size."""
    plain = {c.batch: c for c in cells if c.method == "none"}
    for c in cells:
        ref = plain.get(c.batch)
        if ref is None:
            continue
        c.speedup = paired_ratio(c.group_tok_per_s, ref.group_tok_per_s, c.tok_per_s, ref.tok_per_s)
        same = sum(a == b for a, b in zip(c.token_ids, ref.token_ids))
        c.identical = f"{same}/{len(c.token_ids)}"


def acceptance_by_position(engines: dict[str, LLM]) -> dict[str, list[float]]:
    """Per speculating method: the share of drafts accepted at each draft position (a tree's depth), over
    everything it verified."""
    out = {}
    for label, llm in engines.items():
        spec = llm.engine.speculator
        if spec is not None and spec.position_counts:
            out[label] = [acc / drafted for drafted, acc in spec.position_counts if drafted]
    return out


def time_by_context(engines: dict[str, LLM], prompts_ids: list[list[int]], contexts: list[int],
                    max_tokens: int) -> dict[str, list[tuple[int, float]]]:
    """Time per output token at batch 1 for prompts of each context length (the benchmark prompts concatenated
    and cut), per method."""
    flat = [t for ids in prompts_ids for t in ids]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[tuple[int, float]]] = {m: [] for m in engines}
    bar = tqdm(total=len(engines) * len(contexts), desc="time per token by context", leave=False)
    for ctx in contexts:
        ids = (flat * (ctx // max(1, len(flat)) + 1))[:ctx]
        for label, llm in engines.items():
            o = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            n = len(o.outputs[0].token_ids)
            out[label].append((ctx, (o.metrics.e2e_s - o.metrics.ttft_s) * 1e3 / max(1, n - 1)))
            bar.update(1)
    bar.close()
    return out


def quality_rows(cells: list[LatencyCell], base: LLM, prompts_ids: list[list[int]],
                 code: dict[str, str]) -> list[QualityRow]:
    """The quality table from the batch-1 cells: identity for all; drift measures where the output differs."""
    ones = {c.method: c for c in cells if c.batch == 1}
    plain = ones["none"]
    rows = []
    for label, c in ones.items():
        row = QualityRow(label, label not in LOSSY_DEFAULTS, c.identical, code_pass=code.get(label, ""))
        if c.token_ids != plain.token_ids or label == "none":
            fracs = [identical_prefix(a, b) / max(1, len(b)) for a, b in zip(c.token_ids, plain.token_ids)]
            row.agreement = sum(fracs) / max(1, len(fracs))
            scored = [completion_nll(base.engine, p, o, top1=True) for p, o in zip(prompts_ids, c.token_ids)]
            count = max(1, sum(s[1] for s in scored))
            row.ppl = math.exp(sum(s[0] for s in scored) / count)
            row.top1_share = sum(s[2] for s in scored) / count
        rows.append(row)
    return rows


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else f"{v:{spec}}"


def latency_table(cells: list[LatencyCell], hw: str) -> list[str]:
    lines = ["## Latency", "", f"Hardware: {hw}", "",
             "| method | batch | time per token ms | tok/s | speedup | mean accepted | weights MB | drafter MB | "
             "KV MB | identical to none |", "|" + "---|" * 10]
    for c in cells:
        lines.append(f"| {c.method} | {c.batch} | {c.time_per_token_ms:.1f} | {c.tok_per_s:.1f} | "
                     f"{_fmt(c.speedup, '.2f')}{'x' if c.speedup else ''} | {c.mean_accepted:.2f} | "
                     f"{c.weights_mb:.0f} | {c.drafter_mb:.1f} | {c.kv_mb:.2f} | {c.identical} |")
    groups = {c.batch: len(c.group_tok_per_s) for c in cells}
    lines += ["", "Each batch size's requests run in groups of that many, submitted at once, every method on a group "
              "in turn (rotating which goes first); tok/s is a method's tokens over its wall time, and the speedup "
              "the median over groups of its tok/s over plain decoding's on the same group. Groups per batch size: "
              + ", ".join(f"{b}: {n}" for b, n in groups.items()) + "."]
    return lines


def quality_table(rows: list[QualityRow], hw: str, code_note: str) -> list[str]:
    lines = ["## Quality", "", f"Hardware: {hw}", "",
             "| method | lossless | identical to none (greedy) | greedy agreement | perplexity | top-1 share | "
             f"{code_note} |", "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r.method} | {'yes' if r.lossless else 'no (opt-in)'} | {r.identical} | "
                     f"{_fmt(r.agreement, '.3f')} | {_fmt(r.ppl, '.3f')} | {_fmt(r.top1_share, '.3f')} | "
                     f"{r.code_pass} |")
    lines += ["", "Perplexity, agreement and top-1 share are measured where a method's tokens differ from plain "
              "decoding (and for `none`, the reference); a method whose tokens are identical has plain decoding's.",
              "", "The lossy options (int8 activations, int8 KV, blockwise top-2, auto's lossy branch) against float32 "
              "plain decoding -- wikitext2 perplexity, greedy agreement, multiple-choice accuracy with its 95% "
              "interval -- are in quality.md beside this report (`python -m leapdecode.bench.quality --out DIR`)."]
    return lines


DEFAULT_BATCHES = "1,8"
DEFAULT_CONTEXTS = "128,512,1024"
# the ordinary benchmark's options that the report does not read, and the report's own: each refused without the other
NOT_WITH_REPORT = {"method_config": "--method-config", "compare": "--compare", "drift": "--drift",
                   "no_batched": "--no-batched", "raw": "--raw", "max_prompt_tokens": "--max-prompt-tokens",
                   "prefix_reuse": "--prefix-reuse", "ceiling": "--ceiling", "out": "--out", "explain": "--explain",
                   "plot": "--plot"}
REPORT_ONLY = {"batches": "--batches", "contexts": "--contexts", "code_tasks": "--code-tasks",
               "code_file": "--code-file"}


def check_report_args(args: argparse.Namespace) -> None:
    """Refuse, before anything runs, report options without ``--report`` and benchmark options the report would
    silently ignore, a ``--report`` path that is a file, and counts the report cannot use."""
    if not args.report:
        given = [flag for dest, flag in REPORT_ONLY.items() if getattr(args, dest)]
        if given:
            raise ValueError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --report DIR")
        return
    ignored = [flag for dest, flag in NOT_WITH_REPORT.items() if getattr(args, dest)]
    if args.linear_kernels != "auto":
        ignored.append("--linear-kernels")
    if args.kv_cache_dtype != "auto":
        ignored.append("--kv-cache-dtype")
    if ignored:
        raise ValueError(f"--report does not take {', '.join(ignored)} (the report runs every method's default "
                         "configuration on chat-templated prompts; see leapdecode bench --help)")
    if args.prompts == AGENT_LOOP:
        raise ValueError(f"--report sends independent prompts in groups; {AGENT_LOOP}'s turns wait for their answers: "
                         f"run `leapdecode bench --prompts {AGENT_LOOP}` without --report")
    if Path(args.report).exists() and not Path(args.report).is_dir():
        raise ValueError(f"--report {args.report}: a file is there; give a folder (created if missing)")
    if args.num_prompts < 1 or args.max_tokens < 2 or args.code_tasks < 0:
        raise ValueError(f"--report needs --num-prompts >= 1 and --max-tokens >= 2 (time per token is measured after "
                         f"the first), and --code-tasks >= 0; got {args.num_prompts}, {args.max_tokens}, "
                         f"{args.code_tasks}")


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{what} must list integers >= 1, got {text!r}")
    return vals


def report_methods(arg: str) -> list[str]:
    """``--methods`` for a report: every method and lossy option when left at ``none``, else the list given."""
    names = list(METHOD_DEFAULTS) + list(LOSSY_DEFAULTS) if arg == "none" else \
        [m.strip() for m in arg.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHOD_DEFAULTS and m not in LOSSY_DEFAULTS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join([*METHOD_DEFAULTS, *LOSSY_DEFAULTS])}")
    return ["none"] + [m for m in names if m != "none"]


def cmd_report(args: argparse.Namespace) -> int:
    """Run every method, fill both tables and draw the plots into ``args.report``."""
    # every check before the runs, not after them (the options: check_report_args, from cmd_bench): matplotlib,
    # the lists, the code set, the contexts
    pyplot()
    batches = _parse_ints(args.batches or DEFAULT_BATCHES, "--batches")
    contexts = _parse_ints(args.contexts or DEFAULT_CONTEXTS, "--contexts")
    methods = report_methods(args.methods)
    tasks = load_code_tasks(Path(args.code_file) if args.code_file else shared_data_dir() / "code" /
                            "humaneval.jsonl", args.code_tasks)
    out = Path(args.report)
    out.mkdir(parents=True, exist_ok=True)
    command = args.command_line or "leapdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    base = LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(64, max(batches)),
               num_threads=args.threads)
    if max(contexts) >= base.engine.max_model_len:
        raise ValueError(f"--contexts {args.contexts}: the model's context is {base.engine.max_model_len} tokens")
    prompts = load_prompt_set(args.prompts, args.num_prompts)
    prompts_ids = [base.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    engines, missing = build_engines(base, methods, prompts_ids[0], params)
    hw = machine_info()
    cells = [c for batch in tqdm(batches, desc="latency table") for c in
             measure_batch(engines, prompts_ids, batch, params)]
    compare_to_plain(cells)
    accept = acceptance_by_position(engines)
    by_ctx = time_by_context(engines, prompts_ids, contexts, min(args.max_tokens, 32))
    code = {label: code_pass_rate(llm, tasks, args.max_tokens) for label, llm in
            tqdm(engines.items(), desc="code tasks", leave=False)} if tasks else {}
    quality = quality_rows(cells, base, prompts_ids, code)
    model = Path(str(base.engine.model_path)).name
    header = [f"# leapdecode report: {model}", "", f"- command: `{command}`", f"- hardware: {hw}",
              f"- prompts: {args.prompts} ({len(prompts)}), {args.max_tokens} new tokens, greedy, batches "
              f"{batches}, contexts {contexts}", ""]
    code_note = f"code pass@1 ({len(tasks)} HumanEval, tests run)" if tasks else "code pass@1 (not run)"
    md = header + latency_table(cells, hw) + [""] + quality_table(quality, hw, code_note)
    md += ["", "## Plots", "", f"Hardware: {hw}", ""]
    md += [f"![{name}]({name}.png)" for name in ("speedup", "acceptance_by_position", "tpot_vs_context",
                                                 "memory_vs_batch")]
    if missing:
        md += ["", "## Not run here", ""] + [f"- {m}: {why}" for m, why in missing.items()]
    (out / "report.md").write_text("\n".join(md) + "\n")
    data = {
        "command": command, "hardware": hw, "model": model, "batches": batches, "contexts": contexts,
        "plot_title": f"{model} on {hw.split(',')[0]}",
        "latency": [{k: v for k, v in asdict(c).items() if k != "token_ids"} for c in cells],
        "quality": [asdict(q) for q in quality], "acceptance_by_position": accept,
        "time_per_token_by_context": by_ctx, "not_run": missing}
    (out / "report.json").write_text(json.dumps(data, indent=2))
    write_plots(out, data["plot_title"], data)
    print(f"wrote {out / 'report.md'}, report.json and 4 plots", file=sys.stderr)
    return 0


def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", default=None, metavar="DIR",
                   help="write the latency and quality tables of every method (or of those --methods names) to "
                   "DIR as report.md and report.json, with four PNG plots; reads the model options, --prompts, "
                   "--num-prompts, --max-tokens, --ignore-eos and the four options below, and refuses the others")
    p.add_argument("--batches", default=None,
                   help=f"--report: batch sizes of the latency table (default {DEFAULT_BATCHES})")
    p.add_argument("--contexts", default=None,
                   help=f"--report: prompt lengths for time per token against context (default {DEFAULT_CONTEXTS})")
    p.add_argument("--code-tasks", type=int, default=0,
                   help="--report: score pass@1 on the first N HumanEval problems, running their tests (default 0)")
    p.add_argument("--code-file", default=None, help="--report: a HumanEval-style jsonl instead of the shared one")


__all__ = ["LatencyCell", "QualityRow", "add_report_args", "check_report_args", "cmd_report"]
