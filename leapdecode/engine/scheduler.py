"""Continuous batching under one token budget (vLLM v1 style).

Every step the scheduler hands out at most ``max_num_batched_tokens`` new tokens. One rule covers prefill,
chunked prefill, decode and draft tokens: a sequence needs ``num_tokens - num_computed_tokens`` tokens
computed (the whole prompt when it arrives, the last sampled token when decoding), plus the draft tokens it
may verify.

Fairness is first-come-first-served by arrival:
1. running sequences, oldest first, each get their tokens (a long prefill is cut into chunks of what is left);
2. then waiting sequences, oldest first, are admitted while budget, sequence slots and KV blocks last. The
   queue head is never skipped for a younger, smaller request, so no request starves whatever its length.

When a running sequence cannot get the KV blocks it needs, the *newest* running sequence is preempted: its
blocks are freed and it goes back to the waiting queue in arrival order, to be recomputed later from its
tokens (prompt + what it has generated so far, so nothing is lost; prefix caching often makes the recompute
cheap).
No waiting request is admitted in a step that preempted one.

The completions of a request with ``n > 1`` queue one after another; the second waits at the queue head until
the first has prefilled the prompt, so the others find its blocks in the prefix cache and compute only the
prompt's last, partial block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.sequence import Sequence, SequenceStatus
from leapdecode.engine.swap import HostKVPool


def _prefilling(seq: Sequence) -> bool:
    """Its prompt is not all in the cache yet (and it is still alive)."""
    return seq.status != SequenceStatus.FINISHED and seq.num_computed_tokens < seq.num_prompt_tokens


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens of seq.token_ids computed this step (excluding drafts)
    spec_budget: int = 0  # room reserved for draft tokens to verify after the last token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.spec_budget for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        swap: HostKVPool | None = None,
    ) -> None:
        self.bm = block_manager
        self.swap = swap  # host tier: preempted sequences swap out instead of recomputing (when it has room)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def decoding(self) -> list[Sequence]:
        """The running sequences whose next step computes one token (their last): those that may verify drafts."""
        return [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]

    def schedule(self, draft_limits: Mapping[str, int] | None = None) -> SchedulerOutput:
        """Plan one step. ``draft_limits`` (request id -> tokens; plain data, given before the step) says how many
        draft tokens a decoding sequence would like to verify; the budget reserved for them is the *most* that
        will run (drafters may propose fewer)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = sorted(self.running, key=lambda s: s.arrival)
        kept: list[Sequence] = []
        while running:
            seq = running.pop(0)
            if budget <= 0:
                kept.append(seq)
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            k = 0
            if n == 1 and draft_limits:
                k = max(0, min(draft_limits.get(seq.request_id, 0), budget - 1))
            # make room, preempting the newest running sequences (possibly this one) until it fits
            while not self.bm.can_allocate(seq, seq.num_computed_tokens + n + k):
                if k:
                    k = 0  # first give up speculation for this step
                    continue
                victim = running.pop() if running else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self.bm.allocate(seq, seq.num_computed_tokens + n + k)
            out.scheduled.append(ScheduledSeq(seq, n, k))
            kept.append(seq)
            budget -= n + k
        self.running = kept
        if out.preempted:
            # blocks are short: admitting now would only hand the freed blocks to a newer request (or re-admit
            # the one just preempted) and preempt again next step
            return out

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.prefix_leader is not None:
                if _prefilling(seq.prefix_leader):
                    break  # FCFS: the next completion of a request waits to share its first one's prompt blocks
                seq.prefix_leader = None
            if seq.swap_handle is not None:
                if not self._swap_in(seq):
                    break  # FCFS: the oldest waits for blocks
            elif not seq.block_table and seq.num_computed_tokens == 0 and seq.prompt_logprobs is None:
                # (a request scoring its prompt needs every prompt position's logits: no cache hits)
                cached = self.bm.match_prefix(seq)
                seq.num_computed_tokens = cached
                seq.metrics.num_cached_prompt_tokens = max(
                    seq.metrics.num_cached_prompt_tokens, min(cached, seq.num_prompt_tokens)
                )
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            room = self.bm.num_free_blocks + len(seq.block_table)
            fit = room * self.bm.block_size - seq.num_computed_tokens
            if fit < n:
                # alone in the engine, a prompt larger than the free pool is prefilled in chunks that fit;
                # otherwise FCFS says wait for blocks rather than let a younger request jump ahead
                if self.running or fit < 1:
                    # do not pin cache-hit blocks while waiting: they stay cached (ref 0), matched again later
                    self.bm.free(seq)
                    seq.num_computed_tokens = 0
                    break
                n = fit
            self.waiting.popleft()
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, 0))
            budget -= n
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if self.swap is not None and seq.num_computed_tokens > 0:
            # keep the computed KV in the host tier instead of recomputing it later
            n = seq.num_computed_tokens
            seq.swap_handle = self.swap.swap_out(seq.block_table[: self.bm.blocks_needed(n)], n)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        out.preempted.append(seq)
        # back into the queue by arrival order, so it is next in line when it is the oldest
        items = list(self.waiting) + [seq]
        self.waiting = deque(sorted(items, key=lambda s: s.arrival))

    def _swap_in(self, seq: Sequence) -> bool:
        """Bring a swapped-out sequence's KV back into fresh device blocks; False if they do not fit yet."""
        handle = seq.swap_handle
        assert handle is not None and self.swap is not None
        # its next token must fit too, else it would be preempted again at once
        if not self.bm.can_allocate(seq, handle.num_tokens + 1):
            return False
        self.bm.allocate(seq, handle.num_tokens)
        self.swap.swap_in(handle, seq.block_table)
        seq.num_computed_tokens = handle.num_tokens
        seq.block_hashes = []  # re-registered by commit_full_blocks as the sequence runs
        seq.swap_handle = None
        return True

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        if seq.swap_handle is not None and self.swap is not None:
            self.swap.release(seq.swap_handle)
            seq.swap_handle = None
        seq.status = SequenceStatus.FINISHED
