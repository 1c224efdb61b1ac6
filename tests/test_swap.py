"""Tiered KV cache: preempted sequences swap to the host pool and resume with identical output, no recompute."""

from __future__ import annotations

import pytest

from leapdecode import LLM, SamplingParams

from .conftest import assert_no_leaks

PROMPTS = [f"Request {i}: tell me about the number {i * 7} and why it matters." for i in range(6)]


def _run(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("disk", [False, True])
def test_swap_out_and_in_keeps_output_identical(tiny_model_dir, tmp_path, kv_dtype, disk):
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)] * 3
    ref = LLM(model=str(tiny_model_dir), kv_cache_blocks=256, block_size=4, kv_cache_dtype=kv_dtype)
    want = _run(ref, params)
    tight = LLM(model=str(tiny_model_dir), kv_cache_blocks=16, block_size=4, kv_cache_dtype=kv_dtype,
                swap_space_gb=0.01, swap_path=str(tmp_path / "swap.bin") if disk else None)
    got = _run(tight, params)
    assert got == want
    swap = tight.engine.swap
    assert swap.num_swapped_out > 0 and swap.num_swapped_in == swap.num_swapped_out
    assert swap.num_free_blocks == swap.num_blocks  # host blocks all returned
    assert_no_leaks(tight)


def test_swapped_sequence_is_not_recomputed(tiny_model_dir):
    """With swap, prompt tokens go through the model once; without it, preemption recomputes them."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    counts = {}
    for swap_gb in (0.0, 0.01):
        llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=16, block_size=4, swap_space_gb=swap_gb,
                  enable_prefix_caching=False)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        counts[swap_gb] = llm.engine.runner.num_forward_tokens
    expected = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    assert counts[0.01] == expected  # every position computed exactly once
    assert counts[0.0] > expected


def test_swap_space_validation(tiny_model_dir):
    with pytest.raises(ValueError, match="swap_space_gb"):
        LLM(model=str(tiny_model_dir), swap_space_gb=-1)


# ------------------------------------------------------------------------------------------- the layer tier
def test_layer_tier_keeps_output_identical_and_the_first_layers_in_host_memory(tiny_model_dir, tmp_path):
    """kv_device_layers=1 of 2: layer 0's KV lives in the host pool (fetched per step), layer 1's on the device;
    greedy and seeded sampling, batched, with a speculative method, with preemption + swap: same tokens as the
    all-device cache."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)] * 3  # fmt: skip
    ref = LLM(model=str(tiny_model_dir), kv_cache_blocks=256, block_size=4)
    want = _run(ref, params)
    tier = LLM(model=str(tiny_model_dir), kv_cache_blocks=256, block_size=4, kv_device_layers=1)
    kv = tier.engine.kv_cache
    assert kv.pool.shape[0] == 1 and kv.host_pool is not None and kv.host_pool.shape[0] == 1
    assert kv.device_nbytes * 2 == kv.nbytes == ref.engine.kv_cache.nbytes
    assert _run(tier, params) == want
    assert kv.host_pool.abs().sum() > 0  # layer 0 really wrote to (and read from) the host tier
    assert_no_leaks(tier)
    tight = LLM(model=str(tiny_model_dir), kv_cache_blocks=16, block_size=4, kv_device_layers=1,
                swap_space_gb=0.01, swap_path=str(tmp_path / "swap.bin"))  # fmt: skip
    assert _run(tight, params) == want
    assert tight.engine.swap.num_swapped_out > 0 and len(tight.engine.swap.mirrors) == 2
    assert_no_leaks(tight)
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=256, block_size=4, kv_device_layers=1,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    assert _run(spec, params[:1] * 6) == _run(ref, params[:1] * 6)
    assert_no_leaks(spec)


def test_layer_tier_copy_slots_moves_every_tier():
    import torch

    from leapdecode.engine.kv_cache import KVCache
    from leapdecode.layers.kv_quant import read_kv_slots, write_kv
    from leapdecode.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16)  # fmt: skip
    kv = KVCache(cfg, 4, 4, torch.float32, torch.device("cpu"), device_layers=1)
    assert [type(k).__name__ for k, _ in kv.layers] == ["HostLayerKV", "HostLayerKV", "Tensor"]
    planes = [p for layer in kv.layers for p in layer]
    for p in planes:
        write_kv(p, torch.tensor([1, 2]), torch.randn(2, 1, 16))
    kv.copy_slots(torch.tensor([1, 2]), torch.tensor([9, 14]))
    for p in planes:
        rows = read_kv_slots(p, torch.tensor([1, 2, 9, 14]), torch.float32)
        assert rows.abs().sum() > 0
        torch.testing.assert_close(rows[:2], rows[2:])


def test_layer_tier_validation(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_device_layers"):
        LLM(model=str(tiny_model_dir), kv_device_layers=0)
    with pytest.raises(ValueError, match="kv_device_layers"):
        LLM(model=str(tiny_model_dir), kv_device_layers=3)  # the tiny model has 2 layers
    with pytest.raises(ValueError, match="int8"):
        LLM(model=str(tiny_model_dir), kv_device_layers=1, kv_cache_dtype="int8")
