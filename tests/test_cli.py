"""The command line: every subcommand has --help, and the main ones run end to end on a tiny model."""

from __future__ import annotations

import json
import shutil

import pytest

from leapdecode.cli import build_parser, main
from leapdecode.eval.prompts import shared_data_dir


@pytest.mark.parametrize("cmd", ["generate", "chat", "serve", "bench", "train", "plan", "train distill-data",
                                 "train eagle"])
def test_every_subcommand_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([*cmd.split(), "--help"])
    assert e.value.code == 0
    assert "usage: leapdecode" in capsys.readouterr().out


def test_one_train_command_per_technique():
    """One name per technique: `train eagle` is the adapter trainer with feature inputs (no `--features` flag on
    `train draft-model`), `train blockwise` the block heads' own trainer; records say the command."""
    from leapdecode.train.adapter import command_line

    p = build_parser()
    eagle = vars(p.parse_args(["train", "eagle", "--data", "D"]))
    draft = vars(p.parse_args(["train", "draft-model", "--layers", "1", "--data", "D"]))
    assert eagle["features"] is True and eagle["layer"] == 0 and draft["features"] is False
    with pytest.raises(SystemExit):
        p.parse_args(["train", "draft-model", "--features", "--data", "D"])
    line = command_line(p.parse_args(["train", "eagle", "--data", "D"]))
    assert line.startswith("leapdecode train eagle --layers 1 ") and "--features" not in line
    blockwise = vars(p.parse_args(["train", "blockwise", "--data", "D", "--out", "O"]))
    medusa = vars(p.parse_args(["train", "medusa", "--data", "D", "--out", "O"]))
    assert blockwise["grad_checkpoint"] is True and "layout" not in blockwise and medusa["layout"] == "pyramid"


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


def test_chat_takes_a_chat_template_file_or_text(tiny_model_dir, tmp_path, capsys):
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}Answer:"
    (tmp_path / "t.jinja").write_text(template)
    for value in (str(tmp_path / "t.jinja"), template):
        assert main(["chat", "--model", str(tiny_model_dir), "--message", "Hi", "--max-tokens", "2",
                     "--chat-template", value]) == 0
    assert main(["chat", "--model", str(tiny_model_dir), "--message", "Hi", "--chat-template", "nope.jinja"]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err


def test_bad_input_is_a_clear_error_not_a_traceback(tiny_model_dir, capsys):
    assert main(["generate", "x", "--model", str(tiny_model_dir), "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "/nonexistent/model"]) == 2


def test_bench_on_a_model_without_a_chat_template_says_raw(tiny_model_dir, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    for f in base.glob("chat_template.*"):
        f.unlink()
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert main(["bench", "--model", str(base), "--num-prompts", "1", "--max-tokens", "2", "--methods", "none",
                 "--no-batched"]) == 2
    assert "--raw" in capsys.readouterr().err
    assert main(["bench", "--model", str(base), "--num-prompts", "1", "--max-tokens", "2", "--methods", "none",
                 "--no-batched", "--raw", "--out", str(tmp_path / "b")]) == 0


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


@pytest.mark.skipif(not (shared_data_dir() / "code" / "humaneval.jsonl").is_file(), reason="no shared data")
def test_bench_runs_the_agent_loop_turn_by_turn(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "loop"
    assert main(["bench", "--model", str(tiny_model_dir), "--prompts", "agent_loop", "--num-prompts", "4",
                 "--max-tokens", "6", "--methods", "none,suffix", "--drift", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    # two sessions (3 turns and 1): batched rows send each turn of both at once, so at most 2 requests together
    assert {(r["method"], r["batch"]) for r in rows} == {("none", 1), ("none", 2), ("suffix", 1), ("suffix", 2)}
    assert all(r["identical"] == "4/4" for r in rows if r["method"] == "suffix")
    assert all(r["ppl"] > 0 for r in rows)
    md = out.with_suffix(".md").read_text()
    assert "By session turn" in md and "- suffix: turn 1 " in md and "turn 3 " in md
    assert main(["bench", "--report", str(tmp_path / "rep"), "--prompts", "agent_loop"]) != 0
    assert "without --report" in capsys.readouterr().err


def test_bench_runs_every_engine_on_the_kv_cache_it_is_given(tiny_model_dir, tmp_path, capsys):
    """--kv-cache-dtype int8: the rows are compared with plain decoding over the same (lossy) cache, and the
    header names the cache."""
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"Repeat this: {i} apples, {i} pears."]}) for i in range(2)))
    out = tmp_path / "res"
    assert main(["bench", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--num-prompts", "2",
                 "--max-tokens", "8", "--methods", "none,ngram", "--no-batched", "--kv-cache-dtype", "int8",
                 "--out", str(out)]) == 0
    ngram = next(r for r in json.loads(out.with_suffix(".json").read_text())["rows"] if r["method"] == "ngram")
    assert ngram["identical"] == "2/2"
    assert "int8 cache" in out.with_suffix(".md").read_text()
    assert main(["bench", "--report", str(tmp_path / "rep"), "--kv-cache-dtype", "int8"]) != 0
    assert "--report does not take --kv-cache-dtype" in capsys.readouterr().err


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

    from leapdecode.bench.external import run_isolated

    assert run_isolated(math.factorial, 5, what="factorial") == 120
    assert run_isolated(os.abort, what="llama.cpp") is None
    assert "llama.cpp crashed" in capsys.readouterr().err


def test_ceiling_is_acceptance_over_the_targets_step_cost_at_the_verified_rows():
    """--ceiling: a row's verified rows are 1 + its drafts per step, and its ceiling is mean accepted x t(1) /
    t(rows) under the measured step costs; plain decoding's is 1.0, and batched rows get none."""
    from leapdecode.bench.benchmark import add_ceiling, format_table
    from leapdecode.bench.rows import Row
    from leapdecode.speculative.policy import StepCostModel

    costs = StepCostModel([(1, 0.010), (3, 0.012), (5, 0.016)])
    plain = Row("leapdecode", "none", 1, 2, 100, 50.0, 1.0, 1.0)
    spec = Row("leapdecode", "medusa", 1, 2, 100, 60.0, 1.0, 1.0, mean_accepted=2.0, num_draft_tokens=150)
    batched = Row("leapdecode", "medusa", 2, 2, 100, 90.0, 1.0, 1.0, mean_accepted=2.0, num_draft_tokens=150)
    add_ceiling([plain, spec, batched], costs)
    assert plain.verified_rows == 1.0 and plain.ceiling == 1.0
    assert spec.verified_rows == 4.0  # 50 steps, 150 drafts
    assert spec.ceiling == pytest.approx(2.0 * 0.010 / 0.014)
    assert batched.ceiling is None and batched.verified_rows is None
    table = format_table([plain, spec, batched])
    assert "| verified rows | ceiling (free drafting) |" in table and "| 4.00 | 1.43 |" in table


def test_speedup_pairs_requests_on_the_same_prompt_and_rounds():
    """A batch-1 row's speedup is the median of its per-prompt tok/s ratios to `none` on the same prompts (two runs
    of equal speed on prompts of different lengths are 1.00x, whatever their own medians say); a batched row's,
    the median of its per-round ratios."""
    from leapdecode.bench.benchmark import paired_speedup
    from leapdecode.bench.rows import Row

    base = Row("leapdecode", "none", 1, 3, 30, 100.0, 1.0, 1.0, paired_tok_per_s=[50.0, 100.0, 150.0])
    same = Row("leapdecode", "medusa", 1, 3, 30, 60.0, 1.0, 1.0, paired_tok_per_s=[50.0, 60.0, 150.0])
    assert paired_speedup(same, base) == pytest.approx(1.0)  # the ratio of medians would say 0.60x
    fast = Row("leapdecode", "ngram", 1, 3, 30, 0.0, 1.0, 1.0, paired_tok_per_s=[60.0, 130.0, 165.0])
    assert paired_speedup(fast, base) == pytest.approx(1.2)
    rounds = Row("leapdecode", "ngram", 3, 3, 30, 240.0, 1.0, 1.0, paired_tok_per_s=[240.0, 200.0, 260.0])
    plain = Row("leapdecode", "none", 3, 3, 30, 240.0, 1.0, 1.0, paired_tok_per_s=[250.0, 190.0, 240.0])
    assert paired_speedup(rounds, plain) == pytest.approx(200 / 190)  # rounds paired: 0.96x, 1.05x, 1.08x
    external = Row("llama.cpp", "", 1, 3, 30, 50.0, 1.0, 1.0)
    assert paired_speedup(external, base) == pytest.approx(0.5)  # nothing to pair: the ratio of tok/s


def test_bench_ceiling_times_the_target_and_reports_it(tiny_model_dir, tmp_path):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"Question {i}: say something."]}) for i in range(2)))
    out = tmp_path / "res"
    assert main(["bench", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--num-prompts", "2",
                 "--max-tokens", "6", "--methods", "none,ngram", "--no-batched", "--ceiling", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = [n for n, _ in data["step_costs_s"][""]]
    assert rows[0] == 1 and rows[-1] >= 17  # the sizes a Medusa tree or a long chain verifies
    times = [t for _, t in data["step_costs_s"][""]]
    assert all(t > 0 for t in times) and times == sorted(times)
    for r in data["rows"]:
        assert r["verified_rows"] >= 1.0 and r["ceiling"] > 0
    assert "ceiling (free drafting)" in out.with_suffix(".md").read_text()
