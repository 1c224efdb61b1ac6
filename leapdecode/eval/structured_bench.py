"""Benchmark: decode speed with and without structured output (a JSON schema) on one model, batch 1.

Run: ``python -m leapdecode.eval.structured_bench`` (the bundled SmolLM2-135M; ``--model`` for another,
``--speculative ngram`` to decode speculatively). Prints tokens per second of greedy chat completions without a
constraint and under a JSON schema, the difference per token, and the grammar engine's own share: its mask and
advance per token, timed alone along the constrained output's tokens (docs/sampling.md).
"""

from __future__ import annotations

import argparse
import time

from leapdecode.llm import LLM
from leapdecode.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
}
PROMPTS = [
    "Describe a fictional person as JSON with name, age, city and hobbies.",
    "Invent a character for a novel and give their details as JSON: name, age, city, hobbies.",
    "Give me a JSON record of a made-up engineer: name, age, city and three hobbies.",
]


def run(llm: LLM, params: SamplingParams, repeats: int) -> tuple[float, int, list[list[int]]]:
    """Best tokens/s over ``repeats`` passes over the prompts (one at a time, no prefix-cache help: each prompt
    is different), tokens per pass, the outputs."""
    best, tokens, outs = 0.0, 0, []
    for _ in range(repeats):
        n, t = 0, 0.0
        outs = []
        for p in PROMPTS:
            t0 = time.perf_counter()
            o = llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0].outputs[0]
            t += time.perf_counter() - t0
            n += len(o.token_ids)
            outs.append(o.token_ids)
        best, tokens = max(best, n / t), n
    return best, tokens, outs


def matcher_cost(llm: LLM, so: StructuredOutputsParams, outputs: list[list[int]], passes: int = 3) -> float:
    """Seconds per token of the grammar engine alone (best of ``passes``): the allowed-token mask as the engine
    builds it, then advancing by the token."""
    backend = llm.engine.structured_backend()
    best = float("inf")
    for _ in range(passes):
        n, t = 0, 0.0
        for ids in outputs:
            m = backend.matcher(so)
            t0 = time.perf_counter()
            for tok in ids:
                m.allowed_tokens()
                if not m.accept(tok):
                    break
                n += 1
            t += time.perf_counter() - t0
        best = min(best, t / max(n, 1))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2-135M)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speculative", default=None, help="a speculative method, e.g. ngram")
    args = ap.parse_args()
    spec = {"method": args.speculative} if args.speculative else None
    llm = LLM(model=args.model, speculative_config=spec)
    so = StructuredOutputsParams(json=SCHEMA)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
    run(llm, plain, 1)  # warm-up: kernels, caches
    run(llm, constrained, 1)  # and the tokenizer's grammar tables and the schema
    tps_plain = tps_json = 0.0
    for _ in range(args.repeats):  # interleaved, so a change in machine load hits both
        tps, n_plain, _ = run(llm, plain, 1)
        tps_plain = max(tps_plain, tps)
        tps, n_json, outs = run(llm, constrained, 1)
        tps_json = max(tps_json, tps)
    per_token = matcher_cost(llm, so, outs)
    print(f"plain:        {tps_plain:7.1f} tok/s ({n_plain} tokens per pass)")
    print(f"json schema:  {tps_json:7.1f} tok/s ({n_json} tokens per pass)")
    print(f"difference:   {1e3 * (1 / tps_json - 1 / tps_plain):+.3f} ms per token")
    print(f"grammar mask + advance alone: {1e6 * per_token:.0f} us per token")


if __name__ == "__main__":
    main()
