"""Logit processing and sampling, shared by plain decoding and speculative verification.

Both sides of rejection sampling must see the *same* distribution rules, so the target's p and a drafter's q are
produced by :func:`processed_probs` with the request's temperature, top-k, top-p and min-p. Order (as in HF and
vLLM): repetition penalty -> temperature -> top-k -> top-p -> min-p.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from leapdecode.sampling_params import SamplingParams


def apply_repetition_penalty(
    logits: torch.Tensor, contexts: Seq[Seq[int]], penalties: Seq[float]
) -> torch.Tensor:
    """HF's rule: a logit of a token already in the context is divided by the penalty if positive, else
    multiplied by it. ``contexts[i]`` is the prompt + output before row i's position."""
    if all(p == 1.0 for p in penalties):
        return logits
    logits = logits.clone()
    for i, (ctx, pen) in enumerate(zip(contexts, penalties)):
        if pen == 1.0 or not ctx:
            continue
        ids = torch.tensor(sorted(set(ctx)), dtype=torch.long, device=logits.device)
        row = logits[i, ids]
        logits[i, ids] = torch.where(row > 0, row / pen, row * pen)
    return logits


def processed_probs(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, one row per ``params`` entry (temperature > 0)."""
    logits = logits.float()
    temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    logits = logits / temps
    ks = [p.top_k for p in params]
    if any(k > 0 for k in ks):
        vocab = logits.shape[-1]
        kmax = min(max(k if k > 0 else 1 for k in ks), vocab)
        kth = logits.topk(kmax, dim=-1).values  # [n, kmax], descending
        idx = torch.tensor([min(k, vocab) - 1 if k > 0 else kmax - 1 for k in ks], device=logits.device)
        thresh = kth.gather(1, idx.unsqueeze(1))
        keep_all = torch.tensor([k <= 0 for k in ks], device=logits.device).unsqueeze(1)
        logits = torch.where((logits < thresh) & ~keep_all, float("-inf"), logits)
    probs = torch.softmax(logits, dim=-1)
    top_ps = [p.top_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        tp = torch.tensor(top_ps, device=logits.device).unsqueeze(1)
        drop_sorted = (cum - sorted_p) >= tp  # keep the smallest prefix whose mass reaches top_p
        drop_sorted[:, 0] = False  # the most likely token always survives (a tiny top_p rounds to 0 in float32)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_ps = [p.min_p for p in params]
    if any(mp > 0 for mp in min_ps):
        mp = torch.tensor(min_ps, device=logits.device).unsqueeze(1)
        probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a 1-D distribution; the generator lives on the CPU so seeds reproduce across devices."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator).item())


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator).item())
