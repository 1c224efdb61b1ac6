"""Blockwise decoding's block heads: the block-causal mask against its definition, the heads applying it, the
decoding form equal to a training block, per-block gradient checkpointing (same loss and gradients, less peak
memory), and the shipped training command using both."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from leapdecode.speculative.block_heads import BlockHeads, block_causal_mask
from leapdecode.train import blockwise as TB
from leapdecode.train.blockwise import stretch_losses


def test_block_causal_mask_is_its_definition():
    for nb, k in [(1, 1), (1, 5), (3, 1), (4, 3), (5, 8)]:
        m = block_causal_mask(nb, k)
        assert m.shape == (nb * k, nb * k) and m.dtype == torch.bool
        for p in range(nb * k):
            for q in range(nb * k):
                assert bool(m[p, q]) == (q // k <= p // k), (nb, k, p, q)
    m = block_causal_mask(3, 4)
    assert m[0, 3] and m[4, 7]  # a position reads ahead within its own block...
    assert not m[3, 4] and not m[0, 11]  # ...never into a later one
    assert m[11, 0] and m[8, :].all()  # and every earlier block
    assert not torch.equal(m, torch.ones(12, 12, dtype=torch.bool).tril())  # not the causal mask
    wrong = torch.ones(12, 12, dtype=torch.bool)  # the sample that zeroes the *earlier* blocks of each block
    for b in range(3):
        wrong[b * 4:(b + 1) * 4, : b * 4] = False
    assert not torch.equal(m, wrong)
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        block_causal_mask(0, 4)


def _heads(d: int = 32, k: int = 4, nb: int = 3, seed: int = 0) -> BlockHeads:
    heads = BlockHeads(d, k, nb, attn_heads=2, head_dim=8)
    heads.init_weights(seed, std=0.3)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # trained-looking weights: every part of the module matters
        for p in (heads.wo, heads.weight, heads.bias):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads


def _reference(heads: BlockHeads, h: torch.Tensor, emb: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """forward_blocks written out with scaled_dot_product_attention under the full [L, L] block-causal mask (the
    query of row p = b * k + j is block b's hidden state plus slot j; keys carry their blocks-back of *row p's*
    block, so each block computes its keys)."""
    k, nb, d = heads.k, heads.num_blocks, heads.hidden_size
    S, L = emb.shape[:2]
    mask = block_causal_mask(nb, k)
    out = torch.empty(S, nb, k, d)
    for b in range(nb):
        back = (b - torch.arange(L) // k).clamp(0, nb - 1)
        x = F.rms_norm(emb, (d,), heads.key_norm) + heads.key_back[back] + heads.key_place[torch.arange(L) % k]
        kk = F.linear(x, heads.wk).view(S, L, heads.attn_heads, -1).transpose(1, 2)
        vv = F.linear(x, heads.wv).view(S, L, heads.attn_heads, -1).transpose(1, 2)
        rows = torch.arange(b * k, (b + 1) * k)
        q = F.linear(h[:, b, None] + heads.slot, heads.wq).view(S, k, heads.attn_heads, -1).transpose(1, 2)
        allowed = mask[rows][None, None] & valid[:, None, None, :]
        att = F.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed)
        u = h[:, b, None] + F.linear(att.transpose(1, 2).reshape(S, k, -1), heads.wo)
        out[:, b] = u + F.silu(torch.einsum("snd,ned->sne", u, heads.weight) + heads.bias)
    return out


def test_heads_apply_the_block_causal_mask():
    torch.manual_seed(0)
    heads = _heads()
    S, k, nb, d = 3, heads.k, heads.num_blocks, heads.hidden_size
    h, emb = torch.randn(S, nb, d), torch.randn(S, nb * k, d)
    valid = torch.ones(S, nb * k, dtype=torch.bool)
    valid[1, :5] = False  # a stretch that starts before its sample
    with torch.no_grad():
        z = heads.forward_blocks(h, emb, valid)
        torch.testing.assert_close(z, _reference(heads, h, emb, valid), rtol=1e-5, atol=1e-5)
        later = emb.clone()
        later[:, 2 * k:] += 1.0  # change block 2: blocks 0 and 1 must not see it
        z2 = heads.forward_blocks(h, later, valid)
        torch.testing.assert_close(z2[:, :2], z[:, :2])
        assert (z2[:, 2] - z[:, 2]).abs().max() > 1e-3
        own = emb.clone()
        own[:, k + k - 1] += 1.0  # the last token of block 1: its first slot reads ahead to it
        assert (heads.forward_blocks(h, own, valid)[:, 1, 0] - z[:, 1, 0]).abs().max() > 1e-3
        # decoding reads the newest block of a stretch: the same function as training's last block
        torch.testing.assert_close(heads(h[:, -1], emb, valid), z[:, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(heads(h[:, -1], emb, valid, slots=[0, 1]), z[:, -1, :2], rtol=1e-5, atol=1e-5)


def _case(V: int = 4096, S: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    heads = _heads(d=32, k=4, nb=4, seed=seed)
    lm = torch.randn(V, heads.hidden_size)
    k, nb = heads.k, heads.num_blocks
    tg = torch.randint(0, V, (S, nb, k))
    tg[0, 0] = -1  # a block inside the prompt, a slot past the answer's end
    tg[1, 3, 2:] = -1
    batch = {"h": torch.randn(S, nb, heads.hidden_size), "valid": torch.ones(S, nb * k, dtype=torch.bool),
             "targets": tg}
    return heads, lm, batch, torch.randn(S, nb * k, heads.hidden_size), torch.tensor([1.0, 0.8, 0.6, 0.4])


def test_per_block_checkpointing_gives_the_same_loss_and_gradients():
    heads, lm, batch, emb, w = _case()
    results = []
    for per_block in (False, True):
        heads.zero_grad(set_to_none=True)
        loss, per_slot = stretch_losses(heads, lm, batch, emb, w, per_block)
        loss.backward()
        results.append((loss.detach(), per_slot, {n: p.grad.clone() for n, p in heads.named_parameters()}))
    (l0, s0, g0), (l1, s1, g1) = results
    torch.testing.assert_close(l1, l0)
    torch.testing.assert_close(s1, s0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)
    assert all(g.abs().sum() > 0 for g in g0.values())  # every parameter trains
    # the loss is the weighted mean cross-entropy over the valid proposals, written out
    z = heads.forward_blocks(batch["h"], emb, batch["valid"])
    ce = F.cross_entropy(F.linear(z, lm).flatten(0, 2), batch["targets"].flatten(), ignore_index=-1,
                         reduction="none").view_as(batch["targets"])
    torch.testing.assert_close(l0, (ce * w).sum() / (batch["targets"] >= 0).sum(), rtol=1e-5, atol=1e-6)


def _peak_bytes(tmp_path: Path, fn) -> float:
    """Peak CPU memory of ``fn()`` by torch's profiler memory timeline (every category summed)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    path = tmp_path / "timeline.json"
    prof.export_memory_timeline(str(path), device="cpu")
    _times, sizes = json.loads(path.read_text())
    return max(sum(row) for row in sizes)


@pytest.mark.filterwarnings("ignore:`export_memory_timeline` is deprecated")
def test_per_block_checkpointing_lowers_peak_memory(tmp_path):
    heads, lm, batch, emb, w = _case(V=8192, S=64)
    saved: dict[bool, float] = {}
    peaks: dict[bool, float] = {}
    for per_block in (False, True):
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stretch_losses(heads, lm, batch, emb, w, per_block)
        saved[per_block] = sum(seen.values())

        def step(per_block: bool = per_block) -> None:
            heads.zero_grad(set_to_none=True)
            loss, _ = stretch_losses(heads, lm, batch, emb, w, per_block)
            loss.backward()

        peaks[per_block] = _peak_bytes(tmp_path, step)
    logits_block = 64 * 4 * 8192 * 4  # one block's fp32 logits
    assert saved[False] > 3 * logits_block > 10 * saved[True]  # every block's logits kept vs none
    assert peaks[True] < 0.7 * peaks[False], peaks


# ------------------------------------------------------------------------------------------ the trainer
def test_stretches_lay_blocks_out_within_their_sample(tmp_path):
    """Two samples, k = 2, 3 blocks: a stretch's tokens are the sample's own, oldest first, padded before its
    start; block b's hidden row is the row that emitted its last token; its targets are the next k tokens."""
    cache = tmp_path / "cache"
    cache.mkdir()
    samples = [{"prompt_token_ids": [1, 2, 3], "output_token_ids": [10, 11, 12, 13, 14]},
               {"prompt_token_ids": [4], "output_token_ids": [20, 21, 22]}]
    tokens = np.array([10, 11, 12, 13, 14, 20, 21, 22], dtype=np.int32)
    np.save(cache / "tokens.npy", tokens)
    np.save(cache / "positions.npy", np.array([2, 3, 4, 5, 6, 0, 1, 2], dtype=np.int32))
    np.save(cache / "starts.npy", np.array([0, 5, 8], dtype=np.int64))
    np.save(cache / "hidden.npy", np.arange(8, dtype=np.float16)[:, None].repeat(3, 1))
    (cache / "ids.json").write_text(json.dumps(["a", "b"]))
    st = TB.Stretches.load(cache, samples, k=2, val_frac=0.0)
    b = st.batch(np.array([4, 6]), k=2, nb=3)
    assert b["ids"][0].tolist() == [3, 10, 11, 12, 13, 14] and b["valid"][0].all()
    assert b["valid"][1].tolist() == [False, False, False, True, True, True]  # row 6 is answer token 21
    assert b["ids"][1, 3:].tolist() == [4, 20, 21]
    assert b["h"][0, :, 0].tolist() == [0, 2, 4]  # blocks end at answer tokens 10, 12, 14 (rows 0, 2, 4)
    assert b["qvalid"][1].tolist() == [False, False, True]  # sample b's rows 5, 6: only block 2 ends in it
    assert b["targets"][0, 0].tolist() == [11, 12] and b["targets"][0, 2].tolist() == [-1, -1]
    assert b["targets"][1, 0].tolist() == [-1, -1] and b["targets"][1, 2].tolist() == [22, -1]


def test_shipped_training_command_uses_the_block_mask_and_per_block_checkpoints(tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    """`leapdecode train blockwise` (per-block checkpointing on unless --no-grad-checkpoint) runs every block of
    every step through the checkpoint and the block-causal mask (counted, not assumed), records both in the
    artifact, and writes heads blockwise decoding loads and drafts with, losslessly."""
    from leapdecode import LLM, SamplingParams
    from leapdecode.cli import build_parser, main
    from leapdecode.speculative import block_heads as BH

    from .conftest import distill_tiny

    off = build_parser().parse_args(["train", "blockwise", "--data", "D", "--out", "O", "--no-grad-checkpoint"])
    assert off.grad_checkpoint is False and off.train_func is TB.cmd_blockwise
    data = distill_tiny(tiny_model_dir, tmp_path, ["cats", "dogs", "rain", "tea", "maps", "owls"])
    calls = {"mask": 0, "checkpoint": 0, "steps": 0}
    real_mask, real_ckpt, real_step = BH.block_causal_mask, TB.checkpoint, TB.BlockwiseTrainer.train_step

    def mask(*a, **kw):
        calls["mask"] += 1
        return real_mask(*a, **kw)

    def ckpt(*a, **kw):
        calls["checkpoint"] += 1
        return real_ckpt(*a, **kw)

    def step(self, ends):
        calls["steps"] += 1
        return real_step(self, ends)

    monkeypatch.setattr(BH, "block_causal_mask", mask)
    monkeypatch.setattr(TB, "checkpoint", ckpt)
    monkeypatch.setattr(TB.BlockwiseTrainer, "train_step", step)
    out = tmp_path / "heads"
    assert main(["train", "blockwise", "--data", str(data), "--out", str(out), "--model", str(tiny_model_dir),
                 "--num-heads", "3", "--num-blocks", "2", "--head-dim", "8", "--attn-heads", "2",
                 "--batch-size", "4", "--max-steps", "3", "--vocab-subset", "0", "--val-frac", "0.3"]) == 0
    assert calls["steps"] == 3 and calls["checkpoint"] == 3 * 2  # every block of every step
    assert calls["mask"] >= 3 * 2  # each checkpointed block's forward (and its recompute) builds the mask
    cfg = json.loads((out / "config.json").read_text())
    record = json.loads((out / "record.json").read_text())
    assert record["config"]["grad_checkpoint"] is True and cfg["train"]["grad_checkpoint"] == "per block"
    assert cfg["train"]["block_mask"] == "block-causal" and len(cfg["validation"]["chain_acceptance"]) == 3
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=256)
    spec = LLM.from_engine_of(llm, speculative_config={"method": "blockwise", "model": str(out),
                                                        "use_cost_model": False})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Tell me about cats.", "a b c a b c"]
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in
                                                      llm.generate(prompts, params, use_tqdm=False)]
    assert sum(o.metrics.num_draft_tokens for o in got) > 0
