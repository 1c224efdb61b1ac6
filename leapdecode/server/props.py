"""What llama-server users read from ``GET /props`` and ``GET /slots``: the server's fixed properties (model,
context, chat template, the defaults a request gets, the kernel plan, the KV cache, the speculative method) and
the state of every sequence in the engine (tokens so far, context, its speculative method and acceptance).

The slot states are made on the engine thread (:func:`slot_states`, published with the engine's gauges after
every iteration), so a handler never reads the engine while it steps. A slot is one sequence (a request with
``n`` > 1 has n), numbered in the order the engine took them; nothing of a prompt's text is shown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel

import leapdecode
from leapdecode.engine.llm_engine import LLMEngine
from leapdecode.engine.sequence import Sequence, SequenceStatus
from leapdecode.kernels import extension
from leapdecode.models.llama import MLP, Attention, DecoderLayer, RMSNorm
from leapdecode.speculative.registry import METHODS


@dataclass(frozen=True)
class SpeculativeSlot:
    """A sequence's speculative decoding so far: ``method`` (``off`` when the request opted out or the server has
    none), verifications of a non-empty draft, draft and accepted tokens, and for ``auto`` the methods that drafted
    (target steps each)."""

    method: str
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_tokens: float = 1.0
    draft_methods: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SlotState:
    """One sequence in the engine. ``state``: ``waiting`` (not scheduled yet, or preempted), ``prefilling``
    (its prompt's KV being computed) or ``decoding``; ``n_ctx`` is the context a sequence may fill;
    ``n_decoded`` the tokens generated so far, ``max_tokens`` its limit."""

    id: int
    request_id: str
    index: int
    state: str
    n_ctx: int
    n_prompt_tokens: int
    n_cached_prompt_tokens: int
    n_computed_tokens: int
    n_decoded: int
    max_tokens: int
    temperature: float
    top_p: float
    speculative: SpeculativeSlot


def _state(seq: Sequence) -> str:
    if seq.status != SequenceStatus.RUNNING:
        return "waiting"
    return "prefilling" if seq.num_computed_tokens < seq.num_prompt_tokens else "decoding"


def _speculative(engine: LLMEngine, seq: Sequence) -> SpeculativeSlot:
    cfg = engine.config.speculative_config
    if cfg is None or not seq.params.speculative:
        return SpeculativeSlot("off")
    m = seq.metrics
    return SpeculativeSlot(cfg.method, m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens, m.acceptance_rate,
                           m.mean_accepted_tokens, dict(m.draft_methods))


def slot_states(engine: LLMEngine) -> tuple[SlotState, ...]:
    """Every unfinished sequence of ``engine`` (call on the thread that steps it)."""
    seqs = sorted((s for group in engine.requests.values() for s in group if not s.is_finished),
                  key=lambda s: s.arrival)
    return tuple(
        SlotState(
            id=i, request_id=s.group_id, index=s.index, state=_state(s), n_ctx=engine.max_model_len,
            n_prompt_tokens=s.num_prompt_tokens, n_cached_prompt_tokens=s.metrics.num_cached_prompt_tokens,
            n_computed_tokens=s.num_computed_tokens, n_decoded=s.num_output_tokens, max_tokens=s.params.max_tokens,
            temperature=s.params.temperature, top_p=s.params.top_p, speculative=_speculative(engine, s),
        )
        for i, s in enumerate(seqs)
    )


def drafter_memory(engine: LLMEngine) -> dict[str, int]:
    """Bytes each of the engine's drafters holds (its weights, tables or tries; call on the engine thread)."""
    proposers = getattr(engine.speculator, "proposers", None) or {}
    return {name: int(p.memory_bytes()) for name, p in proposers.items()}


def kernel_plan(engine: LLMEngine) -> dict[str, Any]:
    """Which compute paths the target model takes (``models/kernel_plan.py``), counted by kind."""
    modules = list(engine.model.modules())
    return {
        "device": str(engine.device),
        "dtype": str(engine.config.dtype),
        "threads": engine.num_threads,
        "linear_kernel": engine.config.linear_kernel,
        "kernels_built": extension.ext is not None,
        "packed_projections": engine.num_packed_linears,
        "op_kernels": sum(bool(getattr(m, "use_kernel", False)) for m in modules
                          if isinstance(m, (RMSNorm, Attention, MLP))),
        "fused_decoder_layers": sum(bool(m.use_kernel) for m in modules if isinstance(m, DecoderLayer)),
        "int8_activations": bool(getattr(engine.model, "int8_activations", False)),
    }


class SlotsResponse(BaseModel):
    """``GET /slots``: every sequence in the engine."""

    object: str = "list"
    data: list[dict[str, Any]]


class PropsResponse(BaseModel):
    """``GET /props``."""

    model: str
    n_ctx: int
    total_slots: int
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    default_generation_settings: dict[str, Any]
    speculative: dict[str, Any] | None
    kernel_plan: dict[str, Any]
    kv_cache: dict[str, Any]
    build_info: str


def default_generation_settings(engine: LLMEngine, share_output: bool) -> dict[str, Any]:
    """What a request that sets nothing gets (OpenAI's defaults, as the completion routes apply them)."""
    return {
        "n_ctx": engine.max_model_len,
        "params": {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "n": 1, "seed": None,
            "max_tokens": None,  # None: as many as fit the context and the KV cache
            "speculative": engine.config.speculative_config is not None, "share_output": share_output,
        },
    }


def props(engine: LLMEngine, name: str, share_output: bool, memory: dict[str, int]) -> PropsResponse:
    """``GET /props`` of the server of ``engine`` under the served ``name`` (``memory``: bytes per drafter)."""
    cfg, tok, bm = engine.config, engine.tokenizer, engine.block_manager
    spec = cfg.speculative_config
    speculative = None
    if spec is not None:
        method = METHODS.get(spec.method)  # every option group it reads, the defaults of those not given too
        kinds = method.options if method is not None else tuple(type(g) for g in spec.groups)
        groups = {kind.__name__: asdict(spec.options(kind)) for kind in kinds}
        speculative = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                       "use_cost_model": spec.use_cost_model, "options": groups, "drafter_memory_bytes": memory}
    return PropsResponse(
        model=name,
        n_ctx=engine.max_model_len,
        total_slots=cfg.max_num_seqs,
        chat_template=getattr(tok, "chat_template", None),
        bos_token=getattr(tok, "bos_token", None),
        eos_token=getattr(tok, "eos_token", None),
        default_generation_settings=default_generation_settings(engine, share_output),
        speculative=speculative,
        kernel_plan=kernel_plan(engine),
        kv_cache={"blocks": bm.num_blocks, "block_size": bm.block_size, "dtype": str(cfg.kv_cache_dtype),
                  "max_num_batched_tokens": cfg.max_num_batched_tokens},
        build_info=f"leapdecode {leapdecode.__version__}",
    )


__all__ = ["PropsResponse", "SlotState", "SlotsResponse", "SpeculativeSlot", "drafter_memory", "kernel_plan",
           "props", "slot_states"]
