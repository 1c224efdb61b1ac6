"""int8 activations (``linear_kernel="packed-int8act"``): the VNNI kernel, its layout, and the engine-level promise
that speculation and prefix caching stay token-identical to plain decoding at this precision."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.kernels import extension
from leapdecode.layers import int8_gemm, small_gemm
from leapdecode.layers.block_formats import QuantizedWeight
from leapdecode.models import kernel_plan

from .conftest import SPEC_PROMPTS

ext = extension.load_kernel()
needs_kernel = pytest.mark.skipif(ext is None, reason="no C++ toolchain to build the kernel")


def _quantize(fmt: str, w: np.ndarray) -> int8_gemm.BlockQuantized:
    gguf = pytest.importorskip("gguf")
    raw = gguf.quants.quantize(w.astype(np.float32), getattr(gguf.GGMLQuantizationType, fmt))
    return QuantizedWeight.from_gguf([(fmt, raw, w.shape)]).to_block_quantized()


def _reference(x: torch.Tensor, bq: int8_gemm.BlockQuantized) -> torch.Tensor:
    """The definition: x rounded to int8 per 32 inputs (codes round(x * (127 / max|x|)) in float32, scale
    max|x| / 127), then the product with the weights in float64."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(xb * (127 / amax)), torch.zeros_like(xb))
    return (q.double() * (amax / 127).double()).reshape(m, k) @ bq.dequantize().double().T


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_int8_activation_kernel_matches_its_definition_and_is_batch_invariant(fmt: str) -> None:
    rng = np.random.default_rng(7)
    bq = _quantize(fmt, rng.standard_normal((96, 576)))
    packed = bq.pack_int8_activations()
    lines = int8_gemm.A8_Q8_LINES if fmt == "Q8_0" else int8_gemm.A8_Q4_LINES
    assert packed.shape == (96 // 16, 576 // 32, lines, 64) and packed.dtype == torch.uint8
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 70).view(-1, 1)
    x[5, :32] = 0.0  # an all-zero block quantizes to zeros, not NaN
    y = small_gemm.linear(x, bq.dequantize(), None, packed)  # 70 rows: int8 activations serve every row count
    ref = _reference(x, bq)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for m in (1, 3, 8, 9, 70):
        assert torch.equal(ext.a8_linear(x[:m].contiguous(), packed), y[:m]), m
    assert torch.equal(torch.cat([ext.a8_linear(x[i : i + 1].contiguous(), packed) for i in range(70)]), y)
    # lossy against float activations, by about the int8 rounding of x
    exact = x.double() @ bq.dequantize().double().T
    assert 0 < float((y.double() - exact).abs().max()) < 0.05 * float(exact.abs().max())


def _int8_tiny_llm(make_tiny_model, **kwargs) -> LLM:
    """A tiny model whose projections are replaced by their Q4_1 blocks (the embedding by Q8_0), packed for int8
    activations -- what ``linear_kernel="packed-int8act"`` does with a GGUF checkpoint."""
    path = make_tiny_model(hidden_size=64, intermediate_size=128)
    llm = LLM(model=str(path), kv_cache_blocks=256, max_num_seqs=16, linear_kernel="torch", **kwargs)
    model = llm.engine.model
    for mod in model.modules():
        if hasattr(mod, "packed") and not hasattr(mod, "get_weight") and not getattr(mod, "looks_up_rows", False):
            bq = _quantize("Q4_1", mod.weight.detach().numpy())
            mod.weight.data.copy_(bq.dequantize())
            mod.block_quantized = bq
    assert kernel_plan.use_kernels(model, int8_activations=True) > 0
    assert set(small_gemm.packed_formats(model)) <= {"q4-int8act", "float32"}
    assert getattr(model, "int8_activations", False)
    return llm


@needs_kernel
def test_speculation_and_prefix_caching_stay_identical_to_plain_decoding_at_int8(make_tiny_model) -> None:
    llm = _int8_tiny_llm(make_tiny_model)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = SPEC_PROMPTS + [" ".join(["seven"] * 50) + " and then"]  # one prompt longer than a 64-row call

    def run(engine: LLM, ps: list[str]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in engine.generate(ps, params, use_tqdm=False)]

    alone = [run(llm, [p])[0] for p in prompts]
    assert [run(llm, [p])[0] for p in prompts] == alone  # second time: the prompts' blocks come from the cache
    assert run(llm, prompts) == alone  # batched
    spec = LLM.from_engine_of(llm, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                       "use_cost_model": False})
    out = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == alone
    assert sum(o.metrics.num_accepted_tokens for o in out) > 0  # drafts were verified, and some accepted


def test_int8_activations_setting_is_checked(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="CPU float32"):
        LLM(model=str(tiny_model_dir), linear_kernel="packed-int8act", dtype="bfloat16")


@pytest.mark.slow
@needs_kernel
def test_bundled_model_at_int8_activations_is_lossless_under_speculation() -> None:
    llm = LLM(linear_kernel="packed-int8act", kv_cache_blocks=512)
    formats = small_gemm.packed_formats(llm.engine.model)
    assert formats.get("q4h-int8act", 0) >= 120 and formats.get("q8-int8act") == 1
    conv = [[{"role": "user", "content": q}] for q in ("Name three colours.", "What is 12 times 7? Explain.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = [o.outputs[0].token_ids for o in llm.chat(conv, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.chat(conv, params, use_tqdm=False)] == plain  # prefix-cache hits
    for method in ("ngram", "medusa"):
        spec = LLM.from_engine_of(llm, speculative_config={"method": method, "use_cost_model": False})
        assert [o.outputs[0].token_ids for o in spec.chat(conv, params, use_tqdm=False)] == plain, method


def test_draft_model_can_be_the_target_at_another_precision(tiny_model_dir) -> None:
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, params, use_tqdm=False)]
    spec = LLM.from_engine_of(llm, speculative_config={"method": "draft_model", "model": "target",
                                                       "draft_linear_kernel": "packed-float32",
                                                       "num_speculative_tokens": 3, "use_cost_model": False})
    out = spec.generate(SPEC_PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == plain
    # the same weights in another kernel format: the drafts are the target's own tokens
    assert sum(o.metrics.num_accepted_tokens for o in out) == sum(o.metrics.num_draft_tokens for o in out) > 0
    with pytest.raises(ValueError, match="draft_linear_kernel"):
        LLM.from_engine_of(llm, speculative_config={"method": "draft_model", "model": "target",
                                                    "draft_linear_kernel": "int4"})


@pytest.mark.slow
@needs_kernel
def test_int8_activation_draft_of_the_bundled_model_is_verified_losslessly(bundled_llm) -> None:
    """Mixed precision by phase: the target drafts itself with int8 activations, float32 verifies."""
    conv = [[{"role": "user", "content": q}] for q in ("Name three colours.", "What is 12 times 7? Explain.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = [o.outputs[0].token_ids for o in bundled_llm.chat(conv, params, use_tqdm=False)]
    spec = LLM.from_engine_of(bundled_llm, speculative_config={
        "method": "draft_model", "model": "target", "draft_linear_kernel": "packed-int8act",
        "num_speculative_tokens": 4, "use_cost_model": False})
    assert small_gemm.packed_formats(spec.engine.speculator.proposer.model).get("q4h-int8act", 0) >= 120
    out = spec.chat(conv, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == plain
    drafted = sum(o.metrics.num_draft_tokens for o in out)
    assert sum(o.metrics.num_accepted_tokens for o in out) >= 0.7 * drafted > 0
