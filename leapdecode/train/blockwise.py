"""Training a block of positions in parallel: the block-causal mask and per-block gradient checkpointing.

The blockwise *proposal heads* are Medusa heads with one head per offset, trained by ``leapdecode train medusa
--layout 1,2,...,k`` (see ``leapdecode/speculative/methods/blockwise.py`` and
``leapdecode/artifacts/blockwise/README.md``).
This module holds what blockwise parallel decoding adds on the training side:

**Block-causal mask.** Positions are cut into blocks of ``block`` consecutive positions (the last block may be
shorter); position i may attend to position j iff ``j // block <= i // block``: every position of its own block
and of all earlier blocks, never a later block. (A code sample in circulation writes
``mask[start:end, :start] = 0``, which forbids the *earlier* blocks and so contradicts its own comment; the
definition here is tested against a brute-force loop.) :func:`block_causal_mask` is the boolean form for torch
SDPA (True = may attend), :func:`block_causal_block_mask` the flex-attention ``BlockMask``.

**Semi-autoregressive layer.** :class:`SemiARLayer` is one residual attention + SiLU block over the frozen
target's cached final hidden states, read out by the target's own (frozen) LM head. Its input at position i is
the hidden state ``block`` positions earlier (plus a learned embedding of i's place in its block), so under the
block-causal mask the positions of block b see only hidden states from before block b and predict the b-th
block's ``block`` tokens in parallel -- offsets 1..block past the target's own next token, the same task the
blockwise heads solve. It is the stand-in for semi-autoregressive fine-tuning of the target's last layer that
keeps the target itself unchanged (so exact-mode decoding stays lossless); the engine's proposer does not use it.

**Per-block gradient checkpointing.** :func:`semi_ar_loss` computes the loss block by block (queries of block b
against keys/values of blocks <= b). With ``checkpoint=True`` each block's attention, MLP, LM-head logits and
loss run under ``torch.utils.checkpoint`` and are recomputed during backward, so instead of every block's
[block, vocab] logits and attention intermediates, only one block's are alive at a time. The gradients are the
same (tested to 1e-5); :func:`peak_memory_bytes` measures the difference (CUDA: ``max_memory_allocated``; CPU:
the torch profiler's allocation events, summed in time order -- bytes torch allocated above the starting level,
not the process RSS).

Run ``python -m leapdecode.train.blockwise`` for the measured peak memory with and without checkpointing on the
bundled model's cached hidden states (``runs/distill/hidden_cache``, written by ``leapdecode train medusa``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint


# ------------------------------------------------------------------------------------------------- masks
def block_of(length: int, block: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Block index of each position: ``[0]*block + [1]*block + ...`` (the last block may be short)."""
    if block < 1 or length < 0:
        raise ValueError(f"need block >= 1 and length >= 0, got block={block}, length={length}")
    return torch.arange(length, device=device) // block


def block_causal_mask(length: int, block: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [length, length], True where query i may attend to key j: ``block(j) <= block(i)``."""
    b = block_of(length, block, device)
    return b.unsqueeze(1) >= b.unsqueeze(0)


def block_causal_block_mask(length: int, block: int, device: torch.device | str = "cpu"):
    """The same mask as a flex-attention ``BlockMask`` (sparse: whole later-block tiles are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx // block) >= (kv_idx // block)

    return create_block_mask(mask_mod, None, None, length, length, device=str(device))


# ------------------------------------------------------------------------------------------------- model
class SemiARLayer(nn.Module):
    """Residual multi-head attention + residual SiLU block over hidden states, read out by a frozen LM head.

    ``forward_full`` runs the whole sequence at once under :func:`block_causal_mask`; :func:`semi_ar_loss`
    runs it block by block (optionally checkpointed). The output projection and MLP start at zero, so the
    fresh layer returns its (shifted) input: it begins as "the target's own head on the hidden state ``block``
    positions back" and learns the offsets from there."""

    def __init__(self, hidden_size: int, num_heads: int, block: int, lm_weight: torch.Tensor) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden size {hidden_size} is not divisible by {num_heads} attention heads")
        self.d, self.h, self.block = hidden_size, num_heads, block
        self.pos = nn.Parameter(torch.zeros(block, hidden_size))  # which offset a position of a block predicts
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        self.mlp = nn.Linear(hidden_size, hidden_size)
        for lin in (self.out, self.mlp):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.register_buffer("lm_weight", lm_weight.detach().float(), persistent=False)

    def inputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, d] target hidden states -> [T, d] layer inputs: position i reads hidden[i - block] (zeros
        before the start) plus the embedding of its place in the block."""
        t = hidden.shape[0]
        shifted = torch.cat([hidden.new_zeros(min(self.block, t), self.d), hidden[: max(0, t - self.block)]])
        return shifted + self.pos[torch.arange(t, device=hidden.device) % self.block]

    def heads_split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.h, self.d // self.h).transpose(0, 1)  # [H, n, d/H]

    def attend_mlp(self, x_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Queries' rows ``x_q`` [n, d] attend to ``k``/``v`` [H, m, d/H] under bool ``mask`` [n, m]."""
        q = self.heads_split(F.linear(x_q, self.qkv.weight[: self.d], self.qkv.bias[: self.d]))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = x_q + self.out(a.transpose(0, 1).reshape(x_q.shape[0], self.d))
        return y + F.silu(self.mlp(y))

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = F.linear(x, self.qkv.weight[self.d :], self.qkv.bias[self.d :])
        return self.heads_split(kv[:, : self.d]), self.heads_split(kv[:, self.d :])

    def forward_full(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, d] -> [T, V'] logits, all positions in one pass under the block-causal mask."""
        x = self.inputs(hidden)
        k, v = self.keys_values(x)
        y = self.attend_mlp(x, k, v, block_causal_mask(x.shape[0], self.block, x.device))
        return F.linear(y, self.lm_weight)


def _block_loss(layer: SemiARLayer, x_q, k, v, mask, targets) -> torch.Tensor:
    """Summed cross-entropy of one block (the unit that checkpointing recomputes)."""
    logits = F.linear(layer.attend_mlp(x_q, k, v, mask), layer.lm_weight)
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")


def semi_ar_loss(layer: SemiARLayer, hidden: torch.Tensor, targets: torch.Tensor, checkpoint: bool = False
                 ) -> torch.Tensor:
    """Mean cross-entropy over the valid targets (``-1`` = none) of one sequence, block by block: block b's
    queries attend to the keys/values of positions ``< end(b)`` under that slice of the block-causal mask.
    ``checkpoint=True`` recomputes each block's activations in backward instead of keeping them."""
    x = layer.inputs(hidden)
    k, v = layer.keys_values(x)
    t = x.shape[0]
    mask = block_causal_mask(t, layer.block, x.device)
    total = x.new_zeros(())
    for s in range(0, t, layer.block):
        e = min(s + layer.block, t)
        args = (layer, x[s:e], k[:, :e], v[:, :e], mask[s:e, :e], targets[s:e])
        total = total + (torch_checkpoint(_block_loss, *args, use_reentrant=False) if checkpoint
                         else _block_loss(*args))
    return total / (targets >= 0).sum().clamp_min(1)


# ----------------------------------------------------------------------------------------------- memory
def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes torch allocated while ``fn()`` ran, above the level before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the profiler's memory events (every allocation and free
    with its size), summed in time order; run single-threaded so the order is the allocation order."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def train_step_memory(layer: SemiARLayer, hidden: torch.Tensor, targets: torch.Tensor, checkpoint: bool,
                      device: torch.device | str = "cpu") -> tuple[int, float, list[torch.Tensor]]:
    """(peak bytes, loss, gradients) of one forward + backward with or without per-block checkpointing."""
    layer.zero_grad(set_to_none=True)
    out: dict[str, float] = {}

    def step() -> None:
        loss = semi_ar_loss(layer, hidden, targets, checkpoint)
        loss.backward()
        out["loss"] = float(loss.detach())

    peak = peak_memory_bytes(step, device)
    grads = [p.grad.detach().clone() for p in layer.parameters() if p.grad is not None]
    return peak, out["loss"], grads


# -------------------------------------------------------------------------------------------------- CLI
def load_cached_answers(cache: Path, num: int, min_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``num`` answers of at least ``min_len`` tokens from a Medusa hidden cache: (hidden [T, d],
    tokens [T]) where row j's hidden state is the one whose LM head predicts token j."""
    hidden = np.load(cache / "hidden.npy", mmap_mode="r")
    tokens = np.load(cache / "tokens.npy").astype(np.int64)
    starts = np.load(cache / "starts.npy")
    out = []
    for s, e in zip(starts[:-1], starts[1:]):
        if e - s >= min_len:
            out.append((torch.from_numpy(np.asarray(hidden[s:e], dtype=np.float32)), torch.from_numpy(tokens[s:e])))
            if len(out) >= num:
                break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Prints peak memory and gradient "
                                 "agreement of one training step with and without per-block checkpointing.")
    ap.add_argument("--cache", default="runs/distill/hidden_cache", help="hidden cache of `leapdecode train medusa`")
    ap.add_argument("--model", default=None, help="target model (default: the bundled one) for its LM head")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--attn-heads", type=int, default=9)
    ap.add_argument("--vocab-subset", type=int, default=8192, help="most frequent answer tokens (0 = full vocab)")
    ap.add_argument("--num-answers", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    from leapdecode.models.loader import load_model, resolve_model
    from leapdecode.train.medusa import choose_subset

    model, _ = load_model(resolve_model(a.model), torch.float32, torch.device("cpu"))
    w = model.lm_head.get_weight().detach().float()
    cache = Path(a.cache)
    subset = choose_subset(np.load(cache / "tokens.npy").astype(np.int64), a.vocab_subset, w.shape[0])
    remap = torch.arange(w.shape[0]) if subset is None else torch.full((w.shape[0],), -1, dtype=torch.long)
    if subset is not None:
        remap[subset] = torch.arange(len(subset))
        w = w.index_select(0, subset)
    del model
    dev = torch.device(a.device)
    layer = SemiARLayer(w.shape[1], a.attn_heads, a.block, w).to(dev)
    with torch.no_grad():  # a layer past its zero start, so every parameter gets a gradient
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    rows = []
    for hid, tok in load_cached_answers(cache, a.num_answers, a.min_len):
        hid, tgt = hid.to(dev), remap[tok].to(dev)
        t0 = time.perf_counter()
        p_plain, l_plain, g_plain = train_step_memory(layer, hid, tgt, False, dev)
        t1 = time.perf_counter()
        p_ckpt, l_ckpt, g_ckpt = train_step_memory(layer, hid, tgt, True, dev)
        t2 = time.perf_counter()
        diff = max(float((x - y).abs().max()) for x, y in zip(g_plain, g_ckpt))
        with torch.no_grad():
            full = layer.forward_full(hid)
            l_full = float(F.cross_entropy(full, tgt, ignore_index=-1))
        rows.append({"tokens": len(tok), "peak_plain_mb": p_plain / 2**20, "peak_ckpt_mb": p_ckpt / 2**20,
                     "loss_blocks": l_plain, "loss_ckpt": l_ckpt, "loss_full_mask": l_full, "max_grad_diff": diff,
                     "s_plain": t1 - t0, "s_ckpt": t2 - t1})
    print(f"block {a.block}, {a.attn_heads} attention heads, vocab {w.shape[0]}, device {dev}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print("| tokens | peak MB plain | peak MB checkpointed | ratio | max |grad diff| | loss (blocks / full mask) "
          "| s plain / ckpt |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['peak_plain_mb']:.1f} | {r['peak_ckpt_mb']:.1f} | "
              f"{r['peak_plain_mb'] / max(r['peak_ckpt_mb'], 1e-9):.1f}x | {r['max_grad_diff']:.1e} | "
              f"{r['loss_blocks']:.4f} / {r['loss_full_mask']:.4f} | {r['s_plain']:.2f} / {r['s_ckpt']:.2f} |")
    same = all(math.isclose(r["loss_blocks"], r["loss_full_mask"], rel_tol=1e-4) for r in rows)
    print(f"block-by-block loss {'equals' if same else 'DIFFERS FROM'} the full-sequence block-causal loss")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
