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
