"""Batch-1 decode speed on a quiet machine and beside busy processes: how much of its speed leapdecode keeps when
other programs want the same cores.

For each configuration (how OpenMP threads wait at barriers, how many threads) and each number of busy neighbours
(``while True: pass`` processes), a fresh worker process loads the model, warms up, and times greedy decoding of
``--tokens`` tokens (median of ``--repeats`` runs). A fresh process per run is needed because the OpenMP runtime
reads its wait settings once, when torch is imported. It prints tok/s and the ratio to the same configuration's
quiet speed. With one neighbour on a 2-core machine a fair share of the CPU would keep about 0.5x.

Waits: ``leapdecode`` is leapdecode's default (:mod:`leapdecode.threads`: sleep at once), ``spin`` libgomp's own
default (300,000 spin rounds, then sleep), ``short`` a 10,000-round spin, ``passive`` / ``active``
``OMP_WAIT_POLICY``'s two settings.

Run: ``python -m leapdecode.eval.contention`` (bundled model, ~1-2 minutes); ``--waits short,spin,passive
--threads auto,1`` compares more configurations (``--waits leapdecode`` alone halves the time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

WAIT_ENV = {
    "leapdecode": {},  # leapdecode's own default: OpenMP's waits, the thread count tuned per step (ThreadTuner)
    "spin": {"GOMP_SPINCOUNT": "300000"},  # what libgomp does when nothing is set
    "short": {"GOMP_SPINCOUNT": "10000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
HOG = "while True: pass"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Measurement:
    wait: str
    threads: str
    hogs: int
    tok_s: float
    ratio_to_quiet: float = 1.0


def worker(model: str | None, threads: int | None, tokens: int, repeats: int) -> dict[str, float]:
    """In the worker process: load, warm up, time ``repeats`` greedy decodes of ``tokens`` tokens."""
    import torch

    from leapdecode import LLM, SamplingParams

    llm = LLM(model=model, num_threads=threads, kv_cache_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    speeds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = llm.generate(PROMPT, params, use_tqdm=False)[0]
        speeds.append(len(out.outputs[0].token_ids) / (time.perf_counter() - start))
    return {"tok_s": statistics.median(speeds), "threads": torch.get_num_threads()}


def measure(args: argparse.Namespace, wait: str, threads: str, hogs: int) -> float:
    """Decode tok/s of a fresh worker with ``wait`` and ``threads`` while ``hogs`` busy processes run."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(WAIT_ENV[wait])
    cmd = [sys.executable, "-m", "leapdecode.eval.contention", "--worker", "--tokens", str(args.tokens)]
    cmd += ["--repeats", str(args.repeats)] + (["--model", args.model] if args.model else [])
    if threads != "auto":
        cmd += ["--worker-threads", threads]
    busy = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if done.returncode != 0:
        raise RuntimeError(f"the worker failed ({wait}, {threads} threads, {hogs} hogs): {done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["tok_s"])


def run(args: argparse.Namespace) -> list[Measurement]:
    rows: list[Measurement] = []
    for wait in args.waits.split(","):
        if wait not in WAIT_ENV:
            raise ValueError(f"--waits takes {', '.join(WAIT_ENV)}; got {wait!r}")
        for threads in args.threads.split(","):
            quiet = None
            for hogs in (int(h) for h in args.hogs.split(",")):
                tok_s = measure(args, wait, threads, hogs)
                quiet = tok_s if quiet is None else quiet  # the first hog count (0 by default) is the baseline
                rows.append(Measurement(wait, threads, hogs, round(tok_s, 1), round(tok_s / quiet, 3)))
                print(f"{wait:10s} {threads:>7s} {hogs:5d} {tok_s:9.1f} {tok_s / quiet:8.2f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m leapdecode.eval.contention", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled model)")
    p.add_argument("--tokens", type=int, default=96, help="tokens decoded per timed run (default: 96)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is kept")
    p.add_argument("--waits", default="leapdecode,spin", help=f"comma list of {', '.join(WAIT_ENV)} "
                   "(default: leapdecode,spin)")
    p.add_argument("--threads", default="auto", help="comma list of thread counts or auto (default: auto)")
    p.add_argument("--hogs", default="0,1,2", help="busy neighbour counts; the first is the baseline (default 0,1,2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per worker run")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-threads", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.model, args.worker_threads, args.tokens, args.repeats)))
        return 0
    from leapdecode.threads import available_cpus

    print(f"batch-1 greedy decode, {args.tokens} tokens, {available_cpus()} CPUs available to this process")
    print(f"{'wait':10s} {'threads':>7s} {'hogs':>5s} {'tok/s':>9s} {'x quiet':>9s}")
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
