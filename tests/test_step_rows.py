"""bench.step_rows: both shapes timed on a model's own runner, and the batch shape read as decode throughput."""

from __future__ import annotations

from pathlib import Path

import pytest

from leapdecode.bench import step_rows


def test_throughput_is_sequences_per_step_time() -> None:
    row = step_rows.format_throughput("k", [1, 4, 16], [0.010, 0.020, 0.080])
    assert row == "| k | 100 (1.00x) | 200 (2.00x) | 200 (2.00x) |"


def test_step_rows_times_both_shapes_and_prints_throughput(tiny_model_dir: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert step_rows.main(["--model", str(tiny_model_dir), "--linear-kernels", "auto", "--rows", "1,3",
                           "--context", "20", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| leapdecode auto, tree | " in out and "| leapdecode auto, batch | " in out
    table = out[out.index("Decode throughput"):]
    assert "| kernel | batch 1 | batch 3 |" in table and "| leapdecode auto | " in table and "(1.00x)" in table
