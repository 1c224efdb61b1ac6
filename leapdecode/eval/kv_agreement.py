"""Greedy agreement of a KV-cache variant (e.g. int8) with the baseline cache, on MT-Bench first turns.

A quantized cache is lossy, so "same output" is the strictest useful check: for each prompt, the fraction of
the baseline's greedy tokens reproduced before the first divergence (identical-prefix fraction), and whether
the whole completion matches. One near-tie flips the rest of a completion, so that number is noisy over few
prompts; the teacher-forced numbers are steadier: both caches score the *baseline's* completions (prompt +
output in one forward), and we report next-token top-1 agreement and the mean KL(baseline || variant).
Also prints the cache's bytes per token against float32.

Run: ``python -m leapdecode.eval.kv_agreement`` (bundled model, 8 prompts, 64 tokens, int8 vs auto);
``--num-prompts 80`` covers every MT-Bench question.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from leapdecode.layers.kv_quant import kv_bytes_per_token as bytes_per_token

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mt_bench" / "question.jsonl"


def identical_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def first_turns(path: str | Path, n: int) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()][:n]


@torch.inference_mode()
def teacher_forced_logprobs(llm, prompts: list[list[int]], outputs: list[list[int]]) -> list[torch.Tensor]:
    """Log-probs [len(output), vocab] predicting each output token from prompt + earlier outputs."""
    from leapdecode.engine.model_runner import ForwardItem

    engine, res = llm.engine, []
    for p, o in zip(prompts, outputs, strict=True):
        tokens = p + o
        with engine.block_manager.borrowed(len(tokens), f"scoring {len(tokens)} tokens") as table:
            rows = list(range(len(p) - 1, len(tokens) - 1))
            (r,) = engine.runner.execute([ForwardItem(table, 0, tokens, rows)])
            res.append(r.logits.float().log_softmax(-1))
    return res


def kv_bytes_per_token(llm) -> float:
    """Bytes the engine's cache allocates per token slot (values plus any int8 scales)."""
    kv = llm.engine.kv_cache
    return kv.nbytes / (kv.num_blocks * kv.block_size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--baseline", default="auto")
    ap.add_argument("--variant", default="int8")
    ap.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-calibration", action="store_true", help="int8 variant without the start-up key calibration")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from leapdecode import LLM, SamplingParams

    convs = [[{"role": "user", "content": q}] for q in first_turns(a.questions, a.num_prompts)]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    outs, per_token, logprobs = {}, {}, {}
    fp32 = 0
    for kv in (a.baseline, a.variant):
        blocks = max(256, 16 * len(convs))  # every prompt fits at once: no preemption in either run
        llm = LLM(model=a.model, kv_cache_blocks=blocks, max_num_seqs=len(convs), kv_cache_dtype=kv,
                  kv_calibration=not (a.no_calibration and kv == a.variant))
        outs[kv] = [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]
        prompts = [llm.apply_chat_template(c) for c in convs]
        logprobs[kv] = teacher_forced_logprobs(llm, prompts, outs[a.baseline])
        per_token[kv] = kv_bytes_per_token(llm)
        c = llm.engine.model_config
        fp32 = bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, torch.float32)
        del llm
    fracs, exact = [], 0
    for i, (base, var) in enumerate(zip(outs[a.baseline], outs[a.variant], strict=True)):
        p = identical_prefix(base, var)
        fracs.append(p / max(1, len(base)))
        exact += base == var
        print(f"prompt {i}: identical prefix {p}/{len(base)}")
    ref, var = logprobs[a.baseline], logprobs[a.variant]
    n = sum(len(r) for r in ref)
    top1 = sum((r.argmax(-1) == v.argmax(-1)).sum().item() for r, v in zip(ref, var, strict=True)) / n
    kl = sum((r.exp() * (r - v)).sum().item() for r, v in zip(ref, var, strict=True)) / n
    print(f"teacher-forced over {n} positions: top-1 agreement {top1:.4f}, mean KL {kl:.2e} nats")
    print(
        f"{a.variant} vs {a.baseline}: mean identical-prefix fraction {sum(fracs) / len(fracs):.3f}, "
        f"{exact}/{len(fracs)} completions identical; KV bytes/token {per_token[a.variant]:.0f} vs "
        f"{per_token[a.baseline]:.0f} ({per_token[a.baseline] / per_token[a.variant]:.2f}x; "
        f"float32 = {fp32}: {fp32 / per_token[a.variant]:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
