"""The report's four plots (``leapdecode bench --report``): speedup by method and batch size, acceptance by draft
position, time per token against context length, memory against batch. Each title names the model and hardware.

:func:`report_figures` builds them from the report's JSON (``report.json``), so what is drawn is exactly what
the JSON holds (tests/test_report.py reads the series back off the figures); :func:`write_plots` saves them, and
``python -m leapdecode.bench.report_plots DIR`` redraws a report's PNGs from its report.json.
Every series of a plot has its own colour (a 20-colour qualitative map, not the 10-colour default cycle that
repeated the first colour at the eleventh series) and its own marker; long titles wrap to fit the figure.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

from leapdecode.eval.plotting import pyplot

PLOTS = ("speedup", "acceptance_by_position", "tpot_vs_context", "memory_vs_batch")
MARKERS = "osD^vP*Xh<>p"
TITLE_CHARS = 78  # characters per title line at fontsize 9 on a 6.5-inch figure


def series_style(i: int) -> dict[str, Any]:
    """Colour and marker of series ``i``: distinct for up to 20 series."""
    return {"color": pyplot().get_cmap("tab20")(i % 20), "marker": MARKERS[i % len(MARKERS)]}


def _title(ax: Any, text: str) -> None:
    ax.set_title("\n".join(textwrap.wrap(text, TITLE_CHARS)), fontsize=9)


def speedup_figure(title: str, latency: list[dict[str, Any]]) -> Any:
    methods = list(dict.fromkeys(c["method"] for c in latency))
    batches = sorted({c["batch"] for c in latency})
    fig, ax = pyplot().subplots(figsize=(max(6.5, 0.7 * len(methods) * len(batches)), 3.8))
    width = 0.8 / len(batches)
    for j, b in enumerate(batches):
        vals = {c["method"]: c["speedup"] or 0.0 for c in latency if c["batch"] == b}
        ax.bar([i + j * width for i in range(len(methods))], [vals.get(m, 0.0) for m in methods], width,
               label=f"batch {b}", color=series_style(j)["color"])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(methods))], methods, rotation=30,
                  fontsize=8)
    ax.set_ylabel("speedup over plain decoding")
    _title(ax, f"speedup by method and batch size: {title}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def lines_figure(title: str, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str) -> Any:
    fig, ax = pyplot().subplots(figsize=(6.5, 4.0))
    for i, (label, pts) in enumerate(series.items()):
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=label, **series_style(i))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _title(ax, title)
    if any(series.values()):
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plotted_series(data: dict[str, Any]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """What each line plot draws, from the report's JSON: plot name -> series label -> (x, y) points."""
    memory: dict[str, list[tuple[float, float]]] = {}
    for c in data["latency"]:
        memory.setdefault(c["method"], []).append((c["batch"], c["weights_mb"] + c["drafter_mb"] + c["kv_mb"]))
    return {
        "acceptance_by_position": {m: [(j + 1, a) for j, a in enumerate(v)]
                                   for m, v in data["acceptance_by_position"].items()},
        "tpot_vs_context": {m: [(c, t) for c, t in v] for m, v in data["time_per_token_by_context"].items()},
        "memory_vs_batch": memory,
    }


def report_figures(data: dict[str, Any], title: str) -> dict[str, Any]:
    """The four figures of a report (name -> matplotlib Figure; close them when done)."""
    series = plotted_series(data)
    return {
        "speedup": speedup_figure(title, data["latency"]),
        "acceptance_by_position": lines_figure(f"acceptance by draft position (a tree's depth): {title}",
                                               series["acceptance_by_position"], "draft position",
                                               "share of drafts accepted"),
        "tpot_vs_context": lines_figure(f"time per token by context: {title}", series["tpot_vs_context"],
                                        "prompt tokens", "ms per output token"),
        "memory_vs_batch": lines_figure(f"memory by batch (weights + drafter + KV in use): {title}",
                                        series["memory_vs_batch"], "batch size", "MB"),
    }


def write_plots(out: Path, title: str, data: dict[str, Any]) -> None:
    """speedup.png, acceptance_by_position.png, tpot_vs_context.png, memory_vs_batch.png in ``out``."""
    for name, fig in report_figures(data, title).items():
        fig.savefig(out / f"{name}.png", dpi=110)
        pyplot().close(fig)


def plot_title(data: dict[str, Any]) -> str:
    """The title every plot of a report carries: model and hardware (reports written before the JSON held it
    are titled from its model and hardware fields, as the report titled them)."""
    return data.get("plot_title") or f"{data['model']} on {data['hardware'].split(',')[0]}"


def main(argv: list[str] | None = None) -> int:
    """Redraw a report's four PNGs from its report.json (the same numbers, today's plotting)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("report", type=Path, help="a `leapdecode bench --report` folder")
    args = ap.parse_args(argv)
    data = json.loads((args.report / "report.json").read_text())
    write_plots(args.report, plot_title(data), data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["PLOTS", "plot_title", "plotted_series", "pyplot", "report_figures", "series_style", "write_plots"]
