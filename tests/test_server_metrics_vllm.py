"""vLLM's metric names on ``/metrics`` (spec-decode drafts and acceptance per position, prefix cache, KV usage,
running/waiting, latency histograms, each with a ``model_name`` label), the start-up summary and the periodic stats
line, and the ``serve`` flags users bring from vLLM (positional model, ``--config FILE.yaml``, engine flags)."""

# ruff: noqa: F811  (a pytest fixture imported from tests/server_helpers.py is used as a parameter)
from __future__ import annotations

import argparse

import pytest

from leapdecode import LLM
from leapdecode.server.api_server import build_app
from leapdecode.server.async_engine import EngineGauges
from leapdecode.server.serve import add_cli
from leapdecode.server.serve_args import apply_config_file, engine_kwargs, resolve_model_arg
from leapdecode.server.stats_log import StatsLogger, startup_summary
from tests.conftest import assert_no_leaks
from tests.server_helpers import live_server, one_torch_thread, scrape, sync_client  # noqa: F401

PROMPT = "one two three four " * 4


def test_vllm_metrics_after_a_speculative_run(tiny_model_dir) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "use_cost_model": False}
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, speculative_config=spec)
    with live_server(build_app(llm, model_name="tiny")) as base:
        c = sync_client(base)
        usages = [c.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=40).usage
                  for _ in range(2)]  # the second prompt finds the first's blocks in the prefix cache
        m = scrape(base)
    label = '{model_name="tiny"}'
    drafts = m["vllm:spec_decode_num_drafts_total" + label]
    draft_tokens = m["vllm:spec_decode_num_draft_tokens_total" + label]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total" + label]
    assert draft_tokens == sum(u.model_extra["num_draft_tokens"] for u in usages) > 0
    assert accepted == sum(u.model_extra["num_accepted_tokens"] for u in usages)
    assert 0 < drafts <= draft_tokens
    per_pos = {int(k.split('position="')[1].split('"')[0]): v for k, v in m.items()
               if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")}
    assert sum(per_pos.values()) == accepted  # each accepted token is accepted at one position
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(len(per_pos) - 1))  # a later position needs the earlier
    assert per_pos[0] <= drafts and max(per_pos) < 4
    assert m["vllm:prefix_cache_queries_total" + label] == sum(u.prompt_tokens for u in usages)
    assert 0 < m["vllm:prefix_cache_hits_total" + label] < sum(u.prompt_tokens for u in usages)
    assert m['vllm:request_success_total{finished_reason="length",model_name="tiny"}'] == 2
    assert m["vllm:prompt_tokens_total" + label] == sum(u.prompt_tokens for u in usages)
    assert m["vllm:generation_tokens_total" + label] == 80
    assert m["vllm:num_preemptions_total" + label] == 0
    assert m["vllm:num_requests_running" + label] == m["vllm:num_requests_waiting" + label] == 0
    assert 0 <= m["vllm:kv_cache_usage_perc" + label] <= 1
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert m[f"vllm:{hist}_count" + label] == 2
    assert m["leapdecode_draft_tokens_total"] == draft_tokens  # today's series stay beside
    assert_no_leaks(llm)


def test_startup_summary_and_stats_line(tiny_model_dir) -> None:
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64)
    summary = startup_summary(llm.engine, "tiny")
    assert "KV cache: 64 blocks x 16 tokens = 1,024 tokens" in summary and "packed projections" in summary
    assert "MiB" in summary and "speculative: off" in summary

    class Engine:  # the gauges the engine thread publishes, as the stats logger reads them
        gauges = EngineGauges(kv_blocks_total=64, stats={"num_prompt_tokens": 0, "num_output_tokens": 0})

    fake = Engine()
    stats = StatsLogger(fake, 5.0)  # type: ignore[arg-type]
    start = stats.last.at
    assert stats.line(start + 5) is None  # idle: no line
    fake.gauges = EngineGauges(kv_blocks_in_use=16, kv_blocks_total=64, num_running=2, stats={
        "num_prompt_tokens": 100, "num_output_tokens": 50, "num_target_steps": 25, "num_draft_tokens": 40,
        "num_accepted_tokens": 30})
    line = stats.line(start + 10)
    assert line is not None
    assert "prompt throughput 20.0 tokens/s" in line and "generation throughput 10.0 tokens/s" in line
    assert "KV cache usage 25.0%" in line and "75.0% of 40 draft tokens" in line and "2.00 tokens per" in line
    with pytest.raises(ValueError, match="interval"):
        StatsLogger(fake, 0)  # type: ignore[arg-type]
    assert_no_leaks(llm)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leapdecode")
    add_cli(parser.add_subparsers(dest="command"))
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    args = serve_parser().parse_args(["serve", *argv])
    apply_config_file(args, args.config_parser)
    resolve_model_arg(args)
    return args


def test_serve_flags_and_config_file(tmp_path) -> None:
    args = parse(["org/name:Q4_K_M"])  # positional, as `vllm serve MODEL`
    assert args.model == "org/name:Q4_K_M" and engine_kwargs(args) == {}  # unset flags: the engine's defaults
    args = parse(["--model", "m.gguf", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--swap-space", "2",
                  "--seed", "7", "--tokenizer", "tok", "--revision", "v1"])
    assert engine_kwargs(args) == {"gpu_memory_utilization": 0.5, "enforce_eager": True, "swap_space_gb": 2.0,
                                   "seed": 7, "tokenizer": "tok", "revision": "v1"}
    with pytest.raises(ValueError, match="two models"):
        parse(["a.gguf", "--model", "b.gguf"])
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: org/name\nmax-num-seqs: 8\nport: 9000\nenforce_eager: true\n"
                   "speculative-config: {method: ngram}\ntool-call-parser: hermes\n")
    args = parse(["--config", str(cfg), "--port", "9001"])
    assert (args.model, args.max_num_seqs, args.port, args.enforce_eager) == ("org/name", 8, 9001, True)
    assert args.speculative_config == {"method": "ngram"} and args.tool_call_parser == "hermes"
    for bad, why in (("no-such-flag: 1\n", "unknown key"), ("max-num-seqs: 2.5\n", "integer"),
                     ("enforce-eager: 3\n", "switch"), ("tool-call-parser: pythonic\n", "one of"),
                     ("- a\n", "mapping"), ("port: [\n", "not valid YAML")):
        cfg.write_text(bad)
        with pytest.raises(ValueError, match=why):
            parse(["--config", str(cfg)])
