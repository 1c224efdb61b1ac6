"""Helpers of scripts/gpu_check.sh (the one-run device check of the GPU path; docs/gpu.md).

    python scripts/gpu_check.py prepare DIR       # on a machine with the bundled model: what a bare GPU machine lacks
    python scripts/gpu_check.py model DIR TOKENIZER   # a random-weight model of SmolLM2-135M's shape, as an HF folder
    python scripts/gpu_check.py triton-pin        # the triton version this torch build asks for (empty: none)
    python scripts/gpu_check.py curve --model M --out FILE   # the verification cost curve, graphs vs eager
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# SmolLM2-135M-Instruct's shape (the bundled model): the stand-in when its weights cannot reach the GPU machine
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
CURVE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CURVE_BATCHED = (1, 2, 4, 8)  # rows per sequence at batch 32


def prepare(folder: Path) -> None:
    """The bundled tokenizer, the MT-bench prompts and the gguf wheel (pure Python) into ``folder``."""
    from leapdecode.eval.prompts import shared_data_dir
    from leapdecode.models.loader import bundled_model_path, load_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    load_tokenizer(bundled_model_path()).save_pretrained(str(folder / "tokenizer"))
    src, dst = shared_data_dir() / "mt_bench" / "question.jsonl", folder / "data" / "mt_bench" / "question.jsonl"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)  # not its mode: the shared copy is read-only, and a second prepare must overwrite it
    version = importlib.metadata.version("gguf")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                    str(folder / "wheels"), f"gguf=={version}"], check=True)  # fmt: skip
    print(f"prepared {folder}: tokenizer, mt_bench prompts, gguf {version} wheel")


def random_model(folder: Path, tokenizer: Path) -> None:
    """An HF folder with SmolLM2-135M's shape and random weights (widened like the test models so its logits are
    not near-uniform), with ``tokenizer``'s files: speed is that of the real model, acceptance is not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    print(f"random-weight SmolLM2-135M-shaped model in {folder}")


def triton_pin() -> str:
    """The ``triton==X`` requirement of the installed torch (CUDA builds carry one), or ''."""
    for req in importlib.metadata.requires("torch") or []:
        m = re.match(r"triton\s*==\s*([\w.]+)", req)
        if m:
            return m.group(1)
    return ""


def _time_step(runner, items, reps: int) -> float:
    """Median milliseconds of one forward of ``items``, the GPU synchronised around each."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    runner.execute(items)
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.execute(items)
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def step_costs(llm, ctx: int, reps: int) -> dict[str, float]:
    """Target step time by verified rows, at batch 1 (``CURVE_ROWS``) and 32 (``CURVE_BATCHED`` rows each)."""
    from leapdecode.engine.model_runner import ForwardItem

    eng = llm.engine
    bm, runner, out = eng.block_manager, eng.runner, {}
    for batch, rows in ((1, CURVE_ROWS), (32, CURVE_BATCHED)):
        for n in rows:
            with contextlib.ExitStack() as stack:
                tables = [stack.enter_context(bm.borrowed(ctx + n)) for _ in range(batch)]
                items = [ForwardItem(t, ctx, [0] * n, list(range(n))) for t in tables]
                out[f"{batch}x{n}"] = _time_step(runner, items, reps)
    return out


def curve(model: str, dtype: str, ctx: int, reps: int, out: Path, device: str = "cuda") -> None:
    from leapdecode import LLM

    graphs = LLM(model=model, device=device, dtype=dtype, max_num_seqs=64, max_model_len=2048)
    eager = LLM.from_engine_of(graphs, enforce_eager=True)
    with_graphs, without = step_costs(graphs, ctx, reps), step_costs(eager, ctx, reps)
    lines = [f"## Verification cost curve ({dtype}, {ctx} cached tokens, median of {reps})", "",
             "t(n) = one target forward of n verified rows per sequence; ratio = t(n) / t(1) of the same mode. "
             f"Device: {device}. Speculation pays when the mean accepted tokens per step exceed the ratio at the "
             "rows it verifies (plus the drafter's own cost). Rows above 16 per sequence always run eagerly.", "",
             "| batch x rows | CUDA graphs ms | ratio | eager ms | ratio |", "|---|---|---|---|---|"]  # fmt: skip
    for batch in (1, 32):
        base_g, base_e = with_graphs[f"{batch}x1"], without[f"{batch}x1"]
        for key in [k for k in with_graphs if k.startswith(f"{batch}x")]:
            g, e = with_graphs[key], without[key]
            lines.append(f"| {key} | {g:.3f} | {g / base_g:.2f} | {e:.3f} | {e / base_e:.2f} |")
    replays = graphs.engine.graphs.replays if graphs.engine.graphs else 0
    lines += ["", f"graph replays: {replays}; KV pool: {graphs.engine.kv_cache.num_blocks} blocks "
              f"({graphs.engine.kv_cache.nbytes / 2**30:.2f} GiB, gpu_memory_utilization "
              f"{graphs.config.gpu_memory_utilization})", ""]  # fmt: skip
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps({"graphs_ms": with_graphs, "eager_ms": without}, indent=1))
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare").add_argument("folder", type=Path)
    p = sub.add_parser("model")
    p.add_argument("folder", type=Path)
    p.add_argument("tokenizer", type=Path)
    sub.add_parser("triton-pin")
    p = sub.add_parser("curve")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--device", default="cuda", help="cpu only to try the script itself (no graphs there)")
    p.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.folder)
    elif args.cmd == "model":
        random_model(args.folder, args.tokenizer)
    elif args.cmd == "triton-pin":
        print(triton_pin())
    else:
        curve(args.model, args.dtype, args.context, args.reps, args.out, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
