"""Speedup over plain decoding by batch size, from ``leapdecode bench --out`` runs: one panel per prompt set and
precision, one line per method, so the batch-1 gains and the batched rows' cost sit in one picture.

Run: ``python -m leapdecode.bench.batch_plot OUT.png RUN.json [RUN.json ...]``. Each run contributes its batch-1 and
batched rows (a run of N prompts has batch N); a batch size in several runs takes the run with more requests
(its batch-1 rows are medians over more prompts). Each point is the method's tok/s over plain decoding's at the same
batch and precision, paired as the bench pairs its own speedups (prompt by prompt at batch 1, round by round
batched) where the runs kept the pairs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from leapdecode.bench.report_plots import series_style
from leapdecode.bench.rows import paired_ratio
from leapdecode.eval.plotting import pyplot


def speedups(runs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, dict[int, float]]]:
    """(prompt set, precision) -> method -> batch -> speed over plain decoding at that batch and precision: the
    bench's own speedup (``rows.paired_ratio``: the median of the paired tok/s ratios where both rows carry them,
    else the ratio of their tok/s)."""
    best: dict[tuple[str, str, int, str], tuple[int, dict[str, Any]]] = {}  # -> (requests, row)
    for run in runs:
        for r in run["rows"]:
            if r.get("system", "leapdecode") != "leapdecode":
                continue
            key = (run["prompts"], r["kernel"] or "float32", r["batch"], r["method"].split(" [")[0])
            if key not in best or run["num_prompts"] > best[key][0]:
                best[key] = (run["num_prompts"], r)
    out: dict[tuple[str, str], dict[str, dict[int, float]]] = {}
    for (prompts, kernel, batch, method), (_, row) in best.items():
        plain = best.get((prompts, kernel, batch, "none"))
        if plain is not None and plain[1]["tok_per_s"] > 0:
            out.setdefault((prompts, kernel), {}).setdefault(method, {})[batch] = paired_ratio(
                row.get("paired_tok_per_s") or [], plain[1].get("paired_tok_per_s") or [], row["tok_per_s"],
                plain[1]["tok_per_s"])
    return out


def batch_figure(runs: list[dict[str, Any]], title: str) -> Any:
    """A grid of panels: a row per prompt set, a column per precision."""
    data = speedups(runs)
    sets = sorted({p for p, _ in data})
    kernels = sorted({k for _, k in data}, key=lambda k: (k != "float32", k))
    methods = list(dict.fromkeys(m for panel in sorted(data) for m in data[panel]))
    batches = sorted({b for panel in data.values() for series in panel.values() for b in series})
    plt = pyplot()
    fig, axes = plt.subplots(len(sets), len(kernels), figsize=(4.2 * len(kernels), 2.6 * len(sets) + 0.6),
                             squeeze=False, sharex=True)
    for r, prompts in enumerate(sets):
        for c, kernel in enumerate(kernels):
            ax = axes[r][c]
            for i, method in enumerate(methods):
                series = data.get((prompts, kernel), {}).get(method)
                if series:
                    xs = sorted(series)
                    ax.plot(xs, [series[b] for b in xs], label=method, **series_style(i))
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_title(f"{prompts}, {kernel}", fontsize=9)
            if c == 0:
                ax.set_ylabel("x plain decoding", fontsize=8)
            if r == len(sets) - 1:
                ax.set_xlabel("batch", fontsize=8)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("png", help="the picture to write")
    p.add_argument("runs", nargs="+", help="bench --out JSON files")
    p.add_argument("--title", default=None, help="default: the first run's machine")
    args = p.parse_args(argv)
    runs = [json.loads(Path(f).read_text()) for f in args.runs]
    fig = batch_figure(runs, args.title or runs[0].get("machine", ""))
    fig.savefig(args.png, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
