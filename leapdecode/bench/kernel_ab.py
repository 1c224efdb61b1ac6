"""Two builds of the CPU kernels timed in one process: this checkout's and a baseline checkout's.

Run: ``python -m leapdecode.bench.kernel_ab --baseline ../base --rows 1,4,16``, where ``../base`` is another checkout
of this project (e.g. ``git worktree add ../base HEAD~1``); ``--shape batch`` times n sequences of one new token
each instead of one sequence's n (a tree's or draft's rows). The baseline's kernels are built in a child process
under their own name (a build's name carries its checkout's path) and loaded next to this checkout's; the model
is loaded once, and whole decode steps run with ``extension.ext`` set to one build or the other, switching every
``--switch-every`` steps. On a shared VM two processes a few minutes apart can differ by more than most kernel
changes (10-50%), while steps interleaved in one process see the same machine; this is how the kernels' A/Bs in
docs/bench were measured. Each row count's step is also run once per build and its logits and hidden rows compared:
a kernel change that should keep the bits shows ``identical``. An A/A run (the same commit as the baseline) shows
the resolution: on a 2-vCPU VM, 300 steps read 0.92-1.005x in the plain medians' ratio and 0.998-1.002x in the
per-cycle median, so read the per-cycle column; a few percent in the plain ratio is noise.

Both builds read the weights as this checkout packs them, so a baseline whose record layout differs is not
comparable (its logits differ, and the tool says so). A baseline from before this tool (2026-12-07) registers its
suffix-trie class globally; this checkout's registers it locally, so the two still load side by side.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType

import torch

from leapdecode.bench.step_rows import scratch_step
from leapdecode.config import KV_CACHE_DTYPES
from leapdecode.engine.model_runner import ForwardResult
from leapdecode.kernels import extension
from leapdecode.llm import LLM

_BUILD = ("import sys; sys.path.insert(0, sys.argv[1]); from leapdecode.kernels import extension; "
          "print(extension.load_kernel(True).__file__)")


def baseline_kernels(checkout: Path) -> ModuleType:
    """The baseline checkout's compiled kernels: built (or found built) by a child process importing that
    checkout, then loaded here from the shared library it names."""
    if not (checkout / "leapdecode" / "kernels" / "extension.py").is_file():
        raise SystemExit(f"--baseline {checkout}: not a checkout of this project (no leapdecode/kernels/extension.py)")
    if checkout.resolve() == Path(extension.__file__).resolve().parents[2]:
        raise SystemExit("--baseline is this checkout: give another one (e.g. git worktree add ../base HEAD~1)")
    print(f"building or finding the baseline's kernels ({checkout}) ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-c", _BUILD, str(checkout.resolve())], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the baseline's kernels did not build:\n{done.stderr.strip()[-2000:]}")
    library = Path(done.stdout.strip().splitlines()[-1])
    spec = importlib.util.spec_from_file_location(library.name.split(".")[0], library)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same_bits(a: list[ForwardResult], b: list[ForwardResult]) -> str:
    """``identical``, or the largest difference between two builds' logits and hidden rows of one step."""
    pairs = [pair for x, y in zip(a, b, strict=True) for pair in ((x.logits, y.logits), (x.hidden, y.hidden))]
    if all(torch.equal(x, y) for x, y in pairs):
        return "identical"
    return f"differ (max |diff| {max(float((x - y).abs().max()) for x, y in pairs):.3g})"


def interleaved(llm: LLM, builds: tuple[ModuleType, ModuleType], rows: int, context: int, steps: int,
                every: int, shape: str = "tree") -> tuple[list[float], list[float], str]:
    """Seconds of ``steps`` steps of ``rows`` new tokens after ``context`` cached ones (one sequence's for the
    ``tree`` shape, one each of ``rows`` sequences for ``batch``), the builds taking turns every ``every`` steps;
    and whether one step's results are the same bits under both."""
    runner = llm.engine.runner
    times: tuple[list[float], list[float]] = ([], [])
    current = extension.ext
    try:
        with ExitStack() as stack:
            seqs, per_seq = (1, rows) if shape == "tree" else (rows, 1)
            items = scratch_step(stack, llm, context, seqs, per_seq, "a kernel A/B")
            outputs = []
            for build in builds:
                extension.ext = build
                outputs.append(runner.execute(items))
            bits = same_bits(*outputs)
            for i in range(2 * every + steps):  # a warm-up round of both, then the timed steps
                which = (i // every) % 2
                extension.ext = builds[which]
                t0 = time.perf_counter()
                runner.execute(items)
                if i >= 2 * every:
                    times[which].append(time.perf_counter() - t0)
    finally:
        extension.ext = current
    return times[0], times[1], bits


def cycle_ratios(old: list[float], new: list[float], every: int) -> tuple[float, float, float]:
    """The baseline / this-build time ratio of each cycle (``every`` steps of each build, back to back), as the
    quartiles over cycles: a slow spell moves both halves of a cycle, so the ratios spread less than the times."""
    cycles = min(len(old), len(new)) // every

    def part(xs: list[float], c: int) -> float:
        return statistics.median(xs[c * every:(c + 1) * every])

    ratios = sorted(part(old, c) / part(new, c) for c in range(cycles))
    if len(ratios) < 2:
        return (ratios[0],) * 3 if ratios else (float("nan"),) * 3
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    return q1, q2, q3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m leapdecode.bench.kernel_ab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, required=True, help="another checkout of this project")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled model)")
    p.add_argument("--linear-kernel", default="auto", help="the engine's linear_kernel (e.g. packed-int8act)")
    p.add_argument("--rows", default="1,4,16", help="comma list of new tokens per step")
    p.add_argument("--shape", default="tree", choices=("tree", "batch"),
                   help="the rows as one sequence's (a tree's or draft's) or as one token each of that many sequences")
    p.add_argument("--context", type=int, default=128, help="cached tokens before the step")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="the engine's KV cache")
    p.add_argument("--steps", type=int, default=400, help="timed steps per row count, both builds together")
    p.add_argument("--switch-every", type=int, default=4, help="steps of one build before the other's")
    a = p.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",") if r.strip()]
    if not rows or min(rows) < 1 or a.steps < 2 or a.switch_every < 1 or a.context < 0:
        p.error("--rows must list counts >= 1, --steps >= 2, --switch-every >= 1, --context >= 0")
    this = extension.load_kernel(required=True)
    base = baseline_kernels(a.baseline)
    options = {"linear_kernel": a.linear_kernel, "kv_cache_dtype": a.kv_cache_dtype}
    llm = LLM(model=a.model, **options) if a.model else LLM(**options)
    torch.set_num_threads(llm.engine.num_threads)
    print("| rows | baseline ms | this checkout ms | speedup | per-cycle speedup, median (middle half) | results |\n"
          "|---|---|---|---|---|---|")
    for n in rows:
        old, new, bits = interleaved(llm, (base, this), n, a.context, a.steps, a.switch_every, a.shape)
        b, t = statistics.median(old) * 1e3, statistics.median(new) * 1e3
        q1, q2, q3 = cycle_ratios(old, new, a.switch_every)
        print(f"| {n} | {b:.2f} | {t:.2f} | {b / t:.3f}x | {q2:.3f}x ({q1:.3f}-{q3:.3f}) | {bits} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
