"""The soak run (leapdecode/eval/soak.py), short: a real ``leapdecode serve`` on 127.0.0.1 under mixed streaming,
non-streaming, cancelled, grammar-constrained and /tokenize requests loses no request, ends with 0 KV blocks in
use and does not grow."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from leapdecode.eval.soak import build_parser, report, run_soak


def test_short_soak_loses_nothing_and_does_not_grow(tiny_model_dir: Path) -> None:
    args = build_parser().parse_args(
        ["--model", str(tiny_model_dir), "--duration", "16", "--warmup", "6", "--concurrency", "6"]
        + ["--kv-cache-blocks", "64", "--threads", "1", "--max-rss-growth", "10"]
    )
    r = run_soak(args)
    assert r.ok, r.failures
    kinds = {k.split()[0] for k in r.outcomes}
    assert kinds == {"completion", "chat", "completion-stream", "chat-stream", "cancelled-stream",
                     "grammar-completion", "grammar-chat", "tokenize"}, r.outcomes
    assert {k for k in r.outcomes if k.startswith(("grammar", "tokenize"))} <= {
        "grammar-completion 200", "grammar-chat 200", "tokenize 200"}, r.outcomes
    assert r.outcomes.get("cancelled-stream cancelled", 0) > 0
    assert r.requests_lost == 0 and r.kv_blocks_in_use_end == 0
    assert r.server_answered_200 == r.server_finished_or_aborted > 50
    assert len(r.rss_after_warmup_mib) >= 2 and r.rss_after_warmup_mib[0][0] >= 6
    print(f"short soak: {r}")


def test_the_checks_catch_leaks_and_losses() -> None:
    args = build_parser().parse_args(["--max-rss-growth", "5"])
    metrics = {
        'leapdecode_requests_total{endpoint="/v1/completions",status="200"}': 10.0,
        'leapdecode_request_finish_total{reason="length"}': 9.0,
        "leapdecode_kv_blocks_in_use": 3.0,
        "leapdecode_queue_length": 0.0,
    }
    outcomes = Counter({"completion 200": 9, "chat-stream lost: the stream ended without [DONE]": 1})
    r = report(args, 10.0, 10, outcomes, [(6.0, 100.0), (8.0, 105.0), (10.0, 110.0)], metrics)
    assert not r.ok and len(r.failures) == 4, r.failures  # lost, KV in use, 10 answered vs 9 ended, RSS +10%
