"""``leapdecode plan``: byte counts checked against hand counts (no weights are ever loaded)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from leapdecode.models.config import ModelConfig
from leapdecode.plan import add_cli, make_plan

LLAMA_7B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
MIB = 1 << 20
GIB = 1 << 30


def config_dir(tmp_path: Path, cfg: dict) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def run_plan(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_cli(sub)
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_llama7b_fp16_sequence_is_512_mib(tmp_path, capsys):
    d = config_dir(tmp_path, LLAMA_7B)
    assert (
        run_plan(
            "--model",
            str(d),
            "--context",
            "1024",
            "--kv-dtype",
            "float16",
            "--weight-dtype",
            "float16",
            "--memory-gb",
            "24",
            "--json",
        )
        == 0
    )
    p = json.loads(capsys.readouterr().out)
    assert p["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert p["kv_bytes_per_sequence"] == 512 * MIB
    # hand count: 32 x (qkv 3*4096^2 + o 4096^2 + mlp 3*4096*11008 + 2 norms) + final norm + untied embed/head
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    params = 32 * per_layer + 4096 + 2 * 32000 * 4096
    assert p["num_params"] == params == 6_738_415_616
    assert p["weight_bytes"] == 2 * params
    budget = 24 * GIB - 2 * params
    assert p["kv_budget_bytes"] == budget
    assert p["max_sequences"] == budget // (512 * MIB) == 22
    assert p["fits"] is True
    assert p["kv_cache_blocks"] == 1024 // 16


def test_smollm2_fp32_per_token_and_block_rounding(tmp_path, capsys):
    d = config_dir(tmp_path, SMOLLM2_135M)
    run_plan("--model", str(d), "--context", "1000", "--batch", "4", "--memory-gb", "1", "--json")
    p = json.loads(capsys.readouterr().out)
    assert p["kv_dtype"] == "float32"  # auto = weight dtype
    assert p["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 4 == 46_080
    assert p["kv_bytes_per_sequence"] == 1008 * 46_080  # 1000 tokens -> 63 whole blocks of 16
    assert p["batch_kv_bytes"] == 4 * 1008 * 46_080
    assert p["weight_bytes"] == 134_515_008 * 4
    budget = GIB - 134_515_008 * 4
    assert p["max_sequences"] == budget // (1008 * 46_080)
    assert p["max_context_at_batch"] == budget // (4 * 16 * 46_080) * 16


def test_int8_counts_scales(tmp_path, capsys):
    d = config_dir(tmp_path, SMOLLM2_135M)
    run_plan("--model", str(d), "--context", "16", "--kv-dtype", "int8", "--memory-gb", "1", "--json")
    p = json.loads(capsys.readouterr().out)
    # int8 values + a float16 scale per 16 channels, per token per head
    assert p["kv_bytes_per_token"] == 30 * 3 * (64 + 4 * 2) * 2
    assert 46_080 / p["kv_bytes_per_token"] >= 3.5


def test_does_not_fit_and_text_output(tmp_path, capsys):
    d = config_dir(tmp_path, LLAMA_7B)
    run_plan(
        "--model", str(d / "config.json"), "--context", "2048", "--memory-gb", "16"
    )  # fp32 weights: 25 GiB
    out = capsys.readouterr().out
    assert "fits             NO" in out
    p = make_plan(ModelConfig.from_hf(LLAMA_7B), 2048, memory_bytes=16 * GIB)
    assert p.kv_budget_bytes == 0 and p.max_sequences == 0 and not p.fits


def test_bad_arguments(tmp_path):
    cfg = ModelConfig.from_hf(SMOLLM2_135M)
    with pytest.raises(ValueError, match="kv dtype"):
        make_plan(cfg, 128, kv_dtype="int4", memory_bytes=GIB)
    with pytest.raises(ValueError, match=">= 1"):
        make_plan(cfg, 0, memory_bytes=GIB)
    with pytest.raises(FileNotFoundError):
        run_plan("--model", str(tmp_path / "missing"))


def test_default_is_bundled_model(capsys):
    pytest.importorskip("gguf")
    from leapdecode.models.loader import bundled_model_path

    try:
        bundled_model_path()
    except FileNotFoundError:
        pytest.skip("bundled model not installed")
    run_plan("--context", "2048", "--json")
    p = json.loads(capsys.readouterr().out)
    assert p["num_params"] == 134_515_008
    assert p["kv_bytes_per_token"] == 46_080
    assert p["memory_source"] == "available system memory"
