"""Logit processing and sampling, shared by plain decoding and speculative verification.

Both sides of rejection sampling must see the *same* distribution rules, so the target's p and a drafter's q are
produced by :func:`processed_probs` with the request's temperature, top-k, top-p and min-p. Before that, the
request's logits processors (:func:`apply_processors`) rewrite the raw logits of each position from the tokens
before it. Full order (docs/sampling.md): repetition penalty -> presence/frequency penalties -> logit_bias ->
min_tokens mask -> grammar mask -> temperature -> top-k -> top-p -> min-p.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from leapdecode.outputs import Logprob, PositionLogprobs
from leapdecode.sampling_params import SamplingParams

NEG_INF = float("-inf")


@dataclass
class RowContext:
    """What the processors of one logits row need: the request's parameters, the tokens before the row's
    position (prompt + output so far, drafts included during verification), where the prompt ends, the tokens
    ``min_tokens`` forbids, and the grammar's allowed tokens (bool [vocab]) or None."""

    params: SamplingParams
    token_ids: Seq[int]
    num_prompt_tokens: int
    stop_ids: Seq[int] | set[int] = ()
    allowed: torch.Tensor | None = None


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


def _output_counts(rows: Seq[RowContext], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] how often each token occurs in each row's output so far (float32)."""
    counts = torch.zeros(len(rows), vocab, device=device)
    for i, r in enumerate(rows):
        out = r.token_ids[r.num_prompt_tokens :]
        if len(out):
            ids = torch.as_tensor(list(out), dtype=torch.long, device=device)
            counts[i].index_add_(0, ids, torch.ones(len(out), device=device))
    return counts


def apply_processors(logits: torch.Tensor, rows: Seq[RowContext]) -> torch.Tensor:
    """The request's processors on [len(rows), vocab] raw logits (a new tensor when any applies; ``logits``
    itself when none does). Penalties follow OpenAI's definition for presence/frequency (over the output
    tokens) and HF's for repetition (over prompt + output)."""
    if not any(r.params.has_processors for r in rows):
        return logits
    reps = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in reps):
        logits = apply_repetition_penalty(logits.float(), [r.token_ids for r in rows], reps)  # a new tensor
    else:
        logits = logits.float().clone()
    dev, vocab = logits.device, logits.shape[-1]
    pres = [r.params.presence_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    if any(pres) or any(freq):
        counts = _output_counts(rows, vocab, dev)
        f = torch.tensor(freq, device=dev).unsqueeze(1)
        p = torch.tensor(pres, device=dev).unsqueeze(1)
        logits -= counts * f + (counts > 0).float() * p
    for i, r in enumerate(rows):
        bias = r.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=dev)
            logits[i].index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=dev))
    held = [i for i, r in enumerate(rows)  # rows min_tokens still keeps from stopping
            if r.params.min_tokens and len(r.token_ids) - r.num_prompt_tokens < r.params.min_tokens and r.stop_ids]
    grammar = [i for i, r in enumerate(rows) if r.allowed is not None]
    # (the grammar rows as they were before min_tokens masked their stop tokens: the fallback below needs them)
    before = logits[grammar].clone() if held and grammar else None
    for i in held:
        logits[i, torch.tensor(sorted(rows[i].stop_ids), dtype=torch.long, device=dev)] = NEG_INF
    if grammar:
        for i in grammar:
            logits[i].masked_fill_(~rows[i].allowed.to(dev), NEG_INF)
        if before is not None:
            # the grammar allows only a stop token while min_tokens forbids it: the grammar wins
            dead = torch.isinf(logits[grammar]).all(dim=-1).tolist()
            for j, i in enumerate(grammar):
                if dead[j]:
                    logits[i] = before[j].masked_fill(~rows[i].allowed.to(dev), NEG_INF)
    return logits


def processed_logits(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Logits after temperature, top-k, top-p and min-p (removed tokens at -inf), one row per ``params`` entry
    (temperature > 0): their softmax is the distribution a sampled token is drawn from."""
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
        logits = torch.where((logits < thresh) & ~keep_all, NEG_INF, logits)
    top_ps = [p.top_p for p in params]
    min_ps = [p.min_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        probs = torch.softmax(logits, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        tp = torch.tensor(top_ps, device=logits.device).unsqueeze(1)
        drop_sorted = (cum - sorted_p) >= tp  # keep the smallest prefix whose mass reaches top_p
        drop_sorted[:, 0] = False  # the most likely token always survives (a tiny top_p rounds to 0 in float32)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    if any(mp > 0 for mp in min_ps):
        # relative to the most likely token, so the renormalization after top-p does not change the cut
        mp = torch.tensor(min_ps, device=logits.device).unsqueeze(1)
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, NEG_INF)
    return logits


def processed_probs(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, one row per ``params`` entry (temperature > 0)."""
    return torch.softmax(processed_logits(logits, params), dim=-1)


def logprob_rows(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [rows, vocab] of the distribution each row's token is drawn from, given logits after
    the request's processors: for a sampled request after temperature/top-k/top-p/min-p too (removed tokens at
    -inf); for a greedy one the processed logits' log-softmax at temperature 1."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(processed_logits(logits, [params] * logits.shape[0]), dim=-1)


def position_logprobs(
    logprobs: torch.Tensor, tokens: Seq[int], top: int, decode: Callable[[int], str | None]
) -> list[PositionLogprobs]:
    """One dict per row of [rows, vocab] ``logprobs``: the row's token and the ``top`` most likely tokens, each
    with its log-probability, its rank (1 + the number of tokens strictly more likely) and its text. Top tokens
    the request's filters removed (log-probability -inf) are left out."""
    lp = logprobs.float()
    tok = torch.as_tensor(list(tokens), dtype=torch.long, device=lp.device).unsqueeze(1)
    own = lp.gather(1, tok)
    ranks = ((lp > own).sum(dim=1) + 1).tolist()
    own_l = own.squeeze(1).tolist()
    top_v, top_i = lp.topk(top, dim=-1) if top > 0 else (None, None)
    out: list[PositionLogprobs] = []
    for r, t in enumerate(tokens):
        d: PositionLogprobs = {}
        if top_v is not None:
            vals = top_v[r].tolist()
            for v, i in zip(vals, top_i[r].tolist()):
                if v != NEG_INF:
                    d[i] = Logprob(v, 1 + sum(u > v for u in vals), decode(i))
        if t not in d:
            d[t] = Logprob(own_l[r], ranks[r], decode(t))
        out.append(d)
    return out


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a 1-D distribution; the generator lives on the CPU so seeds reproduce across devices."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator).item())


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator).item())
