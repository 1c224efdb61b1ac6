"""Result objects returned by ``LLM.generate`` / ``LLM.chat`` (names mirror vLLM)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    """Per-request counters. ``mean_accepted_tokens`` is output tokens per target step (1.0 without speculation)."""

    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_target_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # verifications of a non-empty draft, and how many of them accepted the draft at position i (0-based), i.e.
    # accepted more than i tokens: vLLM's spec_decode_num_drafts and _num_accepted_tokens_per_pos
    num_drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # drafts a lossy acceptance rule (blockwise top-k) kept although the target ranked another token first:
    # 0 for every lossless method, so a nonzero count is the per-request sign of drift
    num_lossy_tokens: int = 0
    # speculative "auto" (speculative/router.py): the route taken (task, branch of the decision tree, candidates,
    # departures), target steps each method drafted for, and how often the copy detector switched domain
    route: str | None = None
    draft_methods: dict[str, int] = field(default_factory=dict)
    num_domain_switches: int = 0
    # auto's difficulty-driven compute path ("compute_path": "difficulty"): decoding steps per path chosen (plain,
    # speculative, self_draft)
    compute_paths: dict[str, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        return self.num_output_tokens / self.num_target_steps if self.num_target_steps else 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_tokens"] = self.mean_accepted_tokens
        return d


@dataclass
class Logprob:
    """One token's log-probability at one position; ``rank`` is 1 for the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one position: the chosen token and the top-k tokens, by id
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions. ``logprobs`` (when asked for) has one entry per token of
    ``token_ids``; ``cumulative_logprob`` is the sum of the chosen tokens' log-probabilities."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # one entry per prompt token (the first is None: nothing predicts it), when prompt_logprobs was asked for
    prompt_logprobs: list[PositionLogprobs | None] | None = None
