"""Step cost by rows: what one target forward of n new tokens costs, for each linear kernel, next to llama.cpp.

Run: ``python -m leapdecode.bench.step_rows --model FILE.gguf --linear-kernels auto,packed-int8act``. Two shapes of
a step with n rows are timed on the engine's own model runner (scratch sequences borrowed from the KV pool, as the
speculative cost model times its steps):

- ``tree``: one sequence verifying n new tokens after ``--context`` cached ones (draft or tree verification);
- ``batch``: n sequences of ``--context`` cached tokens, one new token each (a batched decode step).

Each cell is the median of ``--repeats`` timings in milliseconds and its ratio to the one-row step. With
``--compare llama.cpp`` llama.cpp's time to evaluate n tokens after the same context (its verification curve, in a
child process) is added, so the ratios sit side by side in one run. The batch shape is also printed as decode
throughput (n sequences' tokens per second of their step). Under each kernel's rows sits its floor: the larger
of reading the weights once at the measured bandwidth and the rows' projection multiply-adds at the arithmetic
peak measured for the kernel's instruction (int8 VNNI / AVX2, float32 FMA) on all threads at once; a step within
a few tenths of its floor has little left to gain from its kernels. ``--out OUT`` writes the tables to OUT.md, the
timings to OUT.json and the curves to OUT.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from leapdecode.bench.external import llamacpp_step_costs, run_isolated
from leapdecode.bench.hardware import (
    machine_info,
    macs_per_row,
    measure_bandwidth_gbps,
    measure_peak_macs,
    weight_bytes_per_step,
)
from leapdecode.config import KV_CACHE_DTYPES
from leapdecode.engine.model_runner import ForwardItem
from leapdecode.eval.plotting import pyplot
from leapdecode.layers import int8_gemm
from leapdecode.llm import LLM
from leapdecode.threads import THREADS_HELP, available_cpus

SHAPES = ("tree", "batch")
LLAMACPP = "llama.cpp (n tokens of one sequence)"


def scratch_step(stack: ExitStack, llm: LLM, context: int, seqs: int, per_seq: int, why: str) -> list[ForwardItem]:
    """One step of ``seqs`` scratch sequences, each ``context`` cached tokens and ``per_seq`` new ones (a fixed
    spread of token ids), borrowed from the KV pool until ``stack`` closes."""
    bm = llm.engine.block_manager
    tables = [stack.enter_context(bm.borrowed(context + per_seq, why)) for _ in range(seqs)]
    return [ForwardItem(t, context, [(7 * i + 11) % 1000 + 100 for i in range(per_seq)], list(range(per_seq)))
            for t in tables]


def step_costs(llm: LLM, rows: list[int], context: int, shape: str, repeats: int) -> list[float]:
    """Median seconds of one forward of each row count in ``rows`` after ``context`` cached tokens. The row counts
    are timed in turn, ``repeats`` rounds after a warm-up round, so a slow spell of a shared machine lands on all
    of them alike."""
    eng = llm.engine
    runner = eng.runner
    torch.set_num_threads(eng.num_threads)
    times: list[list[float]] = [[] for _ in rows]
    with ExitStack() as stack:
        steps = []
        for n in rows:
            seqs, per_seq = (1, n) if shape == "tree" else (n, 1)
            steps.append(scratch_step(stack, llm, context, seqs, per_seq, "a step-cost timing"))
        for rnd in range(repeats + 1):
            for i, items in enumerate(steps):
                t0 = time.perf_counter()
                runner.execute(items)
                if rnd:
                    times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def llamacpp_costs(path: str, rows: list[int], context: int, threads: int | None, repeats: int) -> list[float]:
    """llama.cpp's seconds to evaluate n tokens after ``context`` tokens (child process, see bench/external.py)."""
    from llama_cpp import Llama  # an optional dependency, imported where it is needed (as bench/external.py does)

    llm = Llama(model_path=path, n_ctx=max(512, context + max(rows) + 16), n_threads=threads or available_cpus(),
                n_batch=max(512, max(rows)), verbose=False)
    ctx = [(13 * i + 5) % 1000 + 100 for i in range(context)]
    return [t for _, t in llamacpp_step_costs(llm, ctx, tuple(rows), repeats)]


def format_row(label: str, costs: list[float]) -> str:
    return f"| {label} | " + " | ".join(f"{t * 1e3:.2f} ({t / costs[0]:.2f}x)" for t in costs) + " |"


def format_throughput(label: str, rows: list[int], costs: list[float]) -> str:
    """A batch-shape row as decode throughput: n sequences' tokens per second of their step, and its ratio to the
    first row count's (the decode-only side of batching: no prefill, scheduling or sampling)."""
    rates = [n / t for n, t in zip(rows, costs)]
    return f"| {label} | " + " | ".join(f"{r:.0f} ({r / rates[0]:.2f}x)" for r in rates) + " |"


def step_floor(llm: LLM, rows: list[int], bandwidth_gbps: float) -> tuple[str, list[float]] | None:
    """The floor under a step of each row count for this CPU engine's kernels: the larger of reading its weights
    once at ``bandwidth_gbps`` and its rows' projection multiply-adds at the measured arithmetic peak of the
    kernels' instruction (int8: VNNI or AVX2; float32: FMA). Attention and the rest of a step come on top. Rows
    that run on AMX tiles get the weight stream alone (their peak is not measured; the stream still bounds them).
    None where the peak cannot be measured (no built kernels)."""
    eng = llm.engine
    kind = "int8" if getattr(eng.model, "int8_activations", False) else "float32"
    peak = measure_peak_macs(kind)
    if peak is None:
        return None
    stream = weight_bytes_per_step(eng.model) / (bandwidth_gbps * 1e9)
    macs = macs_per_row(eng.model.config)
    amx = int8_gemm.amx_rows() if kind == "int8" else 0
    label = (f"floor: {macs / 1e6:.0f}M multiply-adds per row at {peak / 1e9:.0f} G/s ({kind} peak), "
             f"{stream * 1e3:.2f} ms weight stream" + (f"; from {amx} rows (AMX tiles) the stream only" if amx else ""))
    return label, [stream if amx and n >= amx else max(stream, n * macs / peak) for n in rows]


def measure(a: argparse.Namespace, rows: list[int], shapes: list[str]) -> tuple[str | None, dict[str, list[float]],
                                                                               dict[str, list[float]]]:
    """The model's path; per series (system, kernel, shape) the median seconds of each row count's step; per
    kernel its floor (step_floor), labelled with what it is made of."""
    series: dict[str, list[float]] = {}
    floors: dict[str, list[float]] = {}
    path = None
    bandwidth = 0.0  # the machine's read bandwidth: measured once, for every kernel's floor
    for kernel in (k for k in a.linear_kernels.split(",") if k):
        llm = LLM(model=a.model, linear_kernel=kernel, num_threads=a.threads, max_num_seqs=max(64, max(rows)),
                  kv_cache_dtype=a.kv_cache_dtype)
        path = str(llm.engine.model_path)
        if getattr(llm.engine.model, "int8_activations", False) and int8_gemm.amx_rows():
            print(f"{kernel}: AMX tiles from {int8_gemm.amx_rows()} rows (measured at start-up)", flush=True)
        kv = "" if a.kv_cache_dtype == "auto" else f", {a.kv_cache_dtype} KV"
        for shape in shapes:
            label = f"leapdecode {kernel}{kv}, {shape}"
            series[label] = step_costs(llm, rows, a.context, shape, a.repeats)
            print(format_row(label, series[label]), flush=True)
        if llm.engine.device.type == "cpu":
            bandwidth = bandwidth or measure_bandwidth_gbps(llm.engine.device)
            floor = step_floor(llm, rows, bandwidth)
            if floor is not None:
                floors[f"{kernel}: {floor[0]}"] = floor[1]
        del llm
    if a.compare == "llama.cpp" and path is not None and path.endswith(".gguf"):
        costs = run_isolated(llamacpp_costs, path, rows, a.context, a.threads, a.repeats, what="llama.cpp")
        if costs:
            series[LLAMACPP] = costs
    return path, series, floors


def tables(path: str | None, rows: list[int], series: dict[str, list[float]], context: int,
           floors: dict[str, list[float]] | None = None) -> str:
    """The step-cost table (ms, x one row), for the batch shape the decode-throughput table, and each kernel's
    floor (ms, x its own one-row floor)."""
    out = [f"{path}: {torch.get_num_threads()} threads, {context} cached tokens; median ms per step (x one row)", "",
           "| system, kernel, shape | " + " | ".join(f"{r} rows" for r in rows) + " |", "|---|" + "---|" * len(rows)]
    out += [format_row(label, costs) for label, costs in series.items()]
    batch = {label.removesuffix(", batch"): c for label, c in series.items() if label.endswith(", batch")}
    if batch:
        out += ["", "Decode throughput of the batch shape: tokens/s of n sequences' step (x the first row count)", "",
                "| kernel | " + " | ".join(f"batch {r}" for r in rows) + " |", "|---|" + "---|" * len(rows)]
        out += [format_throughput(label, rows, costs) for label, costs in batch.items()]
    if floors:
        out += ["", "Floor of a step's projections: the larger of the weight stream and the rows' multiply-adds at "
                "the arithmetic peak (ms, x one row's floor); attention and the rest come on top", "",
                "| kernel: floor | " + " | ".join(f"{r} rows" for r in rows) + " |", "|---|" + "---|" * len(rows)]
        out += [format_row(label, costs) for label, costs in floors.items()]
    return "\n".join(out)


def write_plot(png: Path, title: str, rows: list[int], series: dict[str, list[float]],
               floors: dict[str, list[float]] | None = None) -> None:
    """ms per step and its ratio to one row, by rows (log scale), one line per series; each kernel's floor as a
    thin grey line on the ms side."""
    plt = pyplot()
    fig, (ax_ms, ax_x) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, (label, costs) in enumerate((floors or {}).items()):
        ax_ms.plot(rows, [c * 1e3 for c in costs], ("-.", ":", "--")[i % 3], color="grey", linewidth=1.0,
                   label=label.split(":")[0] + ": floor")
    for label, costs in series.items():
        style = "--" if label == LLAMACPP else ":" if label.endswith("batch") else "-"
        ax_ms.plot(rows, [c * 1e3 for c in costs], style, marker="o", label=label)
        ax_x.plot(rows, [c / costs[0] for c in costs], style, marker="o", label=label)
    for ax, ylabel in ((ax_ms, "ms per step"), (ax_x, "x one row")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(rows, [str(r) for r in rows])
        ax.set_xlabel("rows in the step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_x.legend(fontsize=7)
    if floors:
        ax_ms.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled model)")
    p.add_argument("--linear-kernels", default="auto,packed-int8act", help="comma list of linear_kernel settings")
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="comma list of row counts (the first is the 1x)")
    p.add_argument("--shapes", default="tree,batch", help=f"comma list of: {', '.join(SHAPES)}")
    p.add_argument("--context", type=int, default=128, help="cached tokens before the step")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the engines' KV cache (int8: quantized on write, lossy; the batch shape reads it per "
                        "sequence)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--compare", default="", help="llama.cpp: its time to evaluate n tokens after the context")
    p.add_argument("--out", default=None, help="also write OUT.md (the tables), OUT.json and OUT.png (the curves)")
    a = p.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",") if r]
    shapes = [s for s in a.shapes.split(",") if s]
    if not rows or min(rows) < 1 or not set(shapes) <= set(SHAPES) or a.compare not in ("", "llama.cpp"):
        p.error("--rows: positive integers; --shapes: tree, batch; --compare: llama.cpp")
    if a.out:
        pyplot()  # a missing matplotlib fails before the timings, not after them
    path, series, floors = measure(a, rows, shapes)
    text = tables(path, rows, series, a.context, floors)
    print("\n" + text)
    if a.out:
        cpu = machine_info()
        Path(a.out + ".md").write_text(f"CPU: {cpu}\n\n{text}\n")
        Path(a.out + ".json").write_text(json.dumps({
            "model": path, "cpu": cpu, "threads": torch.get_num_threads(), "context": a.context, "rows": rows,
            "repeats": a.repeats, "seconds": series, "floor_seconds": floors}, indent=1))
        name = Path(path).name if path else "model"
        write_plot(Path(a.out + ".png"), f"step cost by rows: {name}, {a.context} cached tokens\n{cpu}", rows, series,
                   floors)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
