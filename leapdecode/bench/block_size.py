"""Mean accepted block of blockwise decoding on held-out prompts: how many tokens a target step emits with a
heads folder, at every block size asked, against plain greedy decoding on the same engine.

Held-out prompts: MT-Bench first turns (the development set, never trained on) and the *last* prompts of the
training-prompt file, which ``leapdecode train distill-data --limit N`` (the first N usable ones) leaves out. Every
block is drafted in full (``use_cost_model: false``), so the figure is the heads' acceptance alone.

    python -m leapdecode.bench.block_size --heads leapdecode/artifacts/blockwise --ks 2,4,8 --out runs/bs.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from leapdecode import LLM, SamplingParams
from leapdecode.eval.prompts import load_questions, shared_data_dir, train_prompts_path
from leapdecode.train.distill import load_training_prompts


def held_out_prompts(num_mt_bench: int, num_train_tail: int) -> dict[str, list[str]]:
    """``{"mt_bench": first turns, "train_tail": the last prompts of the training file}``."""
    data = shared_data_dir()
    tail = load_training_prompts(train_prompts_path(), None, 2000)[-num_train_tail:] \
        if num_train_tail else []
    return {"mt_bench": load_questions(data / "mt_bench" / "question.jsonl", num_mt_bench),
            "train_tail": [r["prompt"] for r in tail]}


def measure(llm: LLM, prompts: list[str], heads: str | None, ks: list[int], max_tokens: int,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plain greedy, then blockwise at each k: mean block (output tokens / target steps over all requests),
    requests identical to plain, and the tokens per second of this run (one process, side by side)."""
    convs = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    plain = llm.chat(convs, params, use_tqdm=False)
    plain_s = time.perf_counter() - t0
    want = [o.outputs[0].token_ids for o in plain]
    n_out = sum(len(w) for w in want)
    rows: dict[str, Any] = {"plain": {"mean_block": 1.0, "tok_s": round(n_out / plain_s, 2)}}
    for k in ks:
        spec = {"method": "blockwise", "num_speculative_tokens": k, "use_cost_model": False, **(extra or {})}
        if heads:
            spec["model"] = heads
        sllm = LLM.from_engine_of(llm, speculative_config=spec)
        t0 = time.perf_counter()
        outs = sllm.chat(convs, params, use_tqdm=False)
        s = time.perf_counter() - t0
        toks = sum(o.metrics.num_output_tokens for o in outs)
        steps = sum(o.metrics.num_target_steps for o in outs)
        rows[f"k={k}"] = {"mean_block": round(toks / steps, 4),
                          "identical": sum(o.outputs[0].token_ids == w for o, w in zip(outs, want)),
                          "tok_s": round(toks / s, 2)}
    return {"num_prompts": len(prompts), "output_tokens": n_out, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default=None, help="heads folder (default: the shipped blockwise heads)")
    ap.add_argument("--ks", default="2,4,8", help="block sizes (num_speculative_tokens)")
    ap.add_argument("--mt-bench", type=int, default=8, help="MT-Bench first turns")
    ap.add_argument("--train-tail", type=int, default=8, help="last prompts of the training-prompt file")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    llm = LLM(kv_cache_blocks=1024)
    ks = [int(x) for x in args.ks.split(",")]
    result = {name: measure(llm, prompts, args.heads, ks, args.max_tokens)
              for name, prompts in held_out_prompts(args.mt_bench, args.train_tail).items() if prompts}
    result["heads"] = args.heads or "shipped"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
