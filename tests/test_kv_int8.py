"""INT8 KV cache: quantization error bounds, the pool layout, attention over it, and the engine end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leapdecode.config import EngineConfig
from leapdecode.engine.kv_cache import KVCache
from leapdecode.kernels import extension
from leapdecode.layers import decoder_stack, split_kv
from leapdecode.layers.attention import SeqAttention, build_attention_metadata, paged_attention
from leapdecode.layers.kv_quant import (
    QuantizedKV,
    dequantize,
    kv_bytes_per_token,
    quantize,
    resolve_kv_dtype,
    rotation_matrix,
)
from leapdecode.models.config import ModelConfig
from tests.conftest import assert_no_leaks

SMOL = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64,
)  # fmt: skip


def test_round_trip_error_bound():
    torch.manual_seed(0)
    x = torch.randn(500, 3, 64) * torch.logspace(-3, 3, 500).view(-1, 1, 1)  # six decades of magnitude
    x[7, 1, 5] = 1e4  # an outlier channel
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (*x.shape[:-1], 4)  # 16 channels each
    y = dequantize(q, s, torch.float32)
    err = (x - y).abs().view(500, 3, 4, 16)
    # symmetric absmax: every element is within half a quantization step of its group's scale
    assert (err <= s.float().unsqueeze(-1) * 0.5 * (1 + 1e-3) + 1e-12).all()
    rel = err.amax(-1) / x.view(500, 3, 4, 16).abs().amax(-1)
    assert rel.max() <= 0.5 / 127 * (1 + 2e-3)  # <= 0.4% of the group's absmax
    # the outlier only coarsens its own group: the row's other 48 channels keep their fine steps
    assert s[7, 1, 0] > 50 * s[7, 1, 1:].float().max()
    assert q.abs().max() <= 127


def test_zero_and_tiny_rows_stay_finite():
    x = torch.zeros(4, 2, 8)
    x[1] = 1e-30
    q, s = quantize(x)
    y = dequantize(q, s, torch.float32)
    assert torch.isfinite(y).all() and y.abs().max() <= 1e-29


@pytest.mark.parametrize("dim", [16, 24])  # Hadamard / random orthogonal
def test_rotation_is_orthogonal(dim):
    r = rotation_matrix(dim)
    torch.testing.assert_close(r @ r.T, torch.eye(dim), atol=1e-5, rtol=0)
    torch.testing.assert_close(rotation_matrix(dim), r)  # deterministic


def test_rotation_spreads_an_outlier_channel():
    """Why the cache rotates: a dominant channel no longer sets the scale for every other channel."""
    torch.manual_seed(0)
    x = torch.randn(256, 1, 64)
    x[..., 3] *= 30
    r = rotation_matrix(64)
    plain = QuantizedKV(torch.zeros(256, 1, 64, dtype=torch.int8), torch.zeros(256, 1, 4, dtype=torch.float16))
    rotated = QuantizedKV(torch.zeros(256, 1, 64, dtype=torch.int8), torch.zeros(256, 1, 4, dtype=torch.float16), r)
    slots = torch.arange(256)
    plain.write(slots, x)
    rotated.write(slots, x)
    err_plain = (plain.read_slots(slots, torch.float32) - x).norm()
    err_rot = (rotated.unrotate(rotated.read_slots(slots, torch.float32)) - x).norm()
    assert err_rot < 0.5 * err_plain


@pytest.mark.parametrize("rotate", [False, True])
def test_plane_write_read(rotate):
    data = torch.zeros(64, 2, 16, dtype=torch.int8)
    scale = torch.zeros(64, 2, 1, dtype=torch.float16)
    plane = QuantizedKV(data, scale, rotation_matrix(16) if rotate else None)
    x = torch.randn(5, 2, 16)
    slots = torch.tensor([3, 9, 10, 11, 40])
    plane.write(slots, x)
    got = plane.read_slots(slots, torch.float32)
    # per element at most half a step in the stored basis; a rotation preserves the L2 norm of the error
    step = scale.index_select(0, slots).float().squeeze(-1)
    err = (plane.unrotate(got) - x).norm(dim=-1)
    assert (err <= (step * 0.5 * 16**0.5) * (1 + 1e-3) + 1e-6).all()
    torch.testing.assert_close(plane.read_range(9, 3, torch.float32), got[1:4])
    plane.copy_slots(torch.tensor([3]), torch.tensor([60]))
    torch.testing.assert_close(plane.read_range(60, 1, torch.float32), got[:1])
    assert plane.read_range(9, 3, torch.bfloat16).dtype == torch.bfloat16


def test_a_plane_keeps_its_rotations_transpose():
    """unrotate maps outputs back with R^T, made once: the cache's planes share one copy, a lone plane makes its own,
    and a transpose without its rotation (or of the wrong size) is refused."""
    i8 = KVCache(SMOL, 4, 16, torch.int8, torch.device("cpu"))
    v0, k1 = i8.layers[0][1], i8.layers[1][0]
    assert torch.equal(v0.rotation_t, i8.rotation.T) and v0.rotation_t is k1.rotation_t
    data, scale = torch.zeros(8, 2, 16, dtype=torch.int8), torch.zeros(8, 2, 1, dtype=torch.float16)
    alone = QuantizedKV(data, scale, rotation_matrix(16))
    assert torch.equal(alone.rotation_t, alone.rotation.T) and alone.rotation_t.is_contiguous()
    with pytest.raises(ValueError, match="give the rotation too"):
        QuantizedKV(data, scale, rotation_t=rotation_matrix(16))
    with pytest.raises(ValueError, match="rotation_t must be"):
        QuantizedKV(data, scale, rotation_matrix(16), rotation_t=rotation_matrix(8))


def test_pool_layout_and_bytes():
    f32 = KVCache(SMOL, 4, 16, torch.float32, torch.device("cpu"))
    i8 = KVCache(SMOL, 4, 16, torch.int8, torch.device("cpu"))
    assert i8.pool.dtype == torch.int8 and i8.scales.shape == (30, 2, 64, 3, 4)
    assert isinstance(i8.layers[0][0], QuantizedKV) and isinstance(f32.layers[0][0], torch.Tensor)
    assert i8.layers[0][0].rotation is i8.layers[29][1].rotation is i8.rotation  # one matrix for the cache
    assert i8.nbytes == 4 * KVCache.bytes_per_block(SMOL, 16, torch.int8)
    per_token = i8.nbytes / 64
    assert per_token == kv_bytes_per_token(30, 3, 64, torch.int8) == 30 * 3 * 2 * (64 + 4 * 2)  # what `plan` prints
    assert f32.nbytes / i8.nbytes >= 3.5  # 3.56x
    # scales move with the values
    i8.layers[2][1].write(torch.tensor([5]), torch.randn(1, 3, 64))
    i8.copy_slots(torch.tensor([5]), torch.tensor([33]))
    torch.testing.assert_close(
        i8.layers[2][1].read_range(33, 1, torch.float32), i8.layers[2][1].read_range(5, 1, torch.float32)
    )


def test_config_validation():
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("int8", torch.float32) == torch.int8


@pytest.mark.parametrize("transform", ["none", "rotate", "calibrated"])
@pytest.mark.parametrize(("split", "kernel"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("layout", ["contiguous", "fragmented", "batch"])
def test_paged_attention_over_int8_equals_attention_over_dequantized(monkeypatch, split, kernel, layout, transform):
    """Attention reads exactly the dequantized cache: compare with plain SDPA over dequantized K/V mapped back to
    the model's basis (un-rotated; keys also un-smoothed and un-shifted, since a calibrated cache stores
    ((k - mu) / s) R and relies on softmax ignoring the per-query constant q.mu)."""
    big = 1 << 60
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_CONTEXT", 0 if split else big)
    monkeypatch.setattr(split_kv, "SPLIT_KV_MIN_BATCH_TOKENS", 0 if split else big)
    monkeypatch.setattr(split_kv, "SPLIT_KV_CHUNK", 32)
    monkeypatch.setattr(split_kv, "SPLIT_KV_BATCH_CHUNK", 32)
    torch.manual_seed(1)
    tables = {"contiguous": [list(range(12))], "fragmented": [list(range(0, 24, 2))],
              "batch": [list(range(0, 24, 2)), list(range(1, 24, 2))]}[layout]  # fmt: skip
    ctxs = [150, 97][: len(tables)]
    slots = 24 * 16
    rot = rotation_matrix(64) if transform != "none" else None
    shift = smooth = None
    if transform == "calibrated":
        shift, smooth = torch.randn(3, 64) * 2, torch.rand(3, 64) + 0.5
    def plane(*transform: torch.Tensor | None) -> QuantizedKV:
        return QuantizedKV(torch.zeros(slots, 3, 64, dtype=torch.int8), torch.zeros(slots, 3, 4, dtype=torch.float16),
                           *transform)  # fmt: skip

    k_plane, v_plane = plane(rot, shift, smooth), plane(rot)
    seqs = [SeqAttention(i, 1, c, t, 16) for i, (t, c) in enumerate(zip(tables, ctxs, strict=True))]
    for s in seqs:  # the context so far, quantized on write
        past = s.slots()[:-1]
        k_plane.write(past, torch.randn(len(past), 3, 64) * 3)
        v_plane.write(past, torch.randn(len(past), 3, 64))
    n = len(seqs)
    q, k, v = torch.randn(n, 9, 64), torch.randn(n, 3, 64), torch.randn(n, 3, 64)
    slot_mapping = torch.cat([s.slots()[-1:] for s in seqs])
    meta = build_attention_metadata(seqs, slot_mapping, 3, torch.device("cpu"))
    assert (meta.groups[0].split is not None) == split
    if kernel and extension.load_kernel() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    got = paged_attention(q, k, v, k_plane, v_plane, meta, 0.125, use_kernel=kernel)  # kernel: int8 rows in C++
    for i, s in enumerate(seqs):
        kk = k_plane.unrotate(k_plane.read_slots(s.slots(), torch.float32))
        if shift is not None:
            kk = kk * smooth + shift
        vv = v_plane.unrotate(v_plane.read_slots(s.slots(), torch.float32))
        kk, vv = (t.transpose(0, 1).repeat_interleave(3, 0) for t in (kk, vv))  # [9, ctx, 64]
        want = F.scaled_dot_product_attention(q[i].unsqueeze(1), kk, vv, scale=0.125).squeeze(1)
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["batch", "tree"])
def test_half_precision_cache_rows_are_the_float32_kernels_bits(dtype, layout):
    """A float16 or bfloat16 cache's few-token rows are the float32 rows kernel's over the same cache widened to
    float32, bit for bit (the new rows stored rounded first): so they do not depend on the batch or the tree."""
    if extension.load_kernel() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    torch.manual_seed(2)
    slots = 24 * 16
    if layout == "batch":
        seqs = [SeqAttention(0, 1, 150, list(range(0, 24, 2)), 16), SeqAttention(1, 1, 97, list(range(1, 24, 2)), 16)]
    else:  # one sequence verifying a tree of 3 nodes: the root, then two children of it
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        seqs = [SeqAttention(0, 3, 150, list(range(0, 24, 2)), 16, tree_mask=mask,
                             positions=torch.tensor([147, 148, 148]))]
    half_k, half_v = (torch.randn(slots, 3, 64).to(dtype) for _ in range(2))
    float_k, float_v = half_k.float(), half_v.float()
    n = sum(s.q_len for s in seqs)
    q, k, v = torch.randn(n, 9, 64), torch.randn(n, 3, 64), torch.randn(n, 3, 64)
    slot_mapping = torch.cat([s.slots()[-s.q_len:] for s in seqs])
    got = paged_attention(q, k, v, half_k, half_v, build_attention_metadata(seqs, slot_mapping, 3, torch.device("cpu")),
                          0.125, use_kernel=True)
    want = paged_attention(q, k.to(dtype).float(), v.to(dtype).float(), float_k, float_v,
                           build_attention_metadata(seqs, slot_mapping, 3, torch.device("cpu")), 0.125, use_kernel=True)
    assert torch.equal(got, want)
    assert torch.equal(half_k.float(), float_k) and torch.equal(half_v.float(), float_v)  # the same rows written


def _greedy(llm, prompts, max_tokens=32):
    from leapdecode import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = [
    "The history of the city begins with a small settlement on the river",
    "Once upon a time, in a land far away, there lived",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Water boils at a temperature of",
    "The three primary colors are",
    "In 1969, the first humans landed on",
]


def test_engine_int8_mostly_matches_float(tiny_model_dir):
    from leapdecode import LLM

    ref = LLM(model=str(tiny_model_dir), kv_cache_blocks=128, max_num_seqs=8)
    q8 = LLM(model=str(tiny_model_dir), kv_cache_blocks=128, max_num_seqs=8, kv_cache_dtype="int8")
    assert q8.engine.kv_cache.pool.dtype == torch.int8
    want, got = _greedy(ref, PROMPTS), _greedy(q8, PROMPTS)
    same = [next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), len(w)) / len(w)
            for w, g in zip(want, got, strict=True)]  # fmt: skip
    # the tiny random model has near-tied logits, so a late divergence is tolerated; most tokens must agree
    assert sum(same) / len(same) >= 0.75, same
    assert sum(s == 1.0 for s in same) >= len(same) // 2, same
    # block accounting is unaffected by the storage dtype: everything returns to the free pool
    _greedy(q8, PROMPTS[:2] * 3, max_tokens=8)  # shared prefixes hit the prefix cache
    assert_no_leaks(q8)
    assert_no_leaks(ref)


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_engine_half_precision_kv_with_float32_model(tiny_model_dir, kv):
    """A float16 or bfloat16 cache under a float32 model: stored rounded, read back as float32 rows by the same
    rows kernel, so a request's tokens are the same alone (the one-token decode step), batched and verified
    under speculation, and those of the float32 cache but for rounding."""
    from leapdecode import LLM, SamplingParams

    ref = LLM(model=str(tiny_model_dir), kv_cache_blocks=64)
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, kv_cache_dtype=kv)
    spec = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, kv_cache_dtype=kv,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    assert llm.engine.kv_cache.pool.dtype == getattr(torch, kv)
    prompts = [*PROMPTS[:3], "one two three four five six one two three four five six one two three"]
    alone = [_greedy(llm, [p], max_tokens=16)[0] for p in prompts]
    assert _greedy(llm, prompts, max_tokens=16) == alone
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = [spec.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    want = [_greedy(ref, [p], max_tokens=16)[0] for p in prompts]
    same = [sum(a == b for a, b in zip(got, w)) / 16 for got, w in zip(alone, want)]
    assert sum(same) / len(same) >= 0.75, same
    assert_no_leaks(llm)
    assert_no_leaks(spec)


def test_perplexity_through_engine(tiny_model_dir):
    """The eval helper runs through the engine's runner and cache, returns its blocks, and int8 stays close."""
    from leapdecode import LLM
    from leapdecode.eval.perplexity import perplexity

    ref = LLM(model=str(tiny_model_dir), kv_cache_blocks=32)
    q8 = LLM(model=str(tiny_model_dir), kv_cache_blocks=32, kv_cache_dtype="int8")
    tokens = ref.get_tokenizer().encode(" ".join(PROMPTS) * 4, add_special_tokens=False)[:300]
    a = perplexity(ref.engine, tokens, window=128)
    b = perplexity(q8.engine, tokens, window=128)
    assert len(tokens) > 256 and a.num_windows == 3 and a.num_predicted == 127 + 127 + (len(tokens) - 256 - 1)
    assert abs(b.nll - a.nll) / a.nll < 0.02
    # decode-style (one token per forward) scores the same tokens as one prefill per window
    c = perplexity(ref.engine, tokens[:64], window=64, step=1)
    d = perplexity(ref.engine, tokens[:64], window=64)
    assert c.num_predicted == d.num_predicted == 63
    assert abs(c.nll - d.nll) < 1e-3
    assert_no_leaks(ref)
    assert_no_leaks(q8)


def test_engine_int8_with_speculative_decoding(tiny_model_dir):
    """Drafts are written into the int8 cache and rolled back on rejection: per-token scales make that free."""
    from leapdecode import LLM

    llm = LLM(
        model=str(tiny_model_dir),
        kv_cache_blocks=128,
        kv_cache_dtype="int8",
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    prompts = ["one two three one two three one two three one two", *PROMPTS[:2]]
    outs = _greedy(llm, prompts, max_tokens=24)
    assert all(len(o) == 24 for o in outs)
    assert_no_leaks(llm)


def test_key_calibration_fits_shift_and_smoothing_and_shrinks_the_error():
    """Keys with a large shared per-channel offset and uneven channel spreads: after observing them, the cache
    stores (k - mu) / s, its mu is their mean, its s has mean 1 and follows the spread, and the attention scores
    a query sees (up to the per-query constant q.mu, which softmax ignores) are closer to exact."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=64)  # fmt: skip
    offset = torch.randn(1, 64) * 20
    spread = torch.logspace(-1, 1, 64)
    keys = offset + torch.randn(400, 1, 64) * spread
    q = torch.randn(5, 2, 64)

    def score_error(cache: KVCache) -> float:
        k_plane = cache.layers[0][0]
        slots = torch.arange(200, 400)
        k_plane.write(slots, keys[200:])
        got = k_plane.query_to_cache_basis(q).float() @ k_plane.read_slots(slots, torch.float32)[:, 0].T.unsqueeze(0)
        want = q @ keys[200:, 0].T.unsqueeze(0)  # [5, 2, 200]
        got, want = got - got.mean(-1, keepdim=True), want - want.mean(-1, keepdim=True)  # drop q.mu
        return (got - want).norm().item() / want.norm().item()

    plain = KVCache(cfg, 32, 16, torch.int8, torch.device("cpu"))
    cal = KVCache(cfg, 32, 16, torch.int8, torch.device("cpu"))
    cal.observe_keys(True)
    cal.layers[0][0].write(torch.arange(200), keys[:200])  # what a calibration pass stores (then frees)
    assert cal.calibrate_keys() == 200
    assert cal.layers[0][0].observed is None  # observing stops
    torch.testing.assert_close(cal.key_shift[0], keys[:200].mean(0), atol=1e-4, rtol=1e-4)
    s = cal.key_smooth[0, 0]
    assert abs(s.mean().item() - 1) < 1e-5 and s[-8:].mean() > 5 * s[:8].mean()  # sqrt of a 100x spread range
    torch.testing.assert_close(plain.key_shift, torch.zeros_like(plain.key_shift))  # identity until calibrated
    assert score_error(cal) < 0.5 * score_error(plain)
    with pytest.raises(ValueError, match="int8"):
        KVCache(cfg, 4, 16, torch.float32, torch.device("cpu")).calibrate_keys()


def test_engine_calibrates_at_start_up_and_returns_its_blocks(tiny_model_dir):
    from leapdecode import LLM

    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, kv_cache_dtype="int8")
    kv = llm.engine.kv_cache
    assert kv.calibrated_tokens > 100 and kv.key_smooth.std() > 0 and kv.key_shift.abs().sum() > 0
    assert_no_leaks(llm)
    off = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, kv_cache_dtype="int8", kv_calibration=False)
    assert off.engine.kv_cache.calibrated_tokens == 0 and bool((off.engine.kv_cache.key_smooth == 1).all())
    with pytest.raises(ValueError, match="kv_calibration"):
        EngineConfig(kv_calibration="yes")


@pytest.mark.skipif(extension.load_kernel() is None, reason="no C++ toolchain to build the kernel")
@pytest.mark.parametrize("kv_dtype", ["int8", "auto", "bfloat16", "float16"])
def test_fused_layers_equal_the_per_op_path_bitwise(tiny_model_dir, monkeypatch, kv_dtype: str):
    """Decode and verification steps run all decoder layers in one C++ call (decoder_stack of decoder_layer over a
    float32, bfloat16 or float16 cache, or of decoder_layer_i8 over an int8 cache); it must give the bits of one
    C++ call per layer and of the per-op path (for int8: query into the cache basis, quantizing write, int8 rows
    kernel, output rotation), or a token's result would depend on which path its step took."""
    from leapdecode import LLM
    from leapdecode.engine.model_runner import ForwardItem
    from leapdecode.models.llama import DecoderLayer, LlamaForCausalLM

    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, kv_cache_dtype=kv_dtype)
    eng = llm.engine
    if kv_dtype == "int8":
        assert eng.kv_cache.layers[0][0].shift is not None  # calibrated: the full transform is exercised
    layers = [m for m in eng.model.modules() if isinstance(m, DecoderLayer)]
    calls = {"stack": 0, "layer": 0}
    layer_fn = "decoder_layer_i8" if kv_dtype == "int8" else "decoder_layer"
    real_stack, real_layer = decoder_stack.decoder_stack, getattr(decoder_stack, layer_fn)

    def count(kind, real):
        def counted(*args):
            calls[kind] += 1
            return real(*args)

        return counted

    monkeypatch.setattr(decoder_stack, "decoder_stack", count("stack", real_stack))
    monkeypatch.setattr(decoder_stack, layer_fn, count("layer", real_layer))
    prompt = list(range(300, 330))
    steps = [[5], [6], [7, 8, 9, 10], [11]]  # decode, decode, a 4-token verification, decode

    def run(fused: bool) -> list[torch.Tensor]:
        for m in layers:
            m.use_kernel = fused
        table = list(range(8))
        out = [eng.runner.execute([ForwardItem(table, 0, prompt, [len(prompt) - 1])])[0].logits]
        pos = len(prompt)
        for toks in steps:
            out.append(eng.runner.execute([ForwardItem(table, pos, toks, list(range(len(toks))))])[0].logits)
            pos += len(toks)
        return out

    try:
        fused = run(True)
        assert calls == {"stack": len(steps), "layer": 0}  # every decode/verify step: all layers in one call
        with monkeypatch.context() as m:
            m.setattr(LlamaForCausalLM, "_layer_stack", lambda *a: None)
            per_layer = run(True)
        assert calls == {"stack": len(steps), "layer": len(steps) * len(layers)}
        per_op = run(False)
    finally:
        for m in layers:
            m.use_kernel = True
    for a, b, c in zip(fused, per_layer, per_op, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
