"""The quality table of the lossy options: what each one costs, in numbers that tell them apart.

For plain float32 decoding (the reference) and every lossy option -- int8 activations
(``linear_kernel="packed-int8act"``), the int8, bfloat16 and float16 KV caches (``kv_cache_dtype``), blockwise
decoding's top-k acceptance, and auto's lossy branch (``lossless: false``) -- on one model and machine:

- **perplexity** on ``../shared/data/wikitext2/test.txt`` (the first ``ppl_tokens`` tokens in windows of 512),
  scored through the option's engine (eval/perplexity.py: its kernels, its KV cache);
- **greedy agreement** with float32 plain decoding on MT-Bench first turns: the mean share of plain decoding's
  completion reproduced before the first different token, and how many completions are identical;
- **accuracy** on a multiple-choice set scored by log-likelihood (eval/lm_eval_task.py's WikiText continuation
  task: which of 4 endings follows the passage; the highest summed log-probability wins, lm-eval's ``acc``),
  with its 95% Wilson interval.

Scoring a text is a prefill, which never runs a drafter, so a *decoding* rule (blockwise top-k, auto's lossy
branch) scores exactly as plain decoding does: its perplexity and accuracy are measured anyway (equal by
construction, which the table shows) and its cost is in the agreement column. Lossless methods are
token-identical to plain decoding (the report's identity column), so every column is plain decoding's.

    python -m leapdecode.bench.quality --out docs/bench/report

Resumable: each option's result is kept in ``OUT/quality.partial.json`` as it is measured, and rerunning the same
command continues with the next option.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from leapdecode.bench.hardware import machine_info
from leapdecode.eval.kv_agreement import identical_prefix
from leapdecode.eval.lm_eval_task import wikitext_items
from leapdecode.eval.perplexity import completion_nll, load_tokens, perplexity
from leapdecode.eval.prompts import load_questions, shared_data_dir
from leapdecode.llm import LLM
from leapdecode.sampling_params import SamplingParams

# label -> (engine options, speculative config, what kind of option it is)
LOSSY_OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any] | None, str]] = {
    "none (float32)": ({}, None, "reference"),
    "int8 activations": ({"linear_kernel": "packed-int8act"}, None, "model"),
    "int8 KV cache": ({"kv_cache_dtype": "int8"}, None, "model"),
    "bfloat16 KV cache": ({"kv_cache_dtype": "bfloat16"}, None, "model"),
    "float16 KV cache": ({"kv_cache_dtype": "float16"}, None, "model"),
    "blockwise top-2": ({}, {"method": "blockwise", "acceptance": "topk", "top_k": 2}, "decoding"),
    "auto lossy branch": ({}, {"method": "auto", "lossless": False}, "decoding"),
}


@dataclass
class QualityResult:
    option: str
    kind: str  # reference, model (changes the scores) or decoding (changes only what is emitted)
    wikitext_ppl: float
    agreement: float  # mean share of plain greedy's completion reproduced before the first difference
    identical: str  # completions identical to plain greedy, "n/N"
    mc_accuracy: float
    mc_ci95: tuple[float, float]
    mc_items: int
    seconds: float


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def mc_accuracy(llm: LLM, items: list[dict[str, Any]]) -> int:
    """How many items the highest summed log-likelihood of a choice, given the question, gets right."""
    tok = llm.get_tokenizer()
    right = 0
    for item in items:
        ctx = tok.encode(item["question"], add_special_tokens=False)
        scores = [-completion_nll(llm.engine, ctx, tok.encode(c, add_special_tokens=False))[0]
                  for c in item["choices"]]
        right += int(max(range(len(scores)), key=scores.__getitem__) == item["answer"])
    return right


def greedy_outputs(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    convs = [[{"role": "user", "content": p}] for p in prompts]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def measure_option(label: str, base: LLM, ref: list[list[int]] | None, prompts: list[str],
                   items: list[dict[str, Any]], ppl_tokens: list[int], max_tokens: int) -> tuple[QualityResult,
                                                                                          list[list[int]]]:
    """Every column for one option (``ref``: plain greedy's completions; None for the reference itself)."""
    engine_kw, spec, kind = LOSSY_OPTIONS[label]
    t0 = time.perf_counter()
    llm = LLM.from_engine_of(base, speculative_config=spec) if not engine_kw else \
        LLM(kv_cache_blocks=1024, **engine_kw)
    if spec is not None and engine_kw:
        raise ValueError(f"{label}: an option is an engine setting or a decoding rule, not both")
    outs = greedy_outputs(llm, prompts, max_tokens)
    ref = ref or outs
    fracs = [identical_prefix(a, b) / max(1, len(b)) for a, b in zip(outs, ref)]
    same = sum(a == b for a, b in zip(outs, ref))
    ppl = perplexity(llm.engine, ppl_tokens).perplexity
    right = mc_accuracy(llm, items)
    res = QualityResult(label, kind, ppl, sum(fracs) / len(fracs), f"{same}/{len(ref)}", right / len(items),
                        wilson(right, len(items)), len(items), round(time.perf_counter() - t0, 1))
    return res, outs


def quality_markdown(results: list[QualityResult], hw: str, command: str, mt_prompts: int, max_tokens: int) -> str:
    lines = ["# Quality of the lossy options", "", f"- command: `{command}`", f"- hardware: {hw}",
             f"- greedy agreement: {mt_prompts} MT-Bench first turns, {max_tokens} new tokens, against float32 "
             "plain decoding",
             "- perplexity: the first tokens of ../shared/data/wikitext2/test.txt, windows of 512",
             f"- accuracy: {results[0].mc_items} items of the WikiText-2 continuation task (4 endings, "
             "valid.txt; scored by summed log-likelihood), 95% Wilson interval", "",
             "| option | kind | wikitext2 ppl | greedy agreement | identical to float32 | continuation accuracy "
             "(95% CI) |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.option} | {r.kind} | {r.wikitext_ppl:.3f} | {r.agreement:.3f} | {r.identical} | "
                     f"{r.mc_accuracy:.3f} ({r.mc_ci95[0]:.3f}-{r.mc_ci95[1]:.3f}) |")
    lines += ["", "Lossless methods (every method at its defaults: the report's quality table, identity column) "
              "are token-identical to float32 plain decoding, so each of their columns is the first row's. A "
              "`decoding` option changes only which tokens are emitted: scoring a text runs no drafter, so its "
              "perplexity and accuracy equal the reference's by construction (measured, not copied), and its "
              "cost is its agreement."]
    return "\n".join(lines) + "\n"


PARTIAL_FILE = "quality.partial.json"  # the options measured so far: rerunning the command continues


def load_partial(path: Path, settings: dict[str, int]) -> dict[str, Any]:
    """What an interrupted run with the same settings measured (its reference completions and results), else a
    fresh start."""
    if path.is_file():
        doc = json.loads(path.read_text())
        if doc.get("settings") == settings:
            return doc
    return {"settings": settings, "results": {}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for quality.md and quality.json")
    ap.add_argument("--options", default=",".join(LOSSY_OPTIONS), help="comma list of option labels")
    ap.add_argument("--mt-bench", type=int, default=8, help="MT-Bench first turns for greedy agreement")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--mc-items", type=int, default=300)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    labels = [x.strip() for x in args.options.split(",") if x.strip()]
    unknown = [x for x in labels if x not in LOSSY_OPTIONS]
    if unknown or not labels or labels[0] != "none (float32)":
        raise ValueError(f"--options must start with 'none (float32)' and name only {list(LOSSY_OPTIONS)}; "
                         f"got {labels}")
    data = shared_data_dir()
    base = LLM(kv_cache_blocks=1024)
    prompts = load_questions(data / "mt_bench" / "question.jsonl", args.mt_bench)
    items = wikitext_items(data / "wikitext2" / "valid.txt", args.mc_items)
    tokens = load_tokens(base.get_tokenizer(), data / "wikitext2" / "test.txt", args.ppl_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"mt_bench": len(prompts), "max_tokens": args.max_tokens, "mc_items": len(items),
                "ppl_tokens": len(tokens)}
    done = load_partial(out / PARTIAL_FILE, settings)
    results: list[QualityResult] = []
    ref: list[list[int]] | None = done.get("reference")
    for label in labels:
        if label in done["results"]:  # measured by an earlier, interrupted run with the same settings
            results.append(QualityResult(**done["results"][label]))
            continue
        res, outs = measure_option(label, base, ref, prompts, items, tokens, args.max_tokens)
        ref = ref or outs
        results.append(res)
        done["results"][label] = asdict(res)
        done["reference"] = ref
        (out / PARTIAL_FILE).write_text(json.dumps(done))
        print(json.dumps(asdict(res)), flush=True)
    hw = machine_info()
    command = "python -m leapdecode.bench.quality " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "quality.md").write_text(quality_markdown(results, hw, command.strip(), len(prompts), args.max_tokens))
    (out / "quality.json").write_text(json.dumps({"hardware": hw, "settings": settings,
                                                  "results": [asdict(r) for r in results]}, indent=1) + "\n")
    (out / PARTIAL_FILE).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
