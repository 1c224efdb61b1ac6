"""bench/batch_plot.py: speedups over plain decoding by batch from bench runs, and the picture of them."""

from __future__ import annotations

from leapdecode.bench.batch_plot import batch_figure, speedups


def _row(method: str, batch: int, tps: float, kernel: str = "") -> dict:
    return {"system": "leapdecode", "method": method + (f" [{kernel}]" if kernel else ""), "batch": batch,
            "tok_per_s": tps, "kernel": kernel}


def test_speedups_are_per_batch_and_precision_and_prefer_the_larger_run() -> None:
    small = {"prompts": "chat", "num_prompts": 8, "rows": [
        _row("none", 1, 100.0), _row("suffix", 1, 50.0), _row("none", 8, 400.0), _row("suffix", 8, 380.0),
        _row("none", 1, 160.0, "packed-int8act"), _row("suffix", 1, 200.0, "packed-int8act")]}
    large = {"prompts": "chat", "num_prompts": 16, "rows": [
        _row("none", 1, 110.0), _row("suffix", 1, 121.0), _row("none", 16, 500.0), _row("suffix", 16, 450.0),
        {"system": "llama.cpp", "method": "none", "batch": 1, "tok_per_s": 999.0, "kernel": ""}]}
    got = speedups([small, large])
    assert got[("chat", "float32")]["suffix"] == {1: 121.0 / 110.0, 8: 380.0 / 400.0, 16: 450.0 / 500.0}
    assert got[("chat", "packed-int8act")]["suffix"] == {1: 200.0 / 160.0}  # against int8's own plain decoding
    fig = batch_figure([small, large], "title")
    ax = fig.axes[0]
    lines = {line.get_label(): list(line.get_ydata())
             for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert lines["suffix"] == [121.0 / 110.0, 380.0 / 400.0, 450.0 / 500.0] and lines["none"] == [1.0, 1.0, 1.0]


def test_speedups_pair_requests_where_the_runs_kept_them() -> None:
    run = {"prompts": "chat", "num_prompts": 3, "rows": [
        {**_row("none", 1, 100.0), "paired_tok_per_s": [50.0, 100.0, 150.0]},
        {**_row("suffix", 1, 60.0), "paired_tok_per_s": [50.0, 60.0, 150.0]}]}
    assert speedups([run])[("chat", "float32")]["suffix"] == {1: 1.0}  # the ratio of medians would say 0.60

