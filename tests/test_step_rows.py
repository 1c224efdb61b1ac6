"""bench.step_rows: both shapes timed on a model's own runner, and the batch shape read as decode throughput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leapdecode.bench import step_rows
from leapdecode.bench.hardware import macs_per_row, measure_peak_macs
from leapdecode.layers.int8_gemm import int8_activation_isa
from leapdecode.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from leapdecode.llm import LLM


def test_throughput_is_sequences_per_step_time() -> None:
    row = step_rows.format_throughput("k", [1, 4, 16], [0.010, 0.020, 0.080])
    assert row == "| k | 100 (1.00x) | 200 (2.00x) | 200 (2.00x) |"


def test_step_rows_times_both_shapes_and_writes_tables_json_and_plot(tiny_model_dir: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out_base = str(tmp_path / "rows")
    assert step_rows.main(["--model", str(tiny_model_dir), "--linear-kernels", "auto", "--rows", "1,3",
                           "--context", "20", "--repeats", "1", "--out", out_base]) == 0
    out = capsys.readouterr().out
    assert "| leapdecode auto, tree | " in out and "| leapdecode auto, batch | " in out
    table = out[out.index("Decode throughput"):]
    assert "| kernel | batch 1 | batch 3 |" in table and "| leapdecode auto | " in table and "(1.00x)" in table
    run = json.loads(Path(out_base + ".json").read_text())
    assert run["rows"] == [1, 3] and run["context"] == 20 and "torch" in run["cpu"]
    assert set(run["seconds"]) == {"leapdecode auto, tree", "leapdecode auto, batch"}
    assert all(len(v) == 2 and min(v) > 0 for v in run["seconds"].values())
    assert "Decode throughput" in Path(out_base + ".md").read_text()
    assert Path(out_base + ".png").read_bytes()[:4] == b"\x89PNG"
    if int8_activation_isa() in ("avx512-vnni", "avx2"):  # the kernels are built for an instruction to measure
        (label, floor), = run["floor_seconds"].items()
        assert label.startswith("auto: floor: ") and "float32 peak" in label and "Floor of a step" in out
        # one row's floor is its weight stream at least; three rows' multiply-adds take 3x one row's
        assert floor[1] >= floor[0] > 0


def test_macs_per_row_counts_every_projection_and_the_head(tiny_model_dir: Path) -> None:
    model = LLM(model=str(tiny_model_dir), linear_kernel="torch").engine.model
    projections = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, projections))
    cfg = model.config
    assert weights > 0 and macs_per_row(cfg) == weights + cfg.vocab_size * cfg.hidden_size


@pytest.mark.skipif(int8_activation_isa() not in ("avx512-vnni", "avx2"), reason="no vector kernels built here")
def test_arithmetic_peak_is_measured_for_both_kernels_and_refuses_other_kinds() -> None:
    int8, fp32 = measure_peak_macs("int8", 0.05), measure_peak_macs("float32", 0.05)
    # any x86 CPU with AVX2 makes billions of multiply-adds per second per thread with either instruction
    assert int8 is not None and fp32 is not None and min(int8, fp32) > 1e9
    # and no more than the instructions allow: 64 (VNNI) or 32 (AVX2) int8 products per instruction against FMA's
    # 16 or 8 floats (~4x and ~2x measured); a product computed once for all the loop's chains read ~15x on AVX2
    assert int8 < 8 * fp32
    with pytest.raises(RuntimeError, match="kind must be"):
        measure_peak_macs("bfloat16")  # type: ignore[arg-type]


def test_step_rows_builds_its_engines_with_the_kv_cache_asked_for(tiny_model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    real, caches = step_rows.LLM, []

    def llm(**kwargs):
        made = real(**kwargs)
        caches.append(made.engine.kv_cache)
        return made

    monkeypatch.setattr(step_rows, "LLM", llm)
    assert step_rows.main(["--model", str(tiny_model_dir), "--linear-kernels", "auto", "--rows", "1,2",
                           "--context", "20", "--repeats", "1", "--shapes", "batch", "--kv-cache-dtype", "int8"]) == 0
    assert "| leapdecode auto, int8 KV, batch | " in capsys.readouterr().out
    assert len(caches) == 1 and caches[0].dtype == torch.int8
