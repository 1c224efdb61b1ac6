"""Output assembly: what the engine does with tokens a step committed to a sequence, and the outputs it reports.

Appending tokens one by one with their log-probabilities, advancing the grammar, the stop conditions inside an
accepted run (stop ids, stop strings, a grammar that ended, max_tokens, the context), incremental detokenizing,
prompt log-probabilities, and the ``RequestOutput`` of a request. The engine (llm_engine.py) owns the cache side
(trimming rejected drafts' slots, committing full blocks, finishing a sequence); this module owns the text side.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from leapdecode.engine.detokenizer import IncrementalDetokenizer
from leapdecode.engine.sequence import Sequence, SequenceStatus
from leapdecode.layers.sampler import RowContext, logprob_rows, position_logprobs
from leapdecode.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput

# prompt positions scored per log-softmax when a request asks for its prompt's log-probabilities
PROMPT_LOGPROB_ROWS = 64


@dataclass
class EngineStats:
    """Engine-wide counters since the engine started (the server's metrics and stats log read them)."""

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_output_tokens: int = 0
    num_target_steps: int = 0
    num_prompt_tokens: int = 0
    num_preemptions: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name (what the server keeps between its reads)."""
        return asdict(self)


class OutputAssembler:
    """Turns committed tokens into a sequence's text, log-probabilities and finish state, and requests into
    ``RequestOutput``s. Holds the engine's decoded-token cache and counts output tokens into ``stats``."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int, stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stats = stats
        self._token_texts: dict[int, str] = {}  # decode_token's cache

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def decode_token(self, token_id: int) -> str | None:
        """One token's text for log-probability entries (special tokens included), cached per id."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def logprobs_of(self, seq: Sequence, drawn: torch.Tensor | None,
                    tokens: list[int]) -> list[PositionLogprobs] | None:
        """Log-probability entries of ``tokens``, drawn from the rows of processed logits ``drawn``."""
        if seq.params.logprobs is None or drawn is None:
            return None
        return position_logprobs(logprob_rows(drawn, seq.params), tokens, seq.params.logprobs, self.decode_token)

    def record_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Rows of the prompt positions ``start ..`` predict the prompt tokens after them: log-softmax of the
        model's raw logits (no processors apply to the prompt)."""
        assert seq.prompt_logprobs is not None and seq.params.prompt_logprobs is not None
        m = logits.shape[0]
        # a few rows at a time: a whole prefill chunk's float32 log-softmax (and its rank comparison) would hold
        # several [rows, vocab] copies at once (gigabytes for a 2k-token chunk of a 150k vocabulary)
        for lo in range(0, m, PROMPT_LOGPROB_ROWS):
            hi = min(m, lo + PROMPT_LOGPROB_ROWS)
            targets = seq.token_ids[start + 1 + lo : start + 1 + hi]
            entries = position_logprobs(
                torch.log_softmax(logits[lo:hi].float(), dim=-1), targets, seq.params.prompt_logprobs,
                self.decode_token,
            )
            seq.prompt_logprobs[start + 1 + lo : start + 1 + hi] = entries

    def append(self, seq: Sequence, new_tokens: list[int], logprobs: list[PositionLogprobs] | None) -> None:
        """Append tokens one by one (with their log-probabilities and the grammar advanced), honouring stop
        conditions inside an accepted run: ``seq.finish_reason`` is set when one holds."""
        m = seq.metrics
        m.num_target_steps += 1
        self.stats.num_target_steps += 1
        if m.ttft_s is None:
            m.ttft_s = time.perf_counter() - seq.arrival_time
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.decode)
        for j, tok in enumerate(new_tokens):
            seq.token_ids.append(tok)
            m.num_output_tokens += 1
            self.stats.num_output_tokens += 1
            if logprobs is not None and seq.logprobs is not None:
                seq.logprobs.append(logprobs[j])
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + logprobs[j][tok].logprob
            if seq.grammar is not None and not seq.grammar.accept(tok):
                raise RuntimeError(f"token {tok} broke request {seq.group_id!r}'s grammar although it was masked")
            self._check_stop(seq, tok)
            if seq.finish_reason:
                break
        if not (seq.finish_reason == "stop" and isinstance(seq.stop_reason, str)):  # a stop string cut the text
            if seq.finish_reason:
                seq.output_text = seq.detokenizer.finish(seq.output_token_ids)
            else:
                seq.detokenizer.append(seq.output_token_ids)
                seq.output_text = seq.detokenizer.text

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        """The stop conditions after ``tok`` was appended (sets ``finish_reason`` and ``stop_reason``)."""
        p, m = seq.params, seq.metrics
        assert seq.detokenizer is not None
        # a grammar that has ended allows no further token: the output is complete, min_tokens or not (the
        # sampler lets the grammar's stop token through when min_tokens masks everything else)
        ended = seq.grammar is not None and seq.grammar.is_terminated()
        if m.num_output_tokens < p.min_tokens and not ended:
            # no stop condition before min_tokens (stop tokens are masked until then); the text moves on, so
            # a stop string in it is not found later by the first check of an accepted run past min_tokens
            if p.stop_list:
                seq.detokenizer.append(seq.output_token_ids)
        elif tok in seq.stop_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = None if tok in self.eos_token_ids and tok not in (p.stop_token_ids or []) else tok
        elif p.stop_list and self._check_stop_strings(seq):
            pass
        elif ended:
            seq.finish_reason = "stop"  # the structured output is complete
        if not seq.finish_reason and (m.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"

    def _check_stop_strings(self, seq: Sequence) -> bool:
        """After each token: does the text now contain a stop string? Only the tail can hold a new one (the text
        before this token held none), so the search starts ``len(stop) - 1`` characters before the new text."""
        assert seq.detokenizer is not None
        before = len(seq.detokenizer.text)
        if not seq.detokenizer.append(seq.output_token_ids):
            return False
        text = seq.detokenizer.text
        hits = [(i, s) for s in seq.params.stop_list if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        seq.output_text = text[: pos + len(stop)] if seq.params.include_stop_str_in_output else text[:pos]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    @staticmethod
    def make_output(group: list[Sequence]) -> RequestOutput:
        """The request's state: one completion per sequence of ``group`` (its n samples), by index."""
        first = group[0]
        outs = [
            CompletionOutput(
                s.index, s.output_text, s.output_token_ids, s.finish_reason, s.stop_reason,
                None if s.logprobs is None else list(s.logprobs), s.cumulative_logprob,
            )
            for s in group
        ]
        return RequestOutput(
            request_id=first.group_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outs,
            finished=all(s.status == SequenceStatus.FINISHED for s in group),
            metrics=first.metrics if len(group) == 1 else merged_metrics([s.metrics for s in group]),
            prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
        )


def row_context(seq: Sequence) -> RowContext:
    """What the logits processors need to score ``seq``'s next token."""
    allowed = seq.grammar.allowed_tokens() if seq.grammar is not None else None
    return RowContext(seq.params, seq.token_ids, seq.num_prompt_tokens, seq.stop_ids, allowed)


def merged_metrics(parts: list[RequestMetrics]) -> RequestMetrics:
    """One request's metrics over its n sequences: counts add up; time to first token is the earliest, the
    end-to-end time the latest (None until every sequence finished)."""
    m = RequestMetrics(num_prompt_tokens=parts[0].num_prompt_tokens)
    for name in ("num_cached_prompt_tokens", "num_output_tokens", "num_target_steps", "num_draft_tokens",
                 "num_accepted_tokens", "num_drafts", "num_preemptions", "num_lossy_tokens"):
        setattr(m, name, sum(getattr(p, name) for p in parts))
    m.accepted_per_pos = [sum(c) for c in itertools.zip_longest(*(p.accepted_per_pos for p in parts), fillvalue=0)]
    ttfts = [p.ttft_s for p in parts if p.ttft_s is not None]
    m.ttft_s = min(ttfts) if ttfts else None
    e2e = [p.e2e_s for p in parts]
    m.e2e_s = None if any(t is None for t in e2e) else max(e2e)  # type: ignore[type-var]
    return m


__all__ = ["PROMPT_LOGPROB_ROWS", "EngineStats", "OutputAssembler", "merged_metrics", "row_context"]
