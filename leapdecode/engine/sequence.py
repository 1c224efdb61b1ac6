"""One request's state as it moves through the engine."""

from __future__ import annotations

import hashlib
import itertools
import time
from enum import Enum

import torch

from leapdecode.engine.detokenizer import IncrementalDetokenizer
from leapdecode.outputs import PositionLogprobs, RequestMetrics
from leapdecode.sampling_params import SamplingParams
from leapdecode.structured.base import GrammarMatcher

_arrival = itertools.count()


def sample_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request seeded with ``seed``: the seed itself for the first (so
    ``n=1`` keeps its stream), a hash of (seed, index) for the others, so each draws an independent stream."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, KV position and generation state of one request.

    Invariants: ``token_ids = prompt_token_ids + output_token_ids``; positions ``< num_computed_tokens`` have valid
    K/V in the cache blocks of ``block_table``; ``num_computed_tokens <= len(token_ids)``. A decode step computes the
    last token (plus any draft tokens) and appends what it samples.

    A request with ``n > 1`` runs as n sequences: ``group_id`` is the request's id, ``index`` the completion's
    number and ``request_id`` unique per sequence (the request's id itself when n is 1). ``prefix_leader`` is the
    group's first sequence while this one waits for it to prefill the shared prompt into the prefix cache.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        group_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.group_id = request_id if group_id is None else group_id
        self.index = index
        self.prefix_leader: Sequence | None = None
        self.group: list[Sequence] = [self]  # the request's sequences (shared list), this one included
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full, computed blocks (prefix cache)
        self.swap_handle = None  # a SwapHandle (engine/swap.py) while its KV waits in the host tier
        self.status = SequenceStatus.WAITING
        self.arrival = next(_arrival)
        self.arrival_time = time.perf_counter()
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.output_text = ""
        self.detokenizer: IncrementalDetokenizer | None = None  # made by the engine on the first output token
        self.metrics = RequestMetrics(num_prompt_tokens=len(prompt_token_ids))
        self.stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            self.stop_ids |= set(eos_token_ids)
        # seeded requests own their random stream, so their samples do not depend on the batch they ride in
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(sample_seed(params.seed, index))
        # log-probabilities (when asked for): one entry per output token; prompt ones filled by position
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        if params.prompt_logprobs is not None and index == 0:
            self.prompt_logprobs = [None] * len(prompt_token_ids)
        self.grammar: GrammarMatcher | None = None  # structured output: set by the engine

    # ------------------------------------------------------------------------------------------------ views
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, {self.status.value})"
        )
