"""``leapdecode`` command line: generate | chat | serve | bench | train | plan."""

from __future__ import annotations

import argparse
import json
import sys

from leapdecode.cli_args import EPILOG, add_model_args, read_chat_template
from leapdecode.gc_heap import startup_heap_frozen
from leapdecode.outputs import RequestMetrics


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def make_llm(args: argparse.Namespace):
    from leapdecode import LLM
    from leapdecode.server.serve import resolve_dtype

    return LLM(model=args.model, dtype=resolve_dtype(args.dtype, args.device, args.model), device=args.device,
               speculative_config=args.speculative_config, num_threads=args.threads,
               tensor_parallel_size=args.tensor_parallel_size)


def make_params(args: argparse.Namespace):
    from leapdecode import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    params = make_params(args)
    llm = make_llm(args)
    if args.json:
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
        c = out.outputs[0]
        print(json.dumps({
            "prompt": args.prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "prompt_token_ids": out.prompt_token_ids, "metrics": out.metrics.to_dict(),
        }, indent=2))
        return 0
    printed = ""
    out = None
    for out in llm.stream(args.prompt, params):
        text = out.outputs[0].text
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text
    print()
    if out is not None:
        m = out.metrics
        tps = m.num_output_tokens / m.e2e_s if m.e2e_s else 0.0
        print(f"[{m.num_output_tokens} tokens, {tps:.1f} tok/s, mean accepted {m.mean_accepted_tokens:.2f}]",
              file=sys.stderr)
        if args.explain:
            print(explain_metrics(m), file=sys.stderr)
    return 0


def explain_metrics(m: RequestMetrics) -> str:
    """What ``--explain`` prints for one request: the route ``auto`` took and the steps each method drafted."""
    steps = ", ".join(f"{k}: {v}" for k, v in sorted(m.draft_methods.items())) or "none"
    paths = ", ".join(f"{k}: {v}" for k, v in sorted(m.compute_paths.items()))
    return (f"[route: {m.route or 'not auto (one method)'}]\n[steps drafted by method: {steps}; domain switches: "
            f"{m.num_domain_switches}]" + (f"\n[steps per compute path: {paths}]" if paths else ""))


def cmd_chat(args: argparse.Namespace) -> int:
    params = make_params(args)
    template = read_chat_template(args.chat_template) if args.chat_template else None
    llm = make_llm(args)
    if template is not None:
        llm.get_tokenizer().chat_template = template
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})

    def reply(user: str) -> None:
        history.append({"role": "user", "content": user})
        printed = ""
        for out in llm.stream(list(history), params):
            text = out.outputs[0].text
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
        print()
        history.append({"role": "assistant", "content": printed})

    if args.message:
        reply(args.message)
        return 0
    print("leapdecode chat — empty line or Ctrl-D to quit, /reset to clear the history", file=sys.stderr)
    with startup_heap_frozen():  # no full collection of the start-up heap between two tokens (gc_heap.py)
        while True:
            try:
                user = input("> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not user.strip():
                return 0
            if user.strip() == "/reset":
                del history[1 if args.system else 0 :]
                continue
            reply(user)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leapdecode", description="Fast, lossless LLM decoding.", epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="complete one prompt (streams to the terminal)", epilog=EPILOG)
    p.add_argument("prompt")
    add_model_args(p, auto_dtype=True)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and metrics")
    p.add_argument("--explain", action="store_true",
                   help="after the text, say which route the speculative \"auto\" router took and why")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with the chat template (tokens stream)", epilog=EPILOG)
    add_model_args(p, auto_dtype=True)
    add_sampling_args(p, max_tokens=256)
    p.add_argument("--message", default=None, help="one-shot: answer this message and exit")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file or text) replacing the model's own: for a model without one")
    p.set_defaults(func=cmd_chat)

    from leapdecode.bench.benchmark import add_cli as add_bench
    from leapdecode.plan import add_cli as add_plan
    from leapdecode.server.serve import add_cli as add_serve
    from leapdecode.train.cli import add_cli as add_train

    add_serve(sub)
    add_bench(sub)
    add_train(sub)
    add_plan(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"leapdecode {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
