"""Trained heads on the target's last hidden state, and the base of the drafters that read through them.

Each head is one residual block ``z = h + SiLU(W h + b)`` followed by the target's own (frozen, tied) LM head, so
a head adds ``d^2 + d`` parameters (0.33M for SmolLM2-135M's d = 576) and nothing vocabulary-sized. Head i is
trained (``leapdecode train medusa``) to predict the token ``offsets[i]`` places after the one the target's own
head predicts from the same hidden state (offset 1 = the token after next). Three methods read them: Medusa
trees (methods/medusa.py), blockwise chains (methods/blockwise.py) and a hybrid's branches (methods/hybrid.py).

Layout. ``offsets`` lists one entry per head; the default *pyramid* ``1,2,2,3,3,3,4,4,4,4`` spends more heads where
uncertainty is higher; ``1,2,3,4`` (one per offset) is the comparison point. Heads that share an offset would
learn the same thing from the same data, so they are made to differ (``diversity``):

- ``"exclude"`` (default): head j of an offset is trained with the top-1 choices of heads 0..j-1 of that offset
  masked out of its softmax (positions where one of them is right do not train it), i.e. it learns "the best
  *other* guess". The offset's candidate list is then ``[c_0, c_1, .., c_{m-1}]`` (each head's masked argmax)
  followed by head 0's ranking; the first head starts from zero weights (the residual block is the identity, so
  it begins by predicting what the target's own head predicts), later heads from small random weights.
- ``"ensemble"``: independently initialised heads trained on the same objective; candidates are the top-k of
  their averaged distribution.

Vocabulary subset. Training on the 49k-wide LM head dominates cost on a CPU, so the trainer can restrict the
heads to the most frequent tokens of the training answers (``vocab_subset``, e.g. 8192 ids covering ~98% of
them); the same subset is used at inference, which also makes the heads' LM-head read ~6x smaller per step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F
from torch import nn

from leapdecode.engine.sequence import Sequence
from leapdecode.layers import small_gemm
from leapdecode.speculative.proposer import EngineView, Proposer, tensor_bytes

PYRAMID: tuple[int, ...] = (1, 2, 2, 3, 3, 3, 4, 4, 4, 4)
ONE_PER_OFFSET: tuple[int, ...] = (1, 2, 3, 4)
LAYOUTS: dict[str, tuple[int, ...]] = {"pyramid": PYRAMID, "one-per-offset": ONE_PER_OFFSET, "chain": ONE_PER_OFFSET}
DIVERSITY = ("exclude", "ensemble")


def parse_layout(layout: str | Seq[int]) -> list[int]:
    """``"pyramid"``, ``"one-per-offset"``, ``"1,2,2,3"`` or a list of offsets -> sorted list of offsets."""
    if isinstance(layout, str):
        offsets = list(LAYOUTS[layout]) if layout in LAYOUTS else [int(x) for x in layout.split(",") if x.strip()]
    else:
        offsets = [int(x) for x in layout]
    if not offsets or min(offsets) < 1:
        raise ValueError(f"a Medusa layout is a non-empty list of offsets >= 1, got {layout!r}")
    missing = sorted(set(range(1, max(offsets) + 1)) - set(offsets))
    if missing:
        raise ValueError(f"layout {layout!r} skips offsets {missing}: a tree needs a head at every depth")
    return sorted(offsets)


class MedusaHeads(nn.Module):
    """All heads' residual blocks as one batched matmul: ``forward(h [N, d]) -> [N, H, d]`` (before the LM head).

    ``groups[d]`` are the indices of the heads on offset d, in their rank order (head 0 of a group is the one
    whose ranking fills the candidate list after every head's top choice)."""

    def __init__(self, hidden_size: int, offsets: Seq[int], diversity: str = "exclude") -> None:
        super().__init__()
        if diversity not in DIVERSITY:
            raise ValueError(f"diversity must be one of {DIVERSITY}, got {diversity!r}")
        self.offsets = parse_layout(list(offsets))
        self.hidden_size = hidden_size
        self.diversity = diversity
        n = len(self.offsets)
        self.weight = nn.Parameter(torch.zeros(n, hidden_size, hidden_size))  # [head, out, in]
        self.bias = nn.Parameter(torch.zeros(n, hidden_size))
        self.groups: dict[int, list[int]] = {}
        for i, o in enumerate(self.offsets):
            self.groups.setdefault(o, []).append(i)

    @property
    def num_heads(self) -> int:
        return len(self.offsets)

    @property
    def max_offset(self) -> int:
        return max(self.offsets)

    def rank_in_group(self, head: int) -> int:
        return self.groups[self.offsets[head]].index(head)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """First head of each offset: zero (identity block); the others: N(0, std) from per-head seeds, so heads
        on one offset start apart. (``ensemble`` heads all start random, from different seeds.)"""
        for i in range(self.num_heads):
            self.bias[i].zero_()
            if self.diversity == "exclude" and self.rank_in_group(i) == 0:
                self.weight[i].zero_()
            else:
                g = torch.Generator().manual_seed(seed * 1000 + i)
                self.weight[i].copy_(torch.randn(self.hidden_size, self.hidden_size, generator=g) * std)

    def forward(self, h: torch.Tensor, heads: Seq[int] | None = None) -> torch.Tensor:
        """``h``: [N, d] final-norm hidden states; ``heads``: subset of head indices (default all)."""
        w, b = self.weight, self.bias
        if heads is not None:
            idx = torch.as_tensor(list(heads), dtype=torch.long, device=w.device)
            w, b = w.index_select(0, idx), b.index_select(0, idx)
        n, d = w.shape[0], self.hidden_size
        z = F.linear(h, w.reshape(n * d, d), b.reshape(n * d)).view(h.shape[0], n, d)
        return h.unsqueeze(1) + F.silu(z)


def exclusion_fill(first_logits: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """``chosen`` [N, m] distinct ids followed by the best ``k - m`` ids of ``first_logits`` [N, V] that are not
    in ``chosen``: the merged candidate list of an offset under ``exclude`` diversity. Returns [N, k]."""
    m = chosen.shape[1]
    if k <= m:
        return chosen[:, :k]
    top = first_logits.topk(min(k + m, first_logits.shape[1]), dim=-1).indices
    dup = (top.unsqueeze(2) == chosen.unsqueeze(1)).any(dim=2)
    order = dup.to(torch.int8).argsort(dim=1, stable=True)
    fill = top.gather(1, order)[:, : k - m]
    return torch.cat([chosen, fill], dim=1)


def masked_argmax_chain(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, m, V] of one offset's heads in rank order -> [N, m]: each head's argmax with the previous
    heads' choices masked out (distinct by construction)."""
    n, m, _ = logits.shape
    chosen = torch.empty(n, m, dtype=torch.long, device=logits.device)
    for j in range(m):
        lj = logits[:, j]
        if j:
            lj = lj.scatter(1, chosen[:, :j], float("-inf"))
        chosen[:, j] = lj.argmax(dim=-1)
    return chosen


def ranked_candidates(logits: torch.Tensor, heads: MedusaHeads, k: int) -> torch.Tensor:
    """``logits`` [N, H, V] of all heads -> [N, D, k] candidate ids per depth (D = max offset), best first,
    distinct within a depth."""
    out = []
    for d in range(1, heads.max_offset + 1):
        g = heads.groups[d]
        lg = logits[:, g]
        if heads.diversity == "exclude":
            out.append(exclusion_fill(lg[:, 0], masked_argmax_chain(lg), k))
        else:
            p = lg.float().softmax(dim=-1).mean(dim=1)
            out.append(p.topk(min(k, p.shape[-1]), dim=-1).indices)
    return torch.stack(out, dim=1)


class HeadsProposer(Proposer):
    """A drafter that reads the target's last hidden state through trained heads and the target's own LM head
    (Medusa trees, blockwise chains). Invariant: ``self.hidden[seq.request_id]`` holds ``(n, h)``, the
    hidden state that predicted the last emitted token of ``seq`` when it had ``n`` tokens; a proposal is made only from
    a state whose ``n`` is the sequence's current length (a preempted or rewound sequence must not draft from a
    stale one)."""

    observes = True  # keeps the hidden state behind each sequence's last token

    def __init__(self, heads: MedusaHeads, lm_weight: torch.Tensor, vocab_subset: torch.Tensor | None) -> None:
        dev, dt = lm_weight.device, lm_weight.dtype
        self.heads = heads.to(device=dev, dtype=dt)
        self.subset = None if vocab_subset is None else vocab_subset.to(dev)
        # the heads' read-out: the target's own LM head, restricted to the vocabulary subset they were trained on
        self.lm_weight = lm_weight if vocab_subset is None else lm_weight.index_select(0, self.subset).contiguous()
        self.lm_packed: torch.Tensor | None = None  # the read-out through the few-row kernel (pack_readout)
        # request id -> (its length, the hidden state that predicted its last token)
        self.hidden: dict[str, tuple[int, torch.Tensor]] = {}

    def memory_bytes(self) -> int:
        """The heads' weights, and the read-out rows when they are a copy (a vocabulary subset, a packed kernel)."""
        own_weight = self.lm_weight if self.subset is not None else None
        return tensor_bytes(self.heads, own_weight, self.lm_packed)

    def pack_readout(self, view: EngineView) -> None:
        """Read the heads out through the engine's few-row kernel when the target uses it: from the LM head's own
        Q8 blocks where it has them (the subset of a 49k-row head is ~19 MB in float32 per step, ~5 MB in Q8)."""
        if view.num_packed_linears:
            self.lm_packed = small_gemm.pack_rows(view.model.lm_head, self.subset, self.lm_weight)

    def readout(self, z: torch.Tensor) -> torch.Tensor:
        """[..., d] head states -> [..., V'] logits over the heads' vocabulary."""
        flat = small_gemm.linear(z.reshape(-1, z.shape[-1]), self.lm_weight, None, self.lm_packed)
        return flat.view(*z.shape[:-1], -1)

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        if seq.params.speculative:
            self.hidden[seq.request_id] = (seq.num_tokens, hidden.detach().reshape(-1).clone())

    def release(self, seq: Sequence) -> None:
        self.hidden.pop(seq.request_id, None)

    def fresh_hidden(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Indices of the sequences that may draft this step (budget > 0 and a current hidden state) and their
        hidden states stacked [len(rows), d] (None when there are none)."""
        rows, hs = [], []
        for i, (seq, k) in enumerate(zip(seqs, budgets)):
            st = self.hidden.get(seq.request_id)
            if k > 0 and st is not None and st[0] == seq.num_tokens:
                rows.append(i)
                hs.append(st[1])
        return rows, (torch.stack(hs) if hs else None)




__all__ = [
    "LAYOUTS",
    "ONE_PER_OFFSET",
    "PYRAMID",
    "HeadsProposer",
    "MedusaHeads",
    "exclusion_fill",
    "masked_argmax_chain",
    "parse_layout",
    "ranked_candidates",
]
