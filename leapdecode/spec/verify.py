"""Lossless verification of a draft chain against the target's distributions at each draft position.

Per sequence, never across a flattened batch: each sequence's accepted length is its own first mismatch.

Greedy: accept drafts while they equal the target's argmax; the first mismatch is replaced by the target's token,
and if all drafts pass the target's next token is a free "bonus". The emitted tokens are exactly what plain greedy
decoding would produce.

Sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i));
on the first rejection sample from norm(max(p_i - q_i, 0)) and stop; if all pass, sample the bonus from p_{k}.
Each emitted token is then distributed exactly as under plain sampling from p. A deterministic drafter
(n-gram lookup) has q = one-hot, which makes the residual "p with the draft token removed".
"""

from __future__ import annotations

import torch

from leapdecode.layers.sampler import sample_from, uniform


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """``target_argmax`` has len(drafts) + 1 entries. Returns (emitted tokens, number of drafts accepted)."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        if target_argmax[i] != d:
            out.append(target_argmax[i])
            return out, i
        out.append(d)
    out.append(target_argmax[len(drafts)])
    return out, len(drafts)


def verify_sampling(
    p: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """``p``: [k+1, V] target probabilities; ``q``: [k, V] draft probabilities or None (deterministic drafts)."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        pd = float(p[i, d])
        qd = 1.0 if q is None else float(q[i, d])
        if qd > 0 and uniform(generator) < min(1.0, pd / qd):
            out.append(d)
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        # p == q exactly leaves no residual mass; then any draw from p is correct
        out.append(sample_from(residual / total if total > 0 else p[i], generator))
        return out, i
    out.append(sample_from(p[len(drafts)], generator))
    return out, len(drafts)
