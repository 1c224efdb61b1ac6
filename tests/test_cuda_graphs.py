"""CUDA graphs (engine/cuda_graphs.py) and the GPU memory budget (engine/gpu_memory.py).

On a CPU: the bucket choice, the eager fallback decision, and the padded static buffers run without a graph
(``capture=False``, attention through Triton's interpreter) against the eager runner. With CUDA: the captured
graphs against eager execution, token for token, in bfloat16.
"""

from __future__ import annotations

import os

import pytest
import torch

from leapdecode.config import EngineConfig
from leapdecode.engine import cuda_graphs as cg
from leapdecode.engine import gpu_memory
from leapdecode.engine.model_runner import ForwardItem
from leapdecode.layers import triton_attention as ta

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
needs_kernels = pytest.mark.skipif(
    not ta.AVAILABLE or (not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton (the `gpu` extra) and a GPU or Triton's interpreter",
)
SIZES, QLENS = (1, 2, 4, 8), (1, 2, 4)


def item(start: int, tokens: list[int], table: list[int] | None = None, **kw) -> ForwardItem:
    return ForwardItem(table or list(range(8)), start, tokens, list(range(len(tokens))), **kw)


def test_wanted():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cg.wanted(cuda, False, None) == ta.AVAILABLE
    assert not cg.wanted(cpu, False, None)
    assert not cg.wanted(cuda, True, None)  # enforce_eager
    assert not cg.wanted(cuda, False, 4)  # the host layer tier


def test_bucket():
    assert [cg.bucket(n, SIZES) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_eager_reason_and_shape():
    ok = [item(5, [1]), item(9, [1, 2, 3])]
    assert cg.eager_reason(ok, SIZES, QLENS, 64) is None
    assert cg.shape_for(ok, SIZES, QLENS) == cg.StepShape(2, 4)
    assert cg.shape_for([item(5, [1])] * 5, SIZES, QLENS) == cg.StepShape(8, 1)
    assert "tree" in cg.eager_reason([item(5, [1, 2], tree_mask=torch.ones(2, 2, dtype=torch.bool))],
                                     SIZES, QLENS, 64)  # fmt: skip
    assert "tree" in cg.eager_reason([item(5, [1, 2], depths=[0, 1])], SIZES, QLENS, 64)
    assert "query bucket" in cg.eager_reason([item(0, list(range(5)))], SIZES, QLENS, 64)  # a prompt chunk
    assert "batch bucket" in cg.eager_reason([item(5, [1])] * 9, SIZES, QLENS, 64)
    assert "max_model_len" in cg.eager_reason([item(63, [1, 2])], SIZES, QLENS, 64)
    assert cg.eager_reason([], SIZES, QLENS, 64) == "empty step"


def test_gpu_memory_budget():
    gib = 1 << 30
    assert gpu_memory.kv_budget_bytes(100 * gib, 0.9, 10 * gib, 2 * gib) == int(90 * gib) - 12 * gib
    with pytest.raises(ValueError, match="no room"):
        gpu_memory.kv_budget_bytes(10 * gib, 0.5, 5 * gib, 1)
    with pytest.raises(ValueError, match="must be in"):
        gpu_memory.kv_budget_bytes(10 * gib, 1.5, 0, 0)
    assert gpu_memory.blocks_within(10_000, 100, max_num_seqs=2, max_model_len=64, block_size=16) == 8  # capped
    assert gpu_memory.blocks_within(550, 100, max_num_seqs=64, max_model_len=4096, block_size=16) == 5
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")


@pytest.fixture(scope="module")
def eager_llm(tiny_model_dir):
    from leapdecode import LLM

    return LLM(model=str(tiny_model_dir), kv_cache_blocks=32, block_size=4, linear_kernel="torch", max_num_seqs=8,
               max_model_len=64, enforce_eager=True, device=str(DEVICE))  # fmt: skip


def test_graphs_need_cuda_and_a_free_block(eager_llm):
    e = eager_llm.engine
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="CUDA"):
            cg.StepGraphs(e.model, e.kv_cache, 4, e.device, 64, 8, scratch_block=31)
    with pytest.raises(ValueError, match="outside the KV pool"):
        cg.StepGraphs(e.model, e.kv_cache, 4, e.device, 64, 8, scratch_block=32, capture=False)
    graphs = cg.StepGraphs(e.model, e.kv_cache, 4, e.device, 64, 8, scratch_block=31, capture=False,
                           batch_sizes=SIZES, query_lens=QLENS)  # fmt: skip
    with ta.disabled(), pytest.raises(RuntimeError, match="Triton kernels"):  # SDPA would read placeholder slots
        graphs.execute([item(5, [1])])


def test_fill_pads_with_scratch_rows(eager_llm):
    e = eager_llm.engine
    step = cg.StaticStep(cg.StepShape(4, 4), 2, 4, 64, scratch_block=31, device=e.device)
    step.fill([item(5, [7], [3, 1, 2]), item(2, [8, 9, 10], [6, 2])])
    scratch = [31 * 4 + r % 4 for r in range(16)]
    assert step.input_ids.tolist() == [7, 0, 0, 0, 8, 9, 10, 0] + [0] * 8
    assert step.positions[:8].tolist() == [5, 0, 0, 0, 2, 3, 4, 0]
    assert step.meta.slot_mapping.tolist() == [1 * 4 + 1, *scratch[1:4], 24 + 2, 24 + 3, 2 * 4 + 0, *scratch[7:]]
    assert step.rows.q_len.tolist() == [1, 3, 0, 0] and step.rows.ctx_len.tolist() == [6, 5, 0, 0]
    assert step.rows.block_tables[0, :2].tolist() == [3, 1] and step.rows.block_tables[1, :2].tolist() == [6, 2]
    with pytest.raises(ValueError, match="does not fit"):
        step.fill([item(0, [1] * 5)])


@needs_kernels
@pytest.mark.parametrize("capture", [False, True] if HAS_CUDA else [False], ids=lambda c: "graph" if c else "static")
def test_static_buffers_match_eager(eager_llm, capture):
    """A decode batch of 3 (padded to 4) and verification chains of 3 and 1 rows (padded to 4 rows each) through
    the static buffers (and, with CUDA, through captured graphs) give the eager runner's logits and hidden
    states, and write the same K/V."""
    e = eager_llm.engine
    runner, kv = e.runner, e.kv_cache
    graphs = cg.StepGraphs(e.model, kv, 4, e.device, 64, 8, scratch_block=31, capture=capture,
                           batch_sizes=SIZES, query_lens=QLENS)  # fmt: skip
    tables = [[0, 5, 9, 2, 11], [1, 6, 10, 3, 12], [4, 7, 8, 13, 14]]
    with ta.forced():
        for i, t in enumerate(tables):  # prompts, eagerly
            runner.execute([ForwardItem(t, 0, list(range(10 + i, 23 + i)), [12])])
        steps = [
            [ForwardItem(t, 13, [40 + i], [0]) for i, t in enumerate(tables)],
            [ForwardItem(tables[0], 14, [5, 6, 7], [0, 1, 2]), ForwardItem(tables[1], 14, [8], [0])],
        ]
        for items in steps:
            want = runner.execute(items)
            kv_want = kv.pool.clone()
            got = graphs.execute(items)
            assert got is not None and graphs.replays > 0
            assert all(step.graph is not None for step in graphs.steps.values()) == capture
            for w, g in zip(want, got, strict=True):
                torch.testing.assert_close(g.logits, w.logits, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(g.hidden, w.hidden, atol=1e-5, rtol=1e-5)
            real = kv.pool[:, :, : 31 * 4]  # everything but the scratch block
            torch.testing.assert_close(real, kv_want[:, :, : 31 * 4], atol=1e-5, rtol=1e-5)
    assert set(graphs.steps) == {cg.StepShape(4, 1), cg.StepShape(2, 4)}
    assert graphs.execute([ForwardItem(tables[0], 0, list(range(13)), [12])]) is None  # a prompt: eager
    assert graphs.eager_steps == 1


@pytest.mark.skipif(not (HAS_CUDA and ta.AVAILABLE), reason="needs CUDA and triton")
@pytest.mark.parametrize("method", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_cuda_graphs_token_identical_to_eager(tiny_model_dir, method):
    from leapdecode import LLM, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "1 2 3 4 5 6 7 8 1 2 3"]
    eager = LLM(model=str(tiny_model_dir), device="cuda", dtype="bfloat16", enforce_eager=True,
                speculative_config=method)  # fmt: skip
    graphs = LLM.from_engine_of(eager, speculative_config=method, enforce_eager=False)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graphs.engine.graphs is not None and graphs.engine.graphs.replays > 0
