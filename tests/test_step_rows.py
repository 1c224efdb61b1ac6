"""eval/step_rows: the step cost by rows table on a tiny model (cheap; what it prints, not how fast)."""

from __future__ import annotations

import pytest

from leapdecode.eval import step_rows


def test_step_rows_times_every_row_count_and_shape(tiny_model_dir, capsys) -> None:
    assert step_rows.main(["--model", str(tiny_model_dir), "--linear-kernels", "torch", "--rows", "1,2,3",
                           "--context", "20", "--repeats", "1"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| leapdecode")]
    assert [ln.split(" | ")[0][2:] for ln in rows] == ["leapdecode torch, tree", "leapdecode torch, batch"]
    for ln in rows:
        cells = ln.strip(" |").split(" | ")[1:]
        assert len(cells) == 3 and cells[0].endswith("(1.00x)")
        assert all(float(c.split()[0]) > 0 for c in cells)


def test_step_rows_refuses_unknown_options(tiny_model_dir) -> None:
    with pytest.raises(SystemExit):
        step_rows.main(["--model", str(tiny_model_dir), "--shapes", "ring"])
    with pytest.raises(SystemExit):
        step_rows.main(["--model", str(tiny_model_dir), "--rows", "0,1"])
