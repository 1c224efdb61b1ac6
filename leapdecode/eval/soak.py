"""Soak: a bounded load of mixed requests against a real ``leapdecode serve`` on 127.0.0.1, checking that a server
that runs for hours does not grow, leak KV blocks or lose requests.

Client workers send, for ``--duration`` seconds, a mix of non-streamed and streamed text/chat completions,
streams the client hangs up on after a few chunks (cancelled), constrained completions (``structured_outputs``
choice / regex / JSON schema and chat ``response_format``, drawn from ``GRAMMAR_VARIANTS`` schemas so compiles and
cache hits both happen) and ``/tokenize`` calls (text or messages, with token strings or not). Afterwards it
reports:

* **RSS growth after warm-up**: the server process's resident memory at the end vs. when ``--warmup`` seconds of
  load had run (allocator pools, compiled kernels and caches fill during warm-up; what grows after that is a
  leak: detokenizer state, metric labels, prefix-cache metadata, per-request records);
* **KV blocks in use** once the load stopped (``/metrics``): must be 0;
* **requests lost**: a request the client sent that got no final status (an HTTP answer; a stream that ended with
  ``data: [DONE]``; a cancelled stream the server counted as aborted). The server's own counters must agree: every
  request it answered 200 must have finished or been aborted in the engine.

Run: ``python -m leapdecode.eval.soak --duration 600`` (bundled model) or ``--model path/to/tiny``. The exit status
is 1 when a check fails (``--max-rss-growth`` sets the RSS bound, 5% by default). Only 127.0.0.1 is ever used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

HOST = "127.0.0.1"
TOPICS = ["the sea", "a small town", "prime numbers", "bread", "the moon", "old maps", "rain", "chess"]
KINDS = ("completion", "chat", "completion-stream", "chat-stream", "cancelled-stream", "grammar-completion",
         "grammar-chat", "tokenize")
GRAMMAR_VARIANTS = 32  # distinct schemas / regexes the grammar requests draw from


@dataclass
class SoakReport:
    duration_s: float
    requests_sent: int
    outcomes: dict[str, int]  # "kind status" -> count
    requests_lost: int
    rss_warm_mib: float
    rss_end_mib: float
    rss_growth_pct: float
    rss_after_warmup_mib: list[tuple[float, float]]  # (seconds since the start, MiB): a leak shows as a trend
    kv_blocks_in_use_end: float
    queue_length_end: float
    server_answered_200: float
    server_finished_or_aborted: float
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` (VmRSS of /proc/<pid>/status), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def scrape(client: httpx.Client) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}``."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    """``leapdecode serve`` on 127.0.0.1 and a free port; returns the process and its base URL."""
    cmd = [sys.executable, "-m", "leapdecode.cli", "serve", "--host", HOST, "--port", "0", "--log-level", "warning"]
    cmd += ["--kv-cache-blocks", str(args.kv_cache_blocks), "--max-num-seqs", str(args.concurrency)]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the "serving ... at http://127.0.0.1:PORT/v1" line, once listening
    m = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"leapdecode serve did not start: {line!r}")
    return proc, m.group(0)


def grammar_for(rng: random.Random) -> dict[str, Any]:
    """One of ``GRAMMAR_VARIANTS`` constraints per kind (``structured_outputs``)."""
    v = rng.randrange(GRAMMAR_VARIANTS)
    kind = rng.choice(["choice", "regex", "json"])
    if kind == "choice":
        return {"choice": [f"option {v}", "yes", "no"]}
    if kind == "regex":
        return {"regex": f"[a-z]{{1,{v % 8 + 2}}}-[0-9]{{{v % 4 + 1}}}"}
    schema = {"type": "object", "properties": {f"field{v}": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": [f"field{v}", "ok"], "additionalProperties": False}
    return {"json": schema, "disable_any_whitespace": True}


def body_for(kind: str, rng: random.Random, max_tokens: int, unique: bool = True) -> tuple[str, dict[str, Any]]:
    """A request of ``kind``; ``unique`` puts a random number in the prompt (new text for the tokenizer and the
    prefix cache every time), else prompts repeat (prefix-cache hits)."""
    topic = rng.choice(TOPICS)
    tag = rng.randint(0, 10**6) if unique else 0
    if kind == "tokenize":
        strs = {"return_token_strs": rng.random() < 0.5}
        if rng.random() < 0.5:
            return "/tokenize", {"prompt": f"Words about {topic} ({tag}). " * rng.randint(1, 40), **strs}
        return "/tokenize", {"messages": [{"role": "user", "content": f"About {topic}. {tag}"}], **strs}
    common: dict[str, Any] = {"max_tokens": rng.randint(4, max_tokens), "temperature": rng.choice([0.0, 0.8])}
    if kind == "grammar-chat":
        so = grammar_for(rng)
        if "json" in so:
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": so["json"]}}
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"{topic} {tag}"}],
                                            "response_format": fmt}
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"{topic} {tag}"}],
                                        "structured_outputs": so}
    if kind == "grammar-completion":
        so = grammar_for(rng)
        return "/v1/completions", {**common, "prompt": f"About {topic} ({tag}):", "structured_outputs": so}
    if kind.endswith("stream"):
        common["stream"] = True
        common["stream_options"] = {"include_usage": rng.random() < 0.5}
    if kind.startswith("chat"):
        messages = [{"role": "user", "content": f"Tell me about {topic}. {tag}"}]
        return "/v1/chat/completions", {**common, "messages": messages}
    return "/v1/completions", {**common, "prompt": f"A few words about {topic} ({tag}):"}


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, args: argparse.Namespace) -> str:
    """Send one request of ``kind``; returns its final status ("200", "400", "cancelled", ...) or "lost: why"."""
    path, body = body_for(kind, rng, args.max_tokens, unique=not args.repeat_prompts)
    try:
        if not kind.endswith("stream"):
            r = await client.post(path, json=body)
            if r.status_code == 200 and kind == "tokenize":
                r.json()["count"]  # noqa: B018 (a complete body)
            elif r.status_code == 200:
                r.json()["choices"][0]["finish_reason"]  # noqa: B018 (a complete body, not a truncated one)
            return str(r.status_code)
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code)
            chunks = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "200"
                if line.startswith("data: "):
                    chunks += 1
                    if kind == "cancelled-stream" and chunks >= 2:
                        return "cancelled"  # leaving the block closes the connection mid-stream
            return "lost: the stream ended without [DONE]"
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return f"lost: {type(e).__name__}: {e}"


async def load(base: str, args: argparse.Namespace, pid: int) -> tuple[Counter[str], int, list[tuple[float, float]]]:
    """Run the workers for ``args.duration`` seconds. Returns the outcomes, the requests sent, and the server's RSS
    every ``args.sample_every`` seconds as ``(seconds since the start, MiB)``."""
    outcomes: Counter[str] = Counter()
    sent = 0
    samples: list[tuple[float, float]] = []
    start = time.monotonic()
    limits = httpx.Limits(max_connections=args.concurrency * 2)

    async def worker(seed: int) -> None:
        nonlocal sent
        rng = random.Random(seed)
        while time.monotonic() - start < args.duration:
            kind = rng.choice(KINDS)
            sent += 1
            outcomes[f"{kind} {await one_request(client, kind, rng, args)}"] += 1

    async def sampler() -> None:
        while (t := time.monotonic() - start) < args.duration:
            samples.append((round(t, 1), round(rss_mib(pid), 1)))
            await asyncio.sleep(args.sample_every)

    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=args.request_timeout, limits=limits) as client:
        await asyncio.gather(sampler(), *(worker(args.seed + i) for i in range(args.concurrency)))
    return outcomes, sent, samples


def settle(client: httpx.Client, timeout_s: float = 30.0) -> dict[str, float]:
    """``/metrics`` once the engine has no request left (cancelled streams are aborted on the engine thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(client)
        if (m.get("leapdecode_kv_blocks_in_use", 0) == 0 and m.get("leapdecode_queue_length", 0) == 0) or (
            time.monotonic() > deadline
        ):
            return m
        time.sleep(0.1)


def run_soak(args: argparse.Namespace) -> SoakReport:
    if args.warmup >= args.duration:
        raise ValueError(f"--warmup ({args.warmup}) must be shorter than --duration ({args.duration})")
    proc, base = start_server(args)
    try:
        t0 = time.monotonic()
        outcomes, sent, samples = asyncio.run(load(base, args, proc.pid))
        took = time.monotonic() - t0
        with httpx.Client(base_url=base, trust_env=False, timeout=30) as client:
            m = settle(client)
        rss_end = rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    warm = [(t, mib) for t, mib in samples if t >= args.warmup] + [(took, rss_end)]
    return report(args, took, sent, outcomes, warm, m)


def report(
    args: argparse.Namespace,
    took: float,
    sent: int,
    outcomes: Counter[str],
    rss: list[tuple[float, float]],
    m: dict[str, float],
) -> SoakReport:
    """The report and its failures; ``rss`` is the server's RSS from the end of warm-up to the end, as
    ``(seconds, MiB)``."""
    rss_warm, rss_end = rss[0][1], rss[-1][1]
    lost = sum(n for k, n in outcomes.items() if " lost" in k)
    # /health and /metrics also answer 200: only completions count (each one 200 must have ended in the engine)
    answered_200 = sum(
        v for k, v in m.items() if k.startswith("leapdecode_requests_total") and "completions" in k and '"200"' in k
    )
    finished = sum(v for k, v in m.items() if k.startswith("leapdecode_request_finish_total"))
    growth = 100.0 * (rss_end - rss_warm) / rss_warm
    r = SoakReport(
        duration_s=round(took, 1),
        requests_sent=sent,
        outcomes=dict(sorted(outcomes.items())),
        requests_lost=lost,
        rss_warm_mib=round(rss_warm, 1),
        rss_end_mib=round(rss_end, 1),
        rss_growth_pct=round(growth, 2),
        rss_after_warmup_mib=rss,
        kv_blocks_in_use_end=m.get("leapdecode_kv_blocks_in_use", -1),
        queue_length_end=m.get("leapdecode_queue_length", -1),
        server_answered_200=answered_200,
        server_finished_or_aborted=finished,
    )
    if lost:
        r.failures.append(f"{lost} requests got no final status")
    if sum(outcomes.values()) != sent:
        r.failures.append(f"{sent - sum(outcomes.values())} requests never returned to the client")
    if r.kv_blocks_in_use_end != 0 or r.queue_length_end != 0:
        r.failures.append(f"KV blocks in use {r.kv_blocks_in_use_end}, queue {r.queue_length_end} after the load")
    if finished != answered_200:
        r.failures.append(f"the server answered {answered_200:g} completions but ended {finished:g} in the engine")
    if growth > args.max_rss_growth:
        r.failures.append(f"RSS grew {growth:.1f}% after warm-up (bound {args.max_rss_growth}%)")
    return r


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m leapdecode.eval.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled model)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: 600)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the RSS baseline (default: 60)")
    p.add_argument("--concurrency", type=int, default=8, help="client workers, each one request at a time")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens is drawn from [4, this]")
    p.add_argument("--kv-cache-blocks", type=int, default=256)
    p.add_argument("--repeat-prompts", action="store_true", help="reuse 16 prompts (default: a new one each time)")
    p.add_argument("--threads", type=int, default=None, help="the server's --threads (default: its own choice)")
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="fail above this RSS growth in %% (default 5)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples (default: 5)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    r = run_soak(args)
    if args.json:
        print(json.dumps({**asdict(r), "ok": r.ok}, indent=2))
    else:
        print(f"soak: {r.requests_sent} requests in {r.duration_s} s; outcomes {r.outcomes}")
        print(f"  RSS {r.rss_warm_mib} MiB after warm-up -> {r.rss_end_mib} MiB at the end ({r.rss_growth_pct:+.2f}%); "
              f"samples {[mib for _, mib in r.rss_after_warmup_mib]}")
        print(f"  KV blocks in use at the end: {r.kv_blocks_in_use_end:g}; requests lost: {r.requests_lost}")
        print("  OK" if r.ok else "  FAILED: " + "; ".join(r.failures))
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
