"""``leapdecode bench --report DIR`` on a tiny setting: both tables for every method asked, the plots, the JSON, the
hardware in every header, and the scored code set's checker."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from leapdecode.bench.report_plots import PLOTS, pyplot, report_figures
from leapdecode.bench.scored import passes
from leapdecode.cli import main


def test_report_writes_both_tables_plots_and_json(tiny_model_dir, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["Count: 1 2 3 1 2 3 1 2", "Say a b a b a"]))
    code = tmp_path / "code.jsonl"
    code.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "def one():\n    return 1\n", "test": "def check(f):\n    assert f() == 1\n", "entry_point": "one"},
        {"prompt": "def two():\n", "test": "def check(f):\n    assert f() == 2\n", "entry_point": "two"},
    ]))
    out = tmp_path / "report"
    assert main(["bench", "--report", str(out), "--model", str(tiny_model_dir), "--prompts", str(questions),
                 "--num-prompts", "2", "--max-tokens", "8", "--ignore-eos",
                 "--methods", "ngram,suffix,auto,blockwise_topk",
                 "--batches", "1,2", "--contexts", "16,40", "--code-tasks", "2", "--code-file", str(code)]) == 0
    md = (out / "report.md").read_text()
    data = json.loads((out / "report.json").read_text())
    assert md.count("Hardware: ") == 3 and "## Latency" in md and "## Quality" in md
    assert {(c["method"], c["batch"]) for c in data["latency"]} == {(m, b) for m in ("none", "ngram", "suffix",
                                                                                    "auto") for b in (1, 2)}
    plain = {c["batch"]: c for c in data["latency"] if c["method"] == "none"}
    for c in data["latency"]:
        assert c["identical"] == "2/2" and c["tok_per_s"] > 0 and c["kv_mb"] > 0 and c["weights_mb"] > 0
        # two prompts: two groups at batch 1, one at batch 2; the speedup pairs each group with plain decoding's
        assert len(c["group_tok_per_s"]) == {1: 2, 2: 1}[c["batch"]]
        ref = plain[c["batch"]]["group_tok_per_s"]
        assert c["speedup"] == pytest.approx(statistics.median(x / y for x, y in zip(c["group_tok_per_s"], ref)))
    assert "Groups per batch size: 1: 2, 2: 1." in md
    quality = {q["method"]: q for q in data["quality"]}
    assert quality["none"]["ppl"] > 1 and quality["ngram"]["lossless"]
    assert all(q["code_pass"] in ("0/2", "1/2", "2/2") for q in quality.values())
    # blockwise heads are not shipped for this tiny model: listed as not run, with the reason
    assert "blockwise_topk" in data["not_run"] and "## Not run here" in md
    assert {ctx for ctx, _ in data["time_per_token_by_context"]["none"]} == {16, 40}
    for name in PLOTS:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "suffix" in data["acceptance_by_position"]  # a tree drafter: acceptance by depth
    check_plots_match_json(data)


def check_plots_match_json(data: dict) -> None:
    """The figures drawn from a report's JSON: each line plot has one line per JSON series with exactly its
    points, every line its own colour, every title inside its figure; the bars are the JSON's speedups."""
    figs = report_figures(data, data["plot_title"])
    try:
        want = {"acceptance_by_position": {m: [[j + 1, a] for j, a in enumerate(v)]
                                           for m, v in data["acceptance_by_position"].items()},
                "tpot_vs_context": {m: [list(p) for p in v] for m, v in data["time_per_token_by_context"].items()},
                "memory_vs_batch": {}}
        for c in data["latency"]:
            want["memory_vs_batch"].setdefault(c["method"], []).append(
                [c["batch"], c["weights_mb"] + c["drafter_mb"] + c["kv_mb"]])
        for name, series in want.items():
            ax = figs[name].axes[0]
            lines = {ln.get_label(): ln for ln in ax.get_lines()}
            assert set(lines) == {m for m, pts in series.items() if pts}, name
            for label, pts in series.items():
                got = [v for xy in zip(lines[label].get_xdata(), lines[label].get_ydata()) for v in xy]
                assert got == pytest.approx([v for p in pts for v in p]), (name, label)
            colours = [tuple(ln.get_color()) for ln in ax.get_lines()]
            assert len(set(colours)) == len(colours), name
        bars = figs["speedup"].axes[0].patches
        assert sorted(round(b.get_height(), 6) for b in bars) == sorted(round(c["speedup"] or 0.0, 6)
                                                                         for c in data["latency"])
        for name, fig in figs.items():
            fig.canvas.draw()
            title = fig.axes[0].title.get_window_extent()
            box = fig.bbox
            assert box.x0 <= title.x0 and title.x1 <= box.x1 and title.y1 <= box.y1, name
    finally:
        for fig in figs.values():
            pyplot().close(fig)


def test_every_series_has_its_own_colour_and_long_titles_fit():
    """Twelve series (the report has 11 methods): twelve colours; a long title wraps inside the figure."""
    series = {f"method{i}": [(1, i), (2, i + 1)] for i in range(12)}
    data = {"latency": [{"method": m, "batch": b, "speedup": 1.0, "weights_mb": 94.0, "drafter_mb": float(i),
                         "kv_mb": 8.0 * b} for i, m in enumerate(series) for b in (1, 8)],
            "acceptance_by_position": {m: [0.5, 0.25] for m in series},
            "time_per_token_by_context": {m: [[128, 5.0 + i], [512, 6.0 + i]] for i, m in enumerate(series)},
            "plot_title": "SmolLM2-135M-Instruct.Q4_1.gguf on Intel Xeon, 2 vCPUs with a long hardware line"}
    check_plots_match_json(data)


def test_code_checker_runs_the_tests():
    assert passes("def f():\n    return 1\n\nassert f() == 1\n")
    assert not passes("def f():\n    return 2\n\nassert f() == 1\n")
    assert not passes("def f(:\n")


@pytest.mark.parametrize("argv,message", [
    (["--method-config", "{}"], "--report does not take --method-config"),
    (["--raw", "--out", "x"], "--report does not take --raw, --out"),
    (["--batches", "1,x"], "--batches must be a comma list of integers"),
    (["--contexts", "0"], "--contexts must list integers >= 1"),
    (["--methods", "ngram,nope"], r"unknown methods \['nope'\]"),
    (["--code-tasks", "2", "--code-file", "missing.jsonl"], "--code-tasks needs a HumanEval-style jsonl"),
    (["--num-prompts", "0"], "--num-prompts >= 1"),
])
def test_report_refuses_bad_input_before_running(argv, message, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["bench", "--report", str(out), *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()  # nothing loaded, nothing written


def test_report_options_need_report_and_a_folder(tiny_model_dir, tmp_path, capsys):
    assert main(["bench", "--batches", "1,8"]) == 2
    assert "--batches goes with --report DIR" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["bench", "--report", str(afile)]) == 2
    assert "a file is there" in capsys.readouterr().err
    # a context the model cannot hold: refused once the model is loaded, before any run
    assert main(["bench", "--report", str(tmp_path / "r"), "--model", str(tiny_model_dir), "--contexts",
                 "16,1000000"]) == 2
    assert "--contexts 16,1000000: the model's context is" in capsys.readouterr().err
