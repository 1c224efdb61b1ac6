"""Tensor parallelism with real 2-rank gloo groups on the CPU (engine/executor.py, engine/worker.py, parallel.py).

Each engine here starts one worker process (rank 1) and joins it in a gloo group; the engines are shared by the
tests of this module and shut down at its end. Greedy tokens must equal one rank's: the row-parallel layers sum
their two halves in another order than one rank does, which moves logits by float rounding only, and on these
prompts no near-tie is close enough to flip (a flip would show as a different token here, and would be that cause).
Speculative decoding under 2 ranks must give exactly the tokens of plain decoding under 2 ranks (same numerics).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from leapdecode import LLM, SamplingParams, StructuredOutputsParams
from leapdecode.engine.executor import WorkerDiedError
from leapdecode.parallel import group_size
from tests.conftest import SPEC_PROMPTS

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # > 64 tokens: the prefill path through torch's GEMM


def tokens(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def tp_tiny(tiny_model_dir):
    # built in a thread that ends at once: the workers must outlive it (Linux's parent-death signal follows the
    # thread that started them, so they would be killed with it), which every test using this engine checks
    with ThreadPoolExecutor(1) as pool:
        llm = pool.submit(LLM, model=str(tiny_model_dir), kv_cache_blocks=128, tensor_parallel_size=2).result()
    yield llm
    llm.shutdown()


def test_tiny_greedy_matches_one_rank(tp_tiny, tiny_llm):
    prompts = [*SPEC_PROMPTS, LONG_PROMPT]
    assert tokens(tp_tiny, prompts) == tokens(tiny_llm, prompts)
    assert group_size() == 2  # rank 0 is this process
    w = tp_tiny.engine.model.layers[0].self_attn
    assert (w.num_heads, w.num_kv_heads) == (2, 1)  # 4 heads / 2 KV heads split over the ranks


def test_tiny_ngram_lossless_and_requests_follow(tp_tiny, tiny_model_dir, tiny_llm):
    with pytest.raises(ValueError, match="already runs a tensor-parallel engine"):
        LLM(model=str(tiny_model_dir), kv_cache_blocks=16, tensor_parallel_size=2)
    # a request rank 0 refuses (its grammar does not compile) never reaches the worker, which would fail on it
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="does not compile"):
        tp_tiny.engine.add_request([5, 6, 7], bad)
    # the worker builds its matcher from rank 0's serialised grammar (it never compiles before a step), and rank
    # 0's logits are one vocabulary wide at the grammar's mask (a packed head packs its rank's rows only)
    choice = SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=StructuredOutputsParams(
        regex="(yes|no)-[0-9]"))
    assert tokens(tp_tiny, SPEC_PROMPTS[:2], choice) == tokens(tiny_llm, SPEC_PROMPTS[:2], choice)
    # a sampled row draws from one vocabulary (twice as wide, half its draws would be ids past the vocabulary)
    drawn = tokens(tp_tiny, SPEC_PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, seed=3))
    assert all(0 <= t < tp_tiny.engine.model_config.vocab_size for row in drawn for t in row)
    plain = tokens(tp_tiny, SPEC_PROMPTS)
    tp_tiny.engine.set_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "use_cost_model": False})
    try:
        before = tp_tiny.engine.stats.num_draft_tokens
        assert tokens(tp_tiny, SPEC_PROMPTS) == plain
        assert tp_tiny.engine.stats.num_draft_tokens > before
        # a request aborted on rank 0 is aborted on the worker too: the next step still agrees (digest check)
        rid = tp_tiny.engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0))
        tp_tiny.engine.step()
        tp_tiny.engine.abort_request(rid)
        assert tokens(tp_tiny, SPEC_PROMPTS[:1]) == plain[:1]
        # sampled drafts (rejection sampling): every rank must draw alike, or the per-step checksum stops the worker
        sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3)
        assert len(tokens(tp_tiny, SPEC_PROMPTS, sampled)[0]) == 24
        assert tokens(tp_tiny, SPEC_PROMPTS[:1], GREEDY) == plain[:1]  # and the group still runs
    finally:
        tp_tiny.engine.set_speculative_config(None)


def test_killed_worker_is_an_error_within_seconds(tp_tiny):
    """Last user of ``tp_tiny``: kill rank 1 in the middle of a request."""
    engine = tp_tiny.engine
    worker = engine.executor.procs[0]
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=400, temperature=0.0))
    engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(WorkerDiedError, match=r"rank 1 .*SIGKILL"):
        for _ in range(10_000):
            engine.step()
    assert time.perf_counter() - t0 < 10
    with pytest.raises(WorkerDiedError):  # the engine stays stopped
        engine.step()
    tp_tiny.shutdown()
    assert not alive(worker.pid) and group_size() == 1


@pytest.mark.slow  # a second Python process that loads an engine
def test_workers_die_with_rank0(tiny_model_dir, tmp_path: Path):
    """Rank 0 killed without a shutdown: its workers do not outlive it."""
    script = textwrap.dedent(f"""
        import os, sys
        from leapdecode import LLM, SamplingParams, StructuredOutputsParams
        llm = LLM(model={str(tiny_model_dir)!r}, kv_cache_blocks=32, tensor_parallel_size=2)
        llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        print(llm.engine.executor.procs[0].pid, flush=True)
        os.kill(os.getpid(), 9)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    pid = int(out.stdout.split()[0])
    deadline = time.time() + 10
    while alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


@pytest.fixture(scope="module")
def swap_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("swap")


@pytest.fixture(scope="module")
def tp_bundled(swap_dir):
    # with a host KV tier on disk: each rank swaps its own KV heads, so each needs its own file
    llm = LLM(kv_cache_blocks=256, tensor_parallel_size=2, swap_space_gb=0.01, swap_path=str(swap_dir / "kv.bin"))
    yield llm
    llm.shutdown()


def test_bundled_greedy_matches_one_rank(tp_bundled, bundled_llm, swap_dir):
    """The bundled model: 9 heads / 3 KV heads split 6+3 / 2+1, its Q4_1 blocks split by rows and record runs."""
    assert tokens(tp_bundled, SPEC_PROMPTS) == tokens(bundled_llm, SPEC_PROMPTS)
    attn = tp_bundled.engine.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (6, 2)
    assert attn.qkv_proj.quant is not None and attn.o_proj.quant is not None  # still records, not float
    assert sorted(p.name for p in swap_dir.iterdir()) == ["kv.bin.rank0", "kv.bin.rank1"]


@pytest.fixture(scope="module")
def tp_bundled_plain(tp_bundled) -> list[list[int]]:
    """Plain decoding's tokens of the speculation tests' prompts under 2 ranks, decoded once for all methods."""
    return tokens(tp_bundled, SPEC_PROMPTS[:2])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["self_spec", "draft_model", "eagle", "medusa", "blockwise", "hybrid"])
def test_bundled_speculation_lossless(tp_bundled, tp_bundled_plain, method):
    engine = tp_bundled.engine
    engine.set_speculative_config({"method": method, "use_cost_model": False})
    try:
        before = engine.stats.num_draft_tokens
        assert tokens(tp_bundled, SPEC_PROMPTS[:2]) == tp_bundled_plain
        assert engine.stats.num_draft_tokens > before  # the drafter really drafted
    finally:
        engine.set_speculative_config(None)


def test_plan_divides_weights_and_kv_per_rank():
    from leapdecode.models.config import ModelConfig
    from leapdecode.plan import make_plan
    from tests.test_plan import LLAMA_7B, SMOLLM2_135M

    cfg = ModelConfig.from_hf(LLAMA_7B)  # 32 heads, 32 KV heads: an even split
    one, two = (make_plan(cfg, 4096, memory_bytes=1 << 40, tensor_parallel_size=n) for n in (1, 2))
    assert two.kv_bytes_per_token_per_rank * 2 == one.kv_bytes_per_token == two.kv_bytes_per_token
    norms = 4 * cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)
    assert abs(two.weight_bytes_per_rank - ((one.weight_bytes - norms) / 2 + norms)) <= 1
    smol = ModelConfig.from_hf(SMOLLM2_135M)  # 3 KV heads over 2 ranks: 2 + 1
    p = make_plan(smol, 2048, memory_bytes=1 << 40, tensor_parallel_size=2)
    assert p.kv_heads_per_rank == 2 and p.kv_bytes_per_token_per_rank * 3 == p.kv_bytes_per_token * 2
    with pytest.raises(ValueError, match="3 KV heads cannot be split over 4"):
        make_plan(smol, 2048, memory_bytes=1 << 40, tensor_parallel_size=4)
