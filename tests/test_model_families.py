"""Mistral (sliding window), Qwen3, Phi-3 and Gemma 3 against HF transformers, from HF folders and GGUF files.

Every family's tiny random model (tests/family_models.py) has a sliding window of 8 positions, so the 30-token
prompts here cross it several times; logits of every position must match HF's forward, with the model run op by op
and on the CPU kernels (packed projections, C++ norms and few-row attention, the fused layer stack where the layer
has Llama's layout). The engine then decodes greedily, plainly and with every speculative method that needs no
trained artifact, with prefix caching across the window edge: the tokens must be HF's greedy tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ModelRunner
from leapdecode.kernels import extension
from leapdecode.layers import decoder_stack, split_kv
from leapdecode.models import kernel_plan
from leapdecode.models.config import ModelConfig
from leapdecode.models.loader import load_model

from . import test_tree as tree_checks
from .family_models import FAMILIES, WINDOW, build_hf, write_gguf
from .test_model_parity import _run_schedule, _tokens

TOL = 1e-4
NAMES = list(FAMILIES)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> folder holding the HF checkpoint and ``model.gguf`` written from it."""
    out = {}
    for i, family in enumerate(NAMES):
        d = tmp_path_factory.mktemp(f"family_{family}")
        hf = build_hf(family, seed=i + 1)
        hf.save_pretrained(str(d))
        write_gguf(hf, d / "model.gguf")
        out[family] = d
    return out


def _hf_logits(folder: Path, tokens: list[int], gguf: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf} if gguf else {}
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _ours(source: Path, kernels: bool, schedule: list[list[int]], tokens: list[int]) -> torch.Tensor:
    model, cfg = load_model(source, keep_blocks=False)
    if kernels:
        if extension.load_kernel() is None:
            pytest.skip("no C++ toolchain to build the kernels")
        assert kernel_plan.use_kernels(model) > 0
    kv = KVCache(cfg, 64, 4, torch.float32, torch.device("cpu"))
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    return _run_schedule(ModelRunner(model, kv, 4, torch.device("cpu")), bm, [tokens], schedule)[0]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", NAMES)
def test_logits_match_hf_beyond_the_window(family_dirs, family: str, source: str, kernels: bool) -> None:
    folder = family_dirs[family]
    tokens = _tokens(30, seed=len(family))
    ref = _hf_logits(folder, tokens)
    path = folder if source == "hf" else folder / "model.gguf"
    # a prompt of 12 (past the window), a chunk of 6, then one token at a time and a 3-token draft-like chunk
    got = _ours(path, kernels, [[12], [6], [1], [1], [1], [3], [1], [1], [1], [1], [1], [1]], tokens)
    diff = (got - ref).abs().max().item()
    assert ref.abs().max() > 1.0 and diff <= TOL, f"{family} {source}: max |logit diff| {diff:.3g}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_split_kv_reads_only_the_window(family_dirs, monkeypatch, family: str) -> None:
    """Split-KV attention (one sequence: chunks in parallel; a padded batch: chunk by chunk) over the windowed
    plan: thresholds lowered so that every decode step of these short sequences splits."""
    monkeypatch.setattr(split_kv, "SPLIT_KV_CHUNK", 4)
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_CONTEXT", 8)
    monkeypatch.setattr(split_kv, "SPLIT_KV_BATCH_CHUNK", 4)
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_BATCH_TOKENS", 16)
    modes: list[bool] = []
    split = split_kv.split_attention

    def counted(qf, kg, vg, k_cache, v_cache, plan, scale):
        modes.append(plan.chunked_read)
        return split(qf, kg, vg, k_cache, v_cache, plan, scale)

    monkeypatch.setattr(split_kv, "split_attention", counted)
    folder = family_dirs[family]
    a, b = _tokens(30, seed=11), _tokens(26, seed=12)
    model, cfg = load_model(folder, keep_blocks=False)
    kv = KVCache(cfg, 64, 4, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, 4, torch.device("cpu"))
    got = _run_schedule(runner, BlockManager(64, 4, enable_prefix_caching=False), [a, b],
                        [[20, 0], [1, 16]] + [[1, 1]] * 9 + [[0, 1]])
    assert set(modes) == {False, True}  # both modes ran
    for tokens, logits in zip((a, b), got, strict=True):
        ref = _hf_logits(folder, tokens)
        assert (logits - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("family", NAMES)
def test_quantized_gguf_runs_from_its_blocks(family_dirs, tmp_path, family: str) -> None:
    """Every matrix in Q8_0 (Phi-3's fused q/k/v and gate/up, Gemma's tied embedding included): the model that
    keeps the file's blocks gives the logits of the same file dequantised to float32."""
    if extension.load_kernel() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(family_dirs[family]), dtype=torch.float32)
    path = write_gguf(hf, tmp_path / "q8.gguf", matrix_type="Q8_0")
    tokens = _tokens(20, seed=5)
    logits = []
    for keep in (True, False):
        model, cfg = load_model(path, keep_blocks=keep)
        assert kernel_plan.use_kernels(model) > 0
        assert (model.layers[0].self_attn.qkv_proj.quant is not None) == keep
        kv = KVCache(cfg, 64, 4, torch.float32, torch.device("cpu"))
        runner = ModelRunner(model, kv, 4, torch.device("cpu"))
        bm = BlockManager(64, 4, enable_prefix_caching=False)
        logits.append(_run_schedule(runner, bm, [tokens], [[12]] + [[1]] * 8)[0])
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=TOL)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("family", NAMES)
def test_the_fused_layer_stack_equals_the_per_op_path_bitwise(family_dirs, monkeypatch, family: str,
                                                             kv_dtype: torch.dtype) -> None:
    """Decode and verification steps run every layer in one C++ call (decoder_stack: Llama's layout, or the
    normed one of Qwen3 and Gemma 3 with its global and windowed layers, over a float32 or an int8 cache); the
    logits are the per-op path's bits."""
    if extension.load_kernel() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    model, cfg = load_model(family_dirs[family], keep_blocks=False)
    assert kernel_plan.use_kernels(model) > 0
    calls: list[int] = []
    real = decoder_stack.decoder_stack
    monkeypatch.setattr(decoder_stack, "decoder_stack", lambda *args: calls.append(1) or real(*args))
    tokens = _tokens(38, seed=2)
    steps = [[20]] + [[1]] * 6 + [[4]] + [[1]] * 8  # a prompt chunk (op by op), then 15 fused steps
    outs = []
    for fused in (True, False):
        for layer in model.layers:
            layer.use_kernel = fused
        runner = ModelRunner(model, KVCache(cfg, 64, 4, kv_dtype, torch.device("cpu")), 4, torch.device("cpu"))
        bm = BlockManager(64, 4, enable_prefix_caching=False)
        outs.append(_run_schedule(runner, bm, [tokens], steps)[0])
        assert len(calls) == 15
    assert torch.equal(outs[0], outs[1])


def test_hf_reads_the_gemma3_gguf_as_we_do(family_dirs) -> None:
    """The GGUF writer follows llama.cpp's Gemma 3 conventions (norms stored as 1 + w, names, window): HF's own
    GGUF reader loads it to the same model."""
    folder = family_dirs["gemma3"]
    tokens = _tokens(20, seed=3)
    torch.testing.assert_close(_hf_logits(folder, tokens, gguf="model.gguf"), _hf_logits(folder, tokens),
                               rtol=0, atol=TOL)


def test_configs_read_windows_norms_and_ropes(family_dirs) -> None:
    cfg = load_model(family_dirs["gemma3"] / "model.gguf", keep_blocks=False)[1]
    assert cfg.family == "gemma3" and cfg.layer_windows == [WINDOW] * 5 + [None]
    assert cfg.local_rope_theta == 10000.0 and cfg.rope_theta == 1000.0 and cfg.tie_word_embeddings
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh"
    mistral = load_model(family_dirs["mistral"] / "model.gguf", keep_blocks=False)[1]
    assert mistral.architecture == "MistralForCausalLM" and mistral.layer_windows == [WINDOW, WINDOW]
    assert load_model(family_dirs["phi3"], keep_blocks=False)[1].layer_windows == [WINDOW, WINDOW]


@pytest.mark.parametrize("key,value,match", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("hidden_act", "relu", "activation"),
    ("layer_types", ["chunked_attention", "full_attention"], "layer_types"),
    ("mlp_bias", True, "mlp_bias"),
])
def test_a_setting_the_engine_cannot_honour_is_an_error(key: str, value, match: str) -> None:
    d = {"architectures": ["MistralForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
         "num_hidden_layers": 2, "num_attention_heads": 2, key: value}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(d)


def test_longrope_phi3_is_refused(family_dirs, tmp_path) -> None:
    import json

    d = tmp_path / "phi3_longrope"
    shutil.copytree(family_dirs["phi3"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="longrope"):
        load_model(d, keep_blocks=False)


# ------------------------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engine_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, tuple[Path, Path]]:
    """family -> (target folder, a second random model of the family as its draft), with the bundled tokenizer."""
    out = {}
    for i, family in enumerate(NAMES):
        pair = []
        for role, seed in (("target", 10 + i), ("draft", 20 + i)):
            d = tmp_path_factory.mktemp(f"engine_{family}_{role}")
            layers = {"num_hidden_layers": 1} if role == "draft" and family != "gemma3" else {}
            build_hf(family, seed=seed, vocab_size=49152, **layers).save_pretrained(str(d))
            for f in tokenizer_dir.iterdir():
                shutil.copy(f, d / f.name)
            pair.append(d)
        out[family] = (pair[0], pair[1])
    return out


def _hf_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", NAMES)
def test_greedy_and_speculation_are_hf_tokens_across_the_window(engine_dirs, family: str) -> None:
    target, draft = engine_dirs[family]
    shared = _tokens(14, seed=7)  # two prompts sharing 14 tokens: the second reuses cached blocks
    prompts = [shared + _tokens(6, seed=8), shared + _tokens(9, seed=9) + shared[:5]]
    n = 16
    want = [_hf_greedy(target, p, n) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                 {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}):
        llm = LLM(model=str(target), kv_cache_blocks=64, block_size=4, enable_prefix_caching=True,
                  speculative_config=spec)
        for p, w in zip(prompts, want, strict=True):  # one at a time: the second hits the prefix cache
            got = llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
            assert list(got) == w, f"{family} {spec and spec['method']}: {list(got)} != {w}"


def test_a_shipped_trained_drafter_refuses_another_family(engine_dirs) -> None:
    with pytest.raises(ValueError, match="trained for another"):
        LLM(model=str(engine_dirs["gemma3"][0]), kv_cache_blocks=64, speculative_config={"method": "self_spec"})


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_candidate_trees_across_the_window_match_each_path(engine_dirs, family: str) -> None:
    """Trees verified in one pass and grown over several (Medusa's, EAGLE's): each node's window starts at its own
    depth's position, and its logits equal a plain forward over prompt + its path (the checks of test_tree.py,
    on a model whose window of 8 the prompts and trees cross)."""
    engine = LLM(model=str(engine_dirs[family][0]), kv_cache_blocks=256, block_size=4).engine
    tree_checks.test_tree_mask_forward_matches_each_path_brute_force(engine)
    tree_checks.test_tree_grown_over_passes_matches_each_path_brute_force(engine)


def test_a_gguf_files_rope_freqs_are_llama3_scaling(tmp_path) -> None:
    """llama.cpp writes Llama 3's RoPE scaling as one factor per frequency (``rope_freqs``): applied, the GGUF
    model matches HF's llama3-scaled model (ignored, positions past the original context would drift)."""
    import math

    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=scaling)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    plain = write_gguf(hf, tmp_path / "plain.gguf")
    # the same file plus the factors, computed as llama.cpp's converter computes them
    factors = []
    for i in range(0, 16, 2):
        wavelen = 2 * math.pi / (500000.0 ** (-i / 16))
        if wavelen < 16 / 4.0:
            factors.append(1.0)
        elif wavelen > 16 / 1.0:
            factors.append(8.0)
        else:
            smooth = (16 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    scaled = write_gguf(hf, tmp_path / "scaled.gguf",
                        extra={"rope_freqs.weight": np.array(factors, dtype=np.float32)})
    tokens = _tokens(40, seed=6)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = _ours(scaled, False, [[30], [10]], tokens)
    assert (got - ref).abs().max().item() <= TOL
    assert (_ours(plain, False, [[30], [10]], tokens) - ref).abs().max().item() > 10 * TOL
