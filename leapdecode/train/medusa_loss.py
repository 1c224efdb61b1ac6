"""Medusa heads' training losses: trainable per-head parameters, one head's (masked) loss, the weighted sum."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from leapdecode.speculative.heads import MedusaHeads


class TrainableHeads(nn.Module):
    """Per-head parameters (so each head has its own optimiser state and starts it when it becomes active)
    that export to / import from the stacked :class:`MedusaHeads`."""

    def __init__(self, heads: MedusaHeads) -> None:
        super().__init__()
        self.offsets = heads.offsets
        self.groups = heads.groups
        self.diversity = heads.diversity
        self.hidden_size = heads.hidden_size
        self.w = nn.ParameterList([nn.Parameter(heads.weight[i].detach().clone()) for i in range(heads.num_heads)])
        self.b = nn.ParameterList([nn.Parameter(heads.bias[i].detach().clone()) for i in range(heads.num_heads)])

    def forward(self, h: torch.Tensor, heads: Seq[int]) -> torch.Tensor:
        """[N, d] -> [N, len(heads), d] for the listed heads."""
        w = torch.stack([self.w[i] for i in heads])
        b = torch.stack([self.b[i] for i in heads])
        a, d = len(heads), self.hidden_size
        z = F.linear(h, w.reshape(a * d, d), b.reshape(a * d)).view(h.shape[0], a, d)
        return h.unsqueeze(1) + F.silu(z)

    def export(self) -> MedusaHeads:
        out = MedusaHeads(self.hidden_size, self.offsets, self.diversity)
        with torch.no_grad():
            out.weight.copy_(torch.stack([p.detach() for p in self.w]))
            out.bias.copy_(torch.stack([p.detach() for p in self.b]))
        return out


def _head_loss(
    z: torch.Tensor,
    lm_w: torch.Tensor,
    target: torch.Tensor,
    chosen: torch.Tensor | None,
    tau: float,
    teacher: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One head's loss (mean over its valid rows), its (masked) argmax, and the number of valid rows.

    ``target`` [B] subset ids (-1 = no target); ``chosen`` [B, j] earlier heads' picks on this offset, masked
    out of this head's softmax (rows whose target is one of them do not train it); ``teacher`` [B, V'] teacher
    logits for soft targets (None: hard)."""
    logits = F.linear(z, lm_w).float()
    if chosen is not None and chosen.shape[1]:
        logits = logits.scatter(1, chosen, float("-inf"))
        target = torch.where((target.unsqueeze(1) == chosen).any(dim=1), -1, target)
    valid = target >= 0
    nvalid = valid.sum()
    if teacher is None:
        loss = F.cross_entropy(logits / tau, target, ignore_index=-1, reduction="sum")
    else:
        tl = teacher.float() / tau
        if chosen is not None and chosen.shape[1]:
            tl = tl.scatter(1, chosen, float("-inf"))
        pt = tl.softmax(dim=-1)
        logp = (logits / tau).log_softmax(dim=-1)
        kl = (pt * (pt.clamp_min(1e-30).log() - logp.clamp_min(-1e30))).sum(dim=-1)
        loss = (tau * tau) * torch.where(valid, kl, 0.0).sum()
    return loss / nvalid.clamp_min(1), logits.detach().argmax(dim=-1), nvalid


def head_losses(
    heads: TrainableHeads,
    lm_w: torch.Tensor,
    h: torch.Tensor,
    targets: torch.Tensor,
    active_offsets: Seq[int],
    temperatures: Seq[float],
    teacher: dict[int, torch.Tensor] | None = None,
    grad_checkpoint: bool = False,
) -> dict[int, torch.Tensor]:
    """Loss per active head (index -> scalar). ``targets`` [B, D] subset ids (-1 = none); ``teacher[k]``
    [B, V'] teacher logits for offset k (soft targets)."""
    active = [i for k in active_offsets for i in heads.groups[k]]
    z = heads(h, active)
    col = {hd: j for j, hd in enumerate(active)}
    out: dict[int, torch.Tensor] = {}
    for k in active_offsets:
        picks: list[torch.Tensor] = []
        for hd in heads.groups[k]:
            chosen = torch.stack(picks, dim=1) if (picks and heads.diversity == "exclude") else None
            args = (z[:, col[hd]], lm_w, targets[:, k - 1], chosen, temperatures[k - 1],
                    None if teacher is None else teacher[k])
            if grad_checkpoint:
                loss, pick, _ = checkpoint(_head_loss, *args, use_reentrant=False)
            else:
                loss, pick, _ = _head_loss(*args)
            out[hd] = loss
            picks.append(pick)
    return out


def weighted_loss(losses: dict[int, torch.Tensor], head_offsets: Seq[int], weights: Seq[float]) -> torch.Tensor:
    """``sum_i w[offset(i)] * CE_i`` over the heads that trained this step (weights indexed by offset - 1)."""
    return sum((weights[head_offsets[i] - 1] * loss for i, loss in losses.items()), torch.zeros(()))


__all__ = ["TrainableHeads", "head_losses", "weighted_loss"]
