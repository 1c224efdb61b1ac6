"""The systems ``leapdecode bench`` compares with (HF transformers, llama.cpp), each measured on the same prompts
as the engine's rows; llama.cpp in a child process of its own, whose crash is reported instead of ending the run."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from leapdecode.bench.rows import Row, median
from leapdecode.threads import available_cpus


def run_hf(model_path: Path, prompts_ids: list[list[int]], max_tokens: int, eos: list[int], device,
           dtype: torch.dtype = torch.float32) -> Row:
    """HF ``generate`` one prompt at a time, in ``dtype`` (the engine's, so a GPU compares bfloat16 with bfloat16)."""
    from transformers import AutoModelForCausalLM

    if model_path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=dtype)
    model = model.to(device).eval()
    tps, tpot, ttft, toks = [], [], [], []
    with torch.inference_mode():
        x = torch.tensor([prompts_ids[0]], device=device)
        model.generate(x, max_new_tokens=4, do_sample=False, **_hf_stop(eos, 4))  # warm-up
        for ids in tqdm(prompts_ids, desc="hf transformers", leave=False):
            x = torch.tensor([ids], device=device)
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, do_sample=False, **_hf_stop(eos, 1))
            t1 = time.perf_counter()
            out = model.generate(x, max_new_tokens=max_tokens, do_sample=False, **_hf_stop(eos, max_tokens))
            w = time.perf_counter() - t1
            gen = out[0, len(ids):].tolist()
            toks.append(gen)
            tps.append(len(gen) / w)
            ttft.append((t1 - t0) * 1e3)
            if len(gen) > 1:
                tpot.append((w - (t1 - t0)) * 1e3 / (len(gen) - 1))
    return Row("hf-transformers", "none", 1, len(prompts_ids), sum(map(len, toks)), median(tps), median(ttft),
               median(tpot), token_ids=toks)


def _hf_stop(eos: list[int], max_new_tokens: int) -> dict:
    """HF ``generate`` arguments that stop at ``eos``, or (empty: ``--ignore-eos``) never stop early."""
    if eos:
        return {"eos_token_id": eos, "pad_token_id": eos[0]}
    return {"min_new_tokens": max_new_tokens, "pad_token_id": 0}


def run_isolated(fn, *args, what: str):
    """``fn(*args)`` in a child process: a native crash there (say, an illegal instruction from a llama.cpp build
    for other CPU features) is reported and skipped instead of losing the whole benchmark run."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(fn, *args).result()
    except BrokenProcessPool:
        print(f"{what} crashed (its process died, e.g. an illegal instruction: rebuild it for this CPU); skipping",
              file=sys.stderr, flush=True)
        return None


def peak_rss_mb() -> float:
    """This process's peak resident set so far (VmHWM), in MiB."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def llamacpp_step_costs(llm, context: list[int], sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 8, 9, 16, 17),
                        repeats: int = 7) -> list[tuple[int, float]]:
    """llama.cpp's time to evaluate n new tokens after ``context`` (median of ``repeats``): its verification cost
    curve, measured as the engine's own step costs are."""
    llm.reset()
    llm.eval(context)
    out = []
    for n in sizes:
        ts = []
        for r in range(repeats):
            llm.n_tokens = len(context)  # eval drops the cache beyond n_tokens first
            t0 = time.perf_counter()
            llm.eval([(context[-1] + i + r) % 1000 + 100 for i in range(n)])
            ts.append(time.perf_counter() - t0)
        out.append((n, median(ts)))
    return out


def run_llamacpp(model_path: Path, prompts_ids: list[list[int]], max_tokens: int, eos: list[int],
                 threads: int | None = None, ceiling_context: int = 0) -> tuple[Row, list[tuple[int, float]]] | None:
    """llama.cpp on the same prompts (batch 1, greedy), in a child process (run_isolated): its row, and with
    ``ceiling_context`` its step cost by evaluated rows."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed (pip install 'leapdecode[llamacpp]'); skipping llama.cpp",
              file=sys.stderr)
        return None
    if model_path.is_dir():
        print("llama.cpp needs a .gguf model; skipping", file=sys.stderr)
        return None
    t_load = time.perf_counter()
    # the CPUs this process was granted, as for leapdecode (os.cpu_count() ignores affinity and cgroup quotas)
    llm = Llama(model_path=str(model_path), n_ctx=4096, n_threads=threads or available_cpus(), verbose=False)
    load_s = time.perf_counter() - t_load
    tps, ttft, tpot, toks = [], [], [], []
    for ids in tqdm(prompts_ids, desc="llama.cpp", leave=False):
        llm.reset()
        gen: list[int] = []
        t0 = time.perf_counter()
        first = None
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter()
            if tok in eos:
                break
            gen.append(tok)
            if len(gen) >= max_tokens:
                break
        w = time.perf_counter() - t0
        toks.append(gen)
        tps.append(len(gen) / w)
        ttft.append(((first or t0) - t0) * 1e3)
        if len(gen) > 1:
            tpot.append((w - ((first or t0) - t0)) * 1e3 / (len(gen) - 1))
    row = Row("llama.cpp", "none", 1, len(prompts_ids), sum(map(len, toks)), median(tps), median(ttft),
              median(tpot), token_ids=toks, load_s=load_s, peak_rss_mb=peak_rss_mb())
    ctx = (prompts_ids[0] * (ceiling_context // max(1, len(prompts_ids[0])) + 1))[:ceiling_context]
    return row, (llamacpp_step_costs(llm, ctx) if ceiling_context else [])
