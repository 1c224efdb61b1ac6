"""The command line: every subcommand has --help, and the main ones run end to end on a tiny model."""

from __future__ import annotations

import json

import pytest

from leapdecode.cli import build_parser, main


@pytest.mark.parametrize("cmd", ["generate", "chat", "serve", "bench", "train", "plan", "train distill-data"])
def test_every_subcommand_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([*cmd.split(), "--help"])
    assert e.value.code == 0
    assert "usage: leapdecode" in capsys.readouterr().out


def test_generate_json(tiny_model_dir, capsys):
    rc = main(["generate", "Hello there", "--model", str(tiny_model_dir), "--max-tokens", "5", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 5 or out["finish_reason"] == "stop"
    assert out["metrics"]["num_output_tokens"] == len(out["token_ids"])
    assert out["prompt_token_ids"]


def test_generate_streams_text(tiny_model_dir, capsys):
    assert main(["generate", "Hello", "--model", str(tiny_model_dir), "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "tok/s" in captured.err


def test_chat_one_shot(tiny_model_dir, capsys):
    assert main(["chat", "--model", str(tiny_model_dir), "--message", "Hi", "--max-tokens", "4"]) == 0


def test_bad_input_is_a_clear_error_not_a_traceback(tiny_model_dir, capsys):
    assert main(["generate", "x", "--model", str(tiny_model_dir), "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "/nonexistent/model"]) == 2


def test_bench_writes_tables(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"Question {i}: say something."]}) for i in range(3)))
    out = tmp_path / "res"
    rc = main(["bench", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--num-prompts", "3",
               "--max-tokens", "6", "--methods", "none,ngram", "--prefix-reuse", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["method"], r["batch"]) for r in data["rows"]}
    assert rows == {("none", 1), ("none", 3), ("ngram", 1), ("ngram", 3)}
    ngram1 = next(r for r in data["rows"] if r["method"] == "ngram" and r["batch"] == 1)
    assert ngram1["identical"] == "3/3"
    md = out.with_suffix(".md").read_text()
    assert "| system | method |" in md and "| warm |" in md


def test_distill_data_refuses_mt_bench_and_resumes(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="MT-Bench"):
        from leapdecode.train.distill import load_training_prompts

        load_training_prompts(tmp_path / "mt_bench" / "question.jsonl", None, 1000)
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(json.dumps({"id": f"x{i}", "prompt": f"Tell me about {i}."}) for i in range(4)))
    out = tmp_path / "d"
    args = ["train", "distill-data", "--model", str(tiny_model_dir), "--prompts", str(src), "--out", str(out),
            "--max-tokens", "4", "--batch-size", "2"]
    assert main([*args, "--limit", "2"]) == 0
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2
    assert main(args) == 0  # resumes: only the 2 missing prompts are generated
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == ["x0", "x1", "x2", "x3"]
    assert json.loads((out / "manifest.json").read_text())["num_prompts"] == 4
    assert main([*args, "--sampled", "--temperature", "0.8"]) == 0  # the greedy answers stay, sampled ones join
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["mode"] for r in lines) == ["greedy"] * 4 + ["sampled"] * 4
    command = json.loads((out / "manifest.json").read_text())["command"]
    assert "--sampled --temperature 0.8" in command and "True" not in command  # a flag is written as a flag


def test_parser_lists_all_commands():
    text = build_parser().format_help()
    for cmd in ("generate", "chat", "serve", "bench", "train", "plan"):
        assert cmd in text


def test_a_crashing_comparison_system_is_skipped_not_fatal(capsys):
    """llama.cpp built for CPU features the machine lacks dies with SIGILL; the benchmark must survive it."""
    import math
    import os

    from leapdecode.bench.benchmark import run_isolated

    assert run_isolated(math.factorial, 5, what="factorial") == 120
    assert run_isolated(os.abort, what="llama.cpp") is None
    assert "llama.cpp crashed" in capsys.readouterr().err
