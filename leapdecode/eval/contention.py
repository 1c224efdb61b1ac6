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

``--systems leapdecode,llama.cpp,hf`` measures llama.cpp (llama-cpp-python, the same GGUF, as many threads as
CPUs available) and HF transformers (float32, torch's default threads) beside the same neighbours, in the same
run, so the table says whether leapdecode holds up better than the engines users would run instead.

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
from pathlib import Path

from leapdecode.eval.plotting import pyplot

WAIT_ENV = {
    "leapdecode": {},  # leapdecode's own default: OpenMP's waits, the thread count tuned per step (ThreadTuner)
    "spin": {"GOMP_SPINCOUNT": "300000"},  # what libgomp does when nothing is set
    "short": {"GOMP_SPINCOUNT": "10000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
SYSTEMS = ("leapdecode", "llama.cpp", "hf")
HOG = "while True: pass"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Measurement:
    system: str
    wait: str
    threads: str
    hogs: int
    tok_s: float
    ratio_to_quiet: float = 1.0
    tuner: str = "-"  # leapdecode's thread tuner at the end: its count, switches and probes (e.g. "1 s1 p2")


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
    tuner = llm.engine.thread_tuner
    state = "-" if tuner is None else f"{tuner.current} s{tuner.num_switches} p{tuner.num_probes}"
    return {"tok_s": statistics.median(speeds), "threads": torch.get_num_threads(), "tuner": state}


def llamacpp_worker(model: str | None, tokens: int, repeats: int) -> dict[str, float]:
    """llama.cpp's worker: the same prompt and timing, through llama-cpp-python on the same GGUF file."""
    from llama_cpp import Llama

    from leapdecode.models.loader import resolve_model
    from leapdecode.threads import available_cpus

    path = resolve_model(model)
    if path.is_dir():
        raise ValueError("llama.cpp needs a .gguf model")
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=available_cpus(), verbose=False)
    ids = llm.tokenize(PROMPT.encode())

    def decode(n: int) -> int:
        llm.reset()
        made = 0
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            made += 1
            if made >= n:
                break
        return made

    decode(8)
    speeds = []
    for _ in range(repeats):
        start = time.perf_counter()
        speeds.append(decode(tokens) / (time.perf_counter() - start))
    return {"tok_s": statistics.median(speeds), "threads": available_cpus()}


def hf_worker(model: str | None, tokens: int, repeats: int) -> dict[str, float]:
    """HF transformers' worker (float32, its own thread count), loading a GGUF as transformers does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leapdecode.models.loader import resolve_model

    path = resolve_model(model)
    where = {"pretrained_model_name_or_path": str(path)} if path.is_dir() else {
        "pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    tok = AutoTokenizer.from_pretrained(**where)
    hf = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    x = tok(PROMPT, return_tensors="pt").input_ids
    speeds = []
    with torch.inference_mode():
        hf.generate(x, max_new_tokens=8, do_sample=False)
        for _ in range(repeats):
            start = time.perf_counter()
            out = hf.generate(x, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            speeds.append((out.shape[1] - x.shape[1]) / (time.perf_counter() - start))
    return {"tok_s": statistics.median(speeds), "threads": torch.get_num_threads()}


def measure(args: argparse.Namespace, system: str, wait: str, threads: str, hogs: int) -> dict:
    """The answer of a fresh ``system`` worker (leapdecode: with ``wait`` and ``threads``) while ``hogs`` busy
    processes run: decode tok/s, and leapdecode's tuner state."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(WAIT_ENV.get(wait, {}))
    cmd = [sys.executable, "-m", "leapdecode.eval.contention", "--worker", system, "--tokens", str(args.tokens)]
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
        raise RuntimeError(f"the {system} worker failed ({wait}, {threads} threads, {hogs} hogs): "
                           f"{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def configurations(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(system, wait, threads) to measure: leapdecode's waits x thread counts, the other systems as they come."""
    systems = args.systems.split(",")
    for name in systems:
        if name not in SYSTEMS:
            raise ValueError(f"--systems takes {', '.join(SYSTEMS)}; got {name!r}")
    for wait in args.waits.split(","):
        if wait not in WAIT_ENV:
            raise ValueError(f"--waits takes {', '.join(WAIT_ENV)}; got {wait!r}")
    out = [("leapdecode", w, t) for w in args.waits.split(",") for t in args.threads.split(",")
           if "leapdecode" in systems]  # fmt: skip
    return out + [(name, "-", "auto") for name in systems if name != "leapdecode"]


def run(args: argparse.Namespace) -> list[Measurement]:
    rows: list[Measurement] = []
    for system, wait, threads in configurations(args):
        quiet = None
        for hogs in (int(h) for h in args.hogs.split(",")):
            answer = measure(args, system, wait, threads, hogs)
            tok_s, tuner = float(answer["tok_s"]), str(answer.get("tuner", "-"))
            quiet = tok_s if quiet is None else quiet  # the first hog count (0 by default) is the baseline
            rows.append(Measurement(system, wait, threads, hogs, round(tok_s, 1), round(tok_s / quiet, 3), tuner))
            print(f"{system:10s} {wait:10s} {threads:>7s} {hogs:5d} {tok_s:9.1f} {tok_s / quiet:8.2f}x  {tuner}",
                  flush=True)
    return rows


def write_plot(rows: list[Measurement], path: Path) -> None:
    """tok/s of each configuration by the number of busy neighbours, as grouped bars (PNG)."""
    plt = pyplot()
    configs = list(dict.fromkeys((r.system, r.wait, r.threads) for r in rows))
    hogs = sorted({r.hogs for r in rows})
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(configs)
    for i, cfg in enumerate(configs):
        speed = {r.hogs: r.tok_s for r in rows if (r.system, r.wait, r.threads) == cfg}
        label = cfg[0] if cfg[1] in ("-", "leapdecode") and cfg[2] == "auto" else " ".join(cfg)
        ax.bar([h + (i - (len(configs) - 1) / 2) * width for h in hogs], [speed.get(h, 0) for h in hogs], width,
               label=label)
    ax.set_xticks(hogs, [f"{h} busy" if h else "quiet" for h in hogs])
    ax.set_ylabel("batch-1 decode tok/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m leapdecode.eval.contention", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled model)")
    p.add_argument("--tokens", type=int, default=96, help="tokens decoded per timed run (default: 96)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is kept")
    p.add_argument("--waits", default="leapdecode,spin", help=f"comma list of {', '.join(WAIT_ENV)} "
                   "(default: leapdecode,spin)")
    p.add_argument("--systems", default="leapdecode", help=f"comma list of {', '.join(SYSTEMS)} (default: "
                   "leapdecode; llama.cpp needs llama-cpp-python and a .gguf model)")
    p.add_argument("--threads", default="auto", help="comma list of thread counts or auto (default: auto)")
    p.add_argument("--hogs", default="0,1,2", help="busy neighbour counts; the first is the baseline (default 0,1,2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per worker run")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--plot", default=None, help="also draw tok/s by busy neighbours to this PNG (needs matplotlib)")
    p.add_argument("--worker", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-threads", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "leapdecode":
        print(json.dumps(worker(args.model, args.worker_threads, args.tokens, args.repeats)))
        return 0
    if args.worker:
        run_worker = llamacpp_worker if args.worker == "llama.cpp" else hf_worker
        print(json.dumps(run_worker(args.model, args.tokens, args.repeats)))
        return 0
    from leapdecode.threads import available_cpus

    print(f"batch-1 greedy decode, {args.tokens} tokens, {available_cpus()} CPUs available to this process")
    configurations(args)  # bad --systems / --waits: an error before anything runs
    print(f"{'system':10s} {'wait':10s} {'threads':>7s} {'hogs':>5s} {'tok/s':>9s} {'x quiet':>9s}  "
          "tuner (count, switches, probes)")
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    if args.plot:
        write_plot(rows, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
