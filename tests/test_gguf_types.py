"""A tiny Llama GGUF in every supported type, written with gguf's own writer: loaded with its blocks kept (no float
copy) it computes bitwise what the float32 model of gguf's dequantisation computes, and bad files are refused
with errors that name the tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ModelRunner
from leapdecode.eval import linear_bench
from leapdecode.kernels import extension
from leapdecode.layers import small_gemm
from leapdecode.layers.block_formats import KIND_OF_TYPE
from leapdecode.models import kernel_plan
from leapdecode.models.loader import kept_weight_bytes, load_model

from .test_block_formats import random_blocks
from .test_model_parity import _run_schedule, _tokens

pytestmark = pytest.mark.skipif(extension.load_kernel() is None, reason="CPU kernel unavailable")

H, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 512  # K-quants need rows of whole 256-blocks


def write_tiny_gguf(path: Path, types: dict[str, str], tied: bool = False, seed: int = 0) -> Path:
    """A random Llama GGUF; ``types`` maps a tensor-name suffix ("attn_v", "ffn_down", "token_embd", ... or
    "*") to its ggml type (norms are F32)."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    rng = np.random.default_rng(seed)

    def mat(name: str, n: int, k: int) -> None:
        kind = types.get(name.split(".")[-2], types["*"])
        if kind in ("F32", "F16", "BF16"):
            a = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            if kind == "BF16":
                w.add_tensor(name, (a.view(np.uint32) >> 16).astype(np.uint16), raw_dtype=GGMLQuantizationType.BF16)
            else:
                w.add_tensor(name, a.astype(np.float16) if kind == "F16" else a)
            return
        raw = random_blocks(kind, n, k, seed=int(rng.integers(1 << 30)))
        w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))

    mat("token_embd.weight", VOCAB, H)
    norm("output_norm.weight")
    if not tied:
        mat("output.weight", VOCAB, H)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        mat(f"blk.{i}.attn_q.weight", HEADS * 64, H)
        mat(f"blk.{i}.attn_k.weight", KV_HEADS * 64, H)
        mat(f"blk.{i}.attn_v.weight", KV_HEADS * 64, H)
        mat(f"blk.{i}.attn_output.weight", H, HEADS * 64)
        mat(f"blk.{i}.ffn_gate.weight", INTER, H)
        mat(f"blk.{i}.ffn_up.weight", INTER, H)
        mat(f"blk.{i}.ffn_down.weight", H, INTER)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(model, tokens: list[int]) -> torch.Tensor:
    kv = KVCache(model.config, 40, 4, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, 4, torch.device("cpu"))
    # a prompt, then decode steps and a 4-row verification chunk: every path the kernels take
    return _run_schedule(runner, BlockManager(40, 4, enable_prefix_caching=False), [tokens], [[20], [1], [1], [4]])[0]


MIXES = {t: {"*": t} for t in KIND_OF_TYPE} | {
    # llama.cpp's Q4_K_M: some layers' V and FFN-down in Q6_K, an F16 embedding, a tied head
    "Q4_K_M": {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
    "floats": {"*": "F16", "attn_q": "BF16", "ffn_up": "F32"},
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_blocks_kept_compute_bitwise_the_dequantised_model(tmp_path, mix):
    path = write_tiny_gguf(tmp_path / f"{mix}.gguf", MIXES[mix], tied=mix == "Q5_0")
    kept, _ = load_model(path)
    ref, _ = load_model(path, keep_blocks=False)  # gguf's float32 dequantisation, as HF transformers loads it
    for (name, a), b in zip(kept.named_modules(), ref.modules()):
        if getattr(a, "quant", None) is not None:
            assert a.weight is None and torch.equal(a.dense_weight(), b.weight), name  # incl. Q/K row order
    held = sum(m.quant.nbytes for m in kept.modules() if getattr(m, "quant", None) is not None)
    assert kept_weight_bytes(path) == held + 4 * sum(p.numel() for p in kept.parameters())  # what `plan` counts
    quantized = mix != "floats"
    assert any(getattr(m, "quant", None) is not None for m in kept.modules()) == quantized
    assert kernel_plan.use_kernels(kept) > 0 and kernel_plan.use_kernels(ref) > 0
    formats = small_gemm.packed_formats(kept)
    assert ("float32" not in formats) == quantized, formats
    tokens = _tokens(26, seed=3)
    got, want = _logits(kept, tokens), _logits(ref, tokens)
    assert torch.equal(got, want)
    assert torch.isfinite(got).all() and got.std() > 0


def test_unsupported_type_truncated_and_overlapping_files_are_refused(tmp_path):
    good = write_tiny_gguf(tmp_path / "good.gguf", {"*": "Q4_0"})
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"tensor blk\.1\.ffn_down\.weight .*truncated"):
        load_model(cut)
    iq = write_tiny_gguf(tmp_path / "iq.gguf", {"*": "Q4_0"})
    raw = bytearray(iq.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = raw.index(name) + len(name) + 4 + 8 * 2  # after the name: n_dims (u32) and two dims (u64 each)
    raw[at: at + 4] = int(GGMLQuantizationType.IQ4_NL).to_bytes(4, "little")  # same 18-byte blocks as Q4_0
    iq.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight has unsupported type IQ4_NL"):
        load_model(iq)
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(not_gguf)


def test_linear_bench_times_a_files_own_matrices(tmp_path, capsys):
    """The micro-benchmark reads a file's quantized matrices per type and shape, checks the float kernel on each
    group before timing it, and prints a row per group and kernel."""
    path = write_tiny_gguf(tmp_path / "mix.gguf", MIXES["Q4_K_M"])
    assert linear_bench.main(["--model", str(path), "--rows", "1,2", "--matrices", "2", "--repeats", "1",
                              "--kernels", "float,int8"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| Q")]
    assert {ln.split(" | ")[0][2:] for ln in rows} == {"Q4_K", "Q6_K"}
    assert {ln.split(" | ")[3] for ln in rows} == {"float", "int8"}
    with pytest.raises(SystemExit):
        linear_bench.main(["--model", str(path), "--types", "Q8_0"])
