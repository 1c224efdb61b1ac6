"""The packed few-row linear kernel (layers/small_gemm.py): same numbers as torch, row results independent of
the number of rows, GGUF block formats bit-identical to float32, and the engine's choice between it and torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leapdecode import LLM, SamplingParams
from leapdecode.kernels import extension
from leapdecode.layers import int8_gemm, small_gemm
from leapdecode.layers.block_formats import RECORD_BYTES, QuantizedWeight
from leapdecode.layers.linear import ColumnParallelLinear, ParallelLMHead, VocabParallelEmbedding
from leapdecode.models import kernel_plan

ext = extension.load_kernel()
needs_kernel = pytest.mark.skipif(ext is None, reason="no C++ toolchain to build the kernel")


@needs_kernel
@pytest.mark.parametrize("n,k", [(48, 64), (960, 576), (16, 2)])
def test_kernel_matches_torch_linear_for_every_row_count(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    packed = small_gemm.pack(w)
    assert packed.shape == (n // 16, k, 16)
    for m in (1, 2, 3, 7, 8, 9, 16, 17, 33, 64):
        x = torch.randn(m, k, generator=g)
        # float32 sums of k products in another order: agree to ~1e-6 of their sqrt(k) scale
        torch.testing.assert_close(ext.small_linear(x, packed), F.linear(x, w), rtol=1e-5, atol=5e-6 * k**0.5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 576, generator=g), torch.randn(64, 576, generator=g)
    packed = small_gemm.pack(w)
    alone = torch.cat([ext.small_linear(x[i : i + 1].contiguous(), packed) for i in range(64)])
    for m in (2, 5, 8, 13, 40, 64):
        assert torch.equal(ext.small_linear(x[:m].contiguous(), packed), alone[:m])


@needs_kernel
def test_panels_shared_between_any_number_of_threads_give_the_same_bits() -> None:
    """The projections split their 16-output panels between threads, and a thread done early takes panels from
    the back of the others' shares: every panel must be computed, once, and equal whichever thread did it."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16 * 61, 256, generator=g)  # 61 panels: no even split
    floats = small_gemm.pack(w)
    ints = _gguf_blocks("Q4_1", 16 * 61, 256, seed=3)[0].to_block_quantized().pack_int8_activations()
    x = torch.randn(16, 256, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {m: (ext.small_linear(x[:m], floats), ext.a8_linear(x[:m], ints)) for m in (1, 5, 16)}
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            for m, (f, i) in alone.items():
                for _ in range(20):  # the owners and the thieves race differently each call
                    assert torch.equal(ext.small_linear(x[:m], floats), f), (threads, m)
                    assert torch.equal(ext.a8_linear(x[:m], ints), i), (threads, m)
    finally:
        torch.set_num_threads(before)


def _gguf_blocks(fmt: str, n: int, k: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random [n, k] weight quantized by gguf-py to ``fmt``: its kernel records and gguf's dequantisation."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    raw = gguf.quants.quantize(w, qtype)
    ref = torch.from_numpy(np.asarray(gguf.dequantize(raw, qtype), dtype=np.float32).reshape(n, k).copy())
    return QuantizedWeight.from_gguf([(fmt, raw, (n, k))]), ref


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_rebuild_the_dequantised_weights_exactly(fmt: str) -> None:
    qw, ref = _gguf_blocks(fmt, 48, 96, seed=1)
    assert qw.kind == ("q8" if fmt == "Q8_0" else "q4h")
    assert torch.equal(qw.dequantize(), ref)
    perm = torch.randperm(48)
    assert torch.equal(qw.select_rows(perm).dequantize(), ref[perm])  # e.g. a drafter's vocabulary subset
    assert torch.equal(qw.to_block_quantized().dequantize(), ref)


@needs_kernel
def test_q8_quantizer_writes_ggufs_own_blocks() -> None:
    """Drafters quantize their float weights to Q8_0 (use_int8_drafting): the blocks are byte for byte those
    of gguf's reference quantizer, zero blocks included."""
    from gguf import GGMLQuantizationType, quants

    for seed in range(3):
        torch.manual_seed(seed)
        w = torch.randn(48, 96) * (seed + 1)
        w[0, :32] = 0
        raw = quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
        ref = QuantizedWeight.from_gguf([("Q8_0", raw, (48, 96))]).to_block_quantized()
        mine = int8_gemm.BlockQuantized.quantize_q8(w)
        assert torch.equal(mine.q, ref.q) and torch.equal(mine.scale, ref.scale)


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_kernels_equal_the_float32_kernel_bit_for_bit(fmt: str) -> None:
    qw, ref = _gguf_blocks(fmt, 96, 576, seed=2)
    blocks, panels = qw.records, small_gemm.pack(ref)
    assert blocks.dtype == torch.uint8 and blocks.shape == (96 // 16, 576 // 32, RECORD_BYTES[qw.kind])
    g = torch.Generator().manual_seed(3)
    for m in (1, 2, 3, 8, 9, 16, 17, 64):
        x = torch.randn(m, 576, generator=g)
        assert torch.equal(small_gemm.linear(x, ref, None, blocks), ext.small_linear(x, panels)), m
    torch.testing.assert_close(small_gemm.linear(x, ref, None, blocks), F.linear(x, ref), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_layer_kept_in_blocks_has_no_float_weight_and_serves_every_row_count() -> None:
    qw, ref = _gguf_blocks("Q4_1", 32, 64, seed=4)
    kept = ColumnParallelLinear(64, [32])
    kept.set_quantized(qw)
    assert kept.weight is None and not list(kept.parameters())  # no float copy
    assert kernel_plan.use_kernels(kept) == 1 and small_gemm.packed_formats(kept) == {"q4h": 1}
    assert kept.packed is qw.records  # the records themselves, not a copy
    opted_out = ColumnParallelLinear(64, [32])
    opted_out.set_quantized(qw)
    kernel_plan.use_kernels(opted_out, use_blocks=False)
    assert small_gemm.packed_formats(opted_out) == {"float32": 1}
    x = torch.randn(3, 64)
    assert torch.equal(kept(x), opted_out(x))
    big = torch.randn(small_gemm.MAX_ROWS * 2 + 5, 64)  # beyond the kernel's limit: 64 rows at a time
    rows = torch.cat([kept(big[i: i + 1]) for i in range(big.shape[0])])
    assert torch.equal(kept(big), rows)  # every row as it is decoded alone
    torch.testing.assert_close(kept(big), F.linear(big, ref), rtol=1e-5, atol=1e-5)
    float_layer = ColumnParallelLinear(64, [32])
    float_layer.weight.data.copy_(ref)
    kernel_plan.use_kernels(float_layer)
    assert torch.equal(float_layer(big), F.linear(big, ref))  # float weights: torch's GEMM for many rows


@needs_kernel
def test_a_tied_lm_head_keeps_its_blocks_for_drafter_read_outs() -> None:
    qw, ref = _gguf_blocks("Q8_0", 64, 96, seed=5)
    embed = VocabParallelEmbedding(64, 96)
    embed.set_quantized(qw)
    head = ParallelLMHead(64, 96, tied_to=embed)
    kernel_plan.use_kernels(head)
    assert small_gemm.packed_formats(head) == {"q8": 1} and embed.quant is qw
    ids = torch.tensor([[3, 60], [7, 0]])
    assert torch.equal(embed(ids), ref[ids])  # the lookup rebuilds just those rows
    rows = torch.tensor([3, 60, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    sub = ref.index_select(0, rows)
    packed = small_gemm.pack_rows(head, rows, sub)
    assert packed.dtype == torch.uint8  # Q8 records: a quarter of the float32 bytes
    x = torch.randn(5, 96)
    assert torch.equal(small_gemm.linear(x, sub, None, packed), ext.small_linear(x, small_gemm.pack(sub)))
    assert small_gemm.pack_rows(head, rows[:5], sub[:5]) is None  # 5 rows: the kernel takes multiples of 16


@needs_kernel
def test_dispatch_uses_torch_for_large_calls_autograd_and_unpacked_layers() -> None:
    w, b = torch.randn(32, 8), torch.randn(32)
    packed = small_gemm.pack(w)
    x = torch.randn(3, 8)
    torch.testing.assert_close(small_gemm.linear(x, w, b, packed), F.linear(x, w, b))
    big = torch.randn(small_gemm.MAX_ROWS + 1, 8)
    assert torch.equal(small_gemm.linear(big, w, None, packed), F.linear(big, w))
    xg = x.clone().requires_grad_()
    y = small_gemm.linear(xg, w, None, packed)
    y.sum().backward()  # the kernel has no backward: training goes through torch
    torch.testing.assert_close(xg.grad, w.sum(0).expand(3, 8))
    assert torch.equal(small_gemm.linear(x, w, None, None), F.linear(x, w))
    with pytest.raises(RuntimeError, match="1..64 rows"):
        ext.small_linear(big.repeat(2, 1)[:65].contiguous(), packed)


@needs_kernel
def test_engine_packs_by_default_and_matches_torch_kernel(tiny_model_dir) -> None:
    prompts = ["the cat sat on", "one two three four five", "red green"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    packed = LLM(model=str(tiny_model_dir), kv_cache_blocks=64)
    plain = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, linear_kernel="torch")
    assert packed.engine.num_packed_linears > 0 and plain.engine.num_packed_linears == 0
    a = [o.outputs[0].token_ids for o in packed.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert a == b
    # speculative verification through the kernel stays token-identical to plain decoding
    spec = LLM.from_engine_of(packed, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                          "use_cost_model": False})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == a


def test_linear_kernel_setting_is_checked(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="linear_kernel"):
        LLM(model=str(tiny_model_dir), linear_kernel="fast")
    with pytest.raises(ValueError, match="CPU float32"):
        LLM(model=str(tiny_model_dir), linear_kernel="packed", dtype="bfloat16")
