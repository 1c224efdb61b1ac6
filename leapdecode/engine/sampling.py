"""One token per sequence from its last logits row, for a whole step at once: the request's processors, greedy or a
draw, and the log-probability entries of the requests that asked for them.

The work is per step, not per row: one argmax over every row, one pass of temperature/top-k/top-p/min-p over the
sampled rows, and one log-softmax per kind of row (greedy, sampled) for log-probabilities, whose entries are then
built per group of requests asking the same number of top tokens. Only the draw itself is per row, because each
seeded request owns its random stream (engine/sequence.py), so its tokens do not depend on the batch it rides in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from leapdecode.engine.output_assembly import row_context
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.layer_ops import row_argmax
from leapdecode.layers.sampler import apply_processors, position_logprobs, processed_logits, sample_from
from leapdecode.outputs import PositionLogprobs


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(rows)`` of 1-D rows, without the copy where they are consecutive rows of one tensor, as a step's
    decode rows are of its forward's logits (16 rows of a 49,152-token vocabulary: a 3 MB copy, ~0.3 ms of a batched
    step). The result may then share their memory; sampling never writes into it."""
    first = rows[0]
    n = first.numel()
    base = first.untyped_storage().data_ptr()
    if first.dim() == 1 and all(
            r.dim() == 1 and r.numel() == n and r.stride() == (1,) and r.dtype == first.dtype
            and r.device == first.device and r.untyped_storage().data_ptr() == base
            and r.storage_offset() == first.storage_offset() + i * n for i, r in enumerate(rows)):
        return first.as_strided((len(rows), n), (n, 1))
    return torch.stack(rows)


def sample_rows(
    seqs: list[Sequence], logits: torch.Tensor, generator: torch.Generator,
    decode_token: Callable[[int], str | None],
) -> tuple[list[int], list[list[PositionLogprobs] | None]]:
    """The token of each row of ``logits`` ([len(seqs), vocab]) and its log-probability entry (None where the
    request asked for none). ``generator``: the engine's stream, for unseeded sampled requests."""
    if any(s.params.has_processors for s in seqs):
        logits = apply_processors(logits, [row_context(s) for s in seqs])
    tokens = row_argmax(logits)
    rand = [i for i, s in enumerate(seqs) if not s.params.greedy]
    processed = None
    if rand:
        processed = processed_logits(logits[rand], [seqs[i].params for i in rand])
        probs = torch.softmax(processed, dim=-1)
        for j, i in enumerate(rand):
            tokens[i] = sample_from(probs[j], seqs[i].generator or generator)
    logprobs: list[list[PositionLogprobs] | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if want:
        rows = _logprob_rows(seqs, logits, want, rand, processed)
        by_top: dict[int, list[int]] = {}
        for i in want:
            by_top.setdefault(seqs[i].params.logprobs, []).append(i)  # type: ignore[arg-type]
        for top, idx in by_top.items():
            entries = position_logprobs(torch.stack([rows[i] for i in idx]), [tokens[i] for i in idx], top,
                                        decode_token)
            for i, e in zip(idx, entries):
                logprobs[i] = [e]
    return tokens, logprobs


def _logprob_rows(seqs: list[Sequence], logits: torch.Tensor, want: list[int], rand: list[int],
                  processed: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """Row i -> the log-probabilities its token was drawn from (sampler.logprob_rows, for many rows at once): the
    log-softmax of the processed logits for a greedy request, of the sampling distribution for a sampled one."""
    out: dict[int, torch.Tensor] = {}
    greedy = [i for i in want if seqs[i].params.greedy]
    if greedy:
        for i, row in zip(greedy, torch.log_softmax(logits[greedy].float(), dim=-1)):
            out[i] = row
    sampled = [i for i in want if not seqs[i].params.greedy]
    if sampled:
        assert processed is not None
        pos = {i: j for j, i in enumerate(rand)}
        lp = torch.log_softmax(processed[[pos[i] for i in sampled]], dim=-1)
        for i, row in zip(sampled, lp):
            out[i] = row
    return out


__all__ = ["sample_rows", "stack_rows"]
