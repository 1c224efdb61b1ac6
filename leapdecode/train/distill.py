"""``leapdecode train distill-data``: self-distillation data for drafters.

The target answers the training prompts with the engine's own continuous batching (greedy, and optionally sampled
answers too), and the token ids of prompt + answer are stored, so drafters learn what *this* model says rather
than what a dataset says. MT-Bench questions are the development benchmark and are refused here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from leapdecode.eval.prompts import train_prompts_path
from leapdecode.llm import LLM
from leapdecode.sampling_params import SamplingParams
from leapdecode.train.loop import portable_path


def load_training_prompts(path: Path, limit: int | None, max_chars: int) -> list[dict]:
    if "mt_bench" in str(path):
        raise ValueError("MT-Bench questions are the development benchmark: never train on them")
    recs = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            text = r.get("prompt") or (r.get("turns") or [None])[0]
            if not text or len(text) > max_chars:
                continue
            recs.append({"id": r.get("id", str(len(recs))), "prompt": text})
            if limit and len(recs) >= limit:
                break
    return recs


def cmd_distill(args: argparse.Namespace) -> int:
    prompts_path = Path(args.prompts) if args.prompts else train_prompts_path()
    recs = load_training_prompts(prompts_path, args.limit, args.max_prompt_chars)
    if not recs:
        raise ValueError(f"no usable prompts in {prompts_path}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_file = out / "samples.jsonl"
    done = set()
    if data_file.exists() and not args.overwrite:  # resumable: skip what is already there
        for line in open(data_file):
            r = json.loads(line)
            done.add((r["id"], r["mode"]))
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch_size)
    modes = [("greedy", 0.0)] + ([("sampled", args.temperature)] if args.sampled else [])
    t0 = time.time()
    n_tokens = 0
    with open(data_file, "a" if done else "w") as f:
        for mode, temp in modes:
            todo = [r for r in recs if (r["id"], mode) not in done]
            bar = tqdm(total=len(todo), desc=f"distill {mode}", unit="prompt")
            for i in range(0, len(todo), args.batch_size):
                chunk = todo[i : i + args.batch_size]
                convs = [[{"role": "user", "content": r["prompt"]}] for r in chunk]
                params = [SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=args.seed + j + i)
                          for j in range(len(chunk))]
                outs = llm.chat(convs, params, use_tqdm=False)
                for r, o in zip(chunk, outs):
                    f.write(json.dumps({"id": r["id"], "mode": mode, "prompt_token_ids": o.prompt_token_ids,
                                        "output_token_ids": o.outputs[0].token_ids}) + "\n")
                    n_tokens += len(o.outputs[0].token_ids)
                f.flush()
                bar.update(len(chunk))
            bar.close()
    total = {"records": 0, "output_tokens": 0, "prompt_tokens": 0}
    for line in open(data_file):
        r = json.loads(line)
        total["records"] += 1
        total["output_tokens"] += len(r["output_token_ids"])
        total["prompt_tokens"] += len(r["prompt_token_ids"])
    manifest = {
        "command": "leapdecode train distill-data " + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
            if k not in ("func", "train_func", "command", "train_command") and v not in (None, False)),
        "model": portable_path(llm.engine.model_path), "prompts": portable_path(prompts_path), "num_prompts": len(recs),
        "modes": [m for m, _ in modes], "max_tokens": args.max_tokens, "seed": args.seed,
        "new_output_tokens": n_tokens, "seconds_this_run": round(time.time() - t0, 1), "file": data_file.name,
        **{f"total_{k}": v for k, v in total.items()},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"wrote {data_file} ({n_tokens} new output tokens) and manifest.json")
    return 0


__all__ = ["cmd_distill", "load_training_prompts"]
