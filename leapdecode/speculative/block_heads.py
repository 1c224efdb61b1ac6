"""Blockwise decoding's proposal heads: k heads that read the target's hidden state and the text of the current
block through a block-causal attention layer.

**Blocks.** Decoding runs in blocks: a step verifies a block of tokens, and the heads then propose the next k
tokens at once. Training lays a stretch of the target's own answer out the same way, as ``num_blocks``
consecutive blocks of ``k`` tokens, and trains every block in parallel under the *block-causal* mask
(:func:`block_causal_mask`): a position attends to every token of its own block and of every earlier block, never
to a later block. Position j of block b is proposal slot j of that block: it predicts the token j + 1 places
after the one the target emits from the block's last hidden state. Every slot of a block sees exactly the text a
decoding step has when it proposes (the block, bonus token included, and what came before), so the mask lets a
slot read ahead within its block, which a causal mask would forbid, and nothing of the block it predicts.

**Heads.** For block b, whose last token the target emitted from hidden state ``h`` (its final-norm output):

- keys and values: the target's own (frozen) input embeddings of the block's and the earlier blocks' tokens,
  RMS-normalised, plus a learned embedding of each token's place in its block and of how many blocks back it is;
- the query of slot j: ``h + slot_j``; one multi-head attention layer under the mask gives ``u_j = h + O(attn)``
  (``O`` starts at zero, so untrained heads read ``h`` alone);
- head j: the residual block ``z_j = u_j + SiLU(W_j u_j + b_j)`` read out by the target's LM head.

The attention layer is what the block mask is for: the hidden state ``h`` summarises the text, but it was made
before the target picked the block's last token, which the heads now read directly, with the block's other
tokens. At decoding time the proposer feeds the last ``num_blocks * k`` tokens of the sequence as
``num_blocks`` blocks ending at the newest token, and the newest observed hidden state; it is the last block of a
training layout, so training and decoding compute the same function.

Trained by ``leapdecode train blockwise`` (train/blockwise.py), which checkpoints the gradient per block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F
from torch import nn


def block_causal_mask(num_blocks: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """``[L, L]`` bool, ``L = num_blocks * block_size``: ``mask[p, q]`` is True when position p may attend to q,
    i.e. q's block is p's own block or an earlier one (``q // block_size <= p // block_size``), never a later one."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"a block-causal mask needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                         f"{block_size}")
    block = torch.arange(num_blocks * block_size, device=device) // block_size
    return block.unsqueeze(1) >= block.unsqueeze(0)


class BlockHeads(nn.Module):
    """k proposal heads over the target's hidden state and the block's tokens (module docstring).

    ``forward(h, emb, valid)``: ``h`` [B, d] the hidden state behind each sequence's newest token, ``emb``
    [B, L, d] the target's input embeddings of its last ``L = num_blocks * k`` tokens (oldest first), ``valid``
    [B, L] False for padding (a sequence shorter than L) -> [B, n, d], the states of the first n heads before the
    LM head. :meth:`forward_blocks` is the training form: every block of a stretch at once under the mask."""

    def __init__(self, hidden_size: int, num_heads: int, num_blocks: int = 4, attn_heads: int = 4,
                 head_dim: int = 64) -> None:
        super().__init__()
        if num_heads < 1 or num_blocks < 1 or attn_heads < 1 or head_dim < 1:
            raise ValueError("BlockHeads needs positive num_heads, num_blocks, attn_heads and head_dim")
        self.hidden_size, self.k, self.num_blocks = hidden_size, num_heads, num_blocks
        self.attn_heads, self.head_dim = attn_heads, head_dim
        d, a = hidden_size, attn_heads * head_dim
        self.weight = nn.Parameter(torch.zeros(num_heads, d, d))  # head j's residual block [head, out, in]
        self.bias = nn.Parameter(torch.zeros(num_heads, d))
        self.slot = nn.Parameter(torch.zeros(num_heads, d))  # slot j's query offset
        self.key_norm = nn.Parameter(torch.ones(d))
        self.key_place = nn.Parameter(torch.zeros(num_heads, d))  # a key's place in its block (k - 1 = its end)
        self.key_back = nn.Parameter(torch.zeros(num_blocks, d))  # how many blocks before the query's it is
        self.wq = nn.Parameter(torch.zeros(a, d))
        self.wk = nn.Parameter(torch.zeros(a, d))
        self.wv = nn.Parameter(torch.zeros(a, d))
        self.wo = nn.Parameter(torch.zeros(d, a))

    @property
    def num_heads(self) -> int:
        return self.k

    @property
    def context_len(self) -> int:
        return self.num_blocks * self.k

    @property
    def offsets(self) -> list[int]:
        return list(range(1, self.k + 1))

    def settings(self) -> dict[str, int]:
        """What the artifact's config records to rebuild the module."""
        return {"num_heads": self.k, "num_blocks": self.num_blocks, "attn_heads": self.attn_heads,
                "head_dim": self.head_dim}

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Residual blocks zero (identity), attention projections small random, output projection zero: an untrained
        module is the target's own prediction, shifted."""
        g = torch.Generator().manual_seed(seed)
        for p in (self.wq, self.wk, self.wv, self.slot, self.key_place, self.key_back):
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for p in (self.weight, self.bias, self.wo):
            p.zero_()
        self.key_norm.fill_(1.0)

    # ------------------------------------------------------------------------------------------- pieces
    def keys(self, emb: torch.Tensor, back: torch.Tensor, place: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., L, d] embeddings -> keys and values [..., heads, L, head_dim]; ``back`` / ``place`` [.., L] ints."""
        x = F.rms_norm(emb, (self.hidden_size,), self.key_norm) + self.key_back[back] + self.key_place[place]
        k = F.linear(x, self.wk).unflatten(-1, (self.attn_heads, self.head_dim)).transpose(-3, -2)
        v = F.linear(x, self.wv).unflatten(-1, (self.attn_heads, self.head_dim)).transpose(-3, -2)
        return k, v

    def attend(self, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
               slots: Seq[int]) -> torch.Tensor:
        """``h`` [B, d], keys/values [B, heads, L, e], ``allowed`` [B, L] -> ``u`` [B, n, d] for ``slots``."""
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=h.device)
        qin = h.unsqueeze(1) + self.slot.index_select(0, idx)  # [B, n, d]
        q = F.linear(qin, self.wq).unflatten(-1, (self.attn_heads, self.head_dim)).transpose(1, 2)  # [B, H, n, e]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # [B, H, n, L]
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        att = torch.nan_to_num(scores.softmax(dim=-1))  # a row with nothing allowed reads nothing
        out = (att @ v).transpose(1, 2).flatten(-2)  # [B, n, a]
        return h.unsqueeze(1) + F.linear(out, self.wo)

    def residual(self, u: torch.Tensor, slots: Seq[int]) -> torch.Tensor:
        """Head j's residual block on ``u[..., i, :]`` for ``slots[i] = j``: [..., n, d] -> [..., n, d]."""
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=u.device)
        w, b = self.weight.index_select(0, idx), self.bias.index_select(0, idx)
        z = torch.einsum("...nd,ned->...ne", u, w) + b
        return u + F.silu(z)

    def positions(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per context position (oldest first, L of them): its block index and its place in the block."""
        pos = torch.arange(self.context_len, device=device)
        return pos // self.k, pos % self.k

    # ------------------------------------------------------------------------------------------ forwards
    def forward(self, h: torch.Tensor, emb: torch.Tensor, valid: torch.Tensor,
                slots: Seq[int] | None = None) -> torch.Tensor:
        """Decoding: the newest block's proposals (see the class docstring)."""
        slots = range(self.k) if slots is None else slots
        block, place = self.positions(h.device)
        back = (self.num_blocks - 1) - block
        k, v = self.keys(emb, back, place)
        return self.residual(self.attend(h, k, v, valid, slots), slots)

    def forward_blocks(self, h: torch.Tensor, emb: torch.Tensor, valid: torch.Tensor,
                       blocks: Seq[int] | None = None) -> torch.Tensor:
        """Training: ``h`` [S, nb, d] the hidden state at each block's end, ``emb`` [S, L, d] and ``valid`` [S, L]
        a stretch of L = nb * k tokens -> [S, len(blocks), k, d] for the listed blocks (default all), each under
        its rows of :func:`block_causal_mask` (slot j of block b is row b * k + j)."""
        blocks = range(self.num_blocks) if blocks is None else blocks
        mask = block_causal_mask(self.num_blocks, self.k, h.device)
        block, place = self.positions(h.device)
        out = []
        for b in blocks:
            back = (b - block).clamp(0, self.num_blocks - 1)  # later blocks are masked out; any index will do
            k, v = self.keys(emb, back, place)
            allowed = valid & mask[b * self.k]  # every slot of block b has the same row of the mask
            out.append(self.residual(self.attend(h[:, b], k, v, allowed, range(self.k)), range(self.k)))
        return torch.stack(out, dim=1)


__all__ = ["BlockHeads", "block_causal_mask"]
