"""The report's four plots (``leapdecode bench --report``): speedup by method and batch size, acceptance by draft
position, time per token against context length, memory against batch. Each title names the model and hardware."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leapdecode.eval.plotting import pyplot


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def plot_speedup(path: Path, title: str, cells: list[Any]) -> None:
    methods = list(dict.fromkeys(c.method for c in cells))
    batches = sorted({c.batch for c in cells})
    fig, ax = pyplot().subplots(figsize=(max(6.0, 0.7 * len(methods) * len(batches)), 3.8))
    width = 0.8 / len(batches)
    for j, b in enumerate(batches):
        vals = {c.method: c.speedup or 0.0 for c in cells if c.batch == b}
        ax.bar([i + j * width for i in range(len(methods))], [vals.get(m, 0.0) for m in methods], width,
               label=f"batch {b}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(methods))], methods, rotation=30,
                  fontsize=8)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"speedup by method and batch size: {title}", fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_lines(path: Path, title: str, series: dict[str, list[tuple[float, float]]], xlabel: str,
               ylabel: str) -> None:
    fig, ax = pyplot().subplots(figsize=(6.5, 3.8))
    for label, pts in series.items():
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if any(series.values()):
        ax.legend(fontsize=7)
    _save(fig, path)


def write_plots(out: Path, title: str, cells: list[Any], accept: dict[str, list[float]],
                by_ctx: dict[str, list[tuple[int, float]]]) -> None:
    """speedup.png, acceptance_by_position.png, tpot_vs_context.png, memory_vs_batch.png in ``out``."""
    plot_speedup(out / "speedup.png", title, cells)
    plot_lines(out / "acceptance_by_position.png", f"acceptance by draft position: {title}",
               {m: [(j + 1, a) for j, a in enumerate(v)] for m, v in accept.items()}, "draft position",
               "share of drafts accepted")
    plot_lines(out / "tpot_vs_context.png", f"time per token by context: {title}",
               {m: [(c, t) for c, t in v] for m, v in by_ctx.items()}, "prompt tokens", "ms per output token")
    memory: dict[str, list[tuple[float, float]]] = {}
    for c in cells:
        memory.setdefault(c.method, []).append((c.batch, c.weights_mb + c.drafter_mb + c.kv_mb))
    plot_lines(out / "memory_vs_batch.png", f"memory by batch (weights + drafter + KV in use): {title}", memory,
               "batch size", "MB")


__all__ = ["pyplot", "write_plots"]
