"""Architecture description of a decoder, read from an HF ``config.json`` dict.

Every family the engine runs (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) is a pre-norm decoder with rotary
positions; what differs is a handful of switches (q/k norms, Gemma's extra norms around each block, the MLP's
activation, per-layer sliding windows and RoPE bases, scales and soft-capping). :meth:`ModelConfig.from_hf` reads
them per family and refuses any setting the decoder cannot honour, naming it: a field silently ignored would give
wrong output without a word.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> family
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> the MLP's
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style q/k/v bias
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"
    family: str = "llama"
    # per layer: the sliding window (a token sees itself and the window - 1 positions before it), None = global
    layer_windows: list[int | None] = field(default_factory=list)
    local_rope_theta: float | None = None  # RoPE base of the windowed layers when it differs (Gemma 3)
    hidden_act: str = "silu"  # "silu" or "gelu_tanh"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 3)
    norm_offset: float = 0.0  # HF checkpoints store RMSNorm weights as w - offset (Gemma: the norm scales by 1 + w)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    query_scale: float | None = None  # attention scale; None = head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = [None] * self.num_hidden_layers
        if len(self.layer_windows) != self.num_hidden_layers:
            # a copy with another layer count (a drafter's own cache) keeps a window every layer shared
            if len(set(self.layer_windows)) != 1:
                raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_hidden_layers} layers")
            self.layer_windows = [self.layer_windows[0]] * self.num_hidden_layers

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; leapdecode runs these decoders: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        _refuse_unsupported(d, family)
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        gemma = family == "gemma3"
        rope_theta, rope_scaling, local_theta = _rope_settings(d, family)
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        act_name = d.get("hidden_activation" if gemma else "hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act_name not in ACTIVATIONS:
            raise ValueError(f"{arch}: activation {act_name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        scalar = d.get("query_pre_attn_scalar") if gemma else None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6 if family in ("gemma3", "qwen3", "mistral") else 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=d.get("tie_word_embeddings", gemma),
            attention_bias=bool(d.get("attention_bias", family == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            family=family,
            layer_windows=_layer_windows(d, family),
            local_rope_theta=local_theta,
            hidden_act=ACTIVATIONS[act_name],
            qk_norm=family in ("qwen3", "gemma3"),
            sandwich_norms=gemma,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=float(d["hidden_size"]) ** 0.5 if gemma else None,
            query_scale=None if scalar is None else float(scalar) ** -0.5,
            final_logit_softcap=d.get("final_logit_softcapping") if gemma else None,
        )

    def attention_windows(self) -> list[int]:
        """The distinct sliding windows of the layers (empty: every layer attends to the whole context)."""
        return sorted({w for w in self.layer_windows if w is not None})

    def num_params(self, include_embeddings: bool = True) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + (4 if self.sandwich_norms else 2) * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        n = L * per_layer + h
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element


def _refuse_unsupported(d: dict[str, Any], family: str) -> None:
    """Settings the decoder would otherwise ignore, each refused by name."""
    refusals = {
        "attn_logit_softcapping": "soft-capped attention scores",
        "use_bidirectional_attention": "bidirectional attention",
        "mlp_bias": "biases in the MLP",
    }
    for key, what in refusals.items():
        if d.get(key):
            raise ValueError(f"{family} config sets {key}={d[key]!r}: {what} are not supported by leapdecode")
    if family != "gemma3" and d.get("final_logit_softcapping"):
        raise ValueError(f"{family} config sets final_logit_softcapping, which this family does not use")
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    factor = d.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ValueError(f"{family} config sets partial_rotary_factor={factor}: RoPE over part of each head is not "
                         "supported by leapdecode")


def _layer_windows(d: dict[str, Any], family: str) -> list[int | None]:
    """Per layer, the sliding window HF transformers applies, or None (global attention)."""
    n = d["num_hidden_layers"]
    window = d.get("sliding_window")
    if family in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None  # (the config keeps a sliding_window value that is not used)
    if family in ("llama",):
        window = None  # Llama has no sliding window (HF ignores the key too)
    types = d.get("layer_types")
    if types is None:
        if family == "gemma3":
            pattern = d.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        elif family in ("qwen2", "qwen3"):
            first = d.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        else:
            types = ["sliding_attention"] * n
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types {types!r} must name {n} layers, each one of {LAYER_TYPES}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive number of positions, got {window!r}")
    return [window if t == "sliding_attention" else None for t in types]


def _rope_settings(d: dict[str, Any], family: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """(theta, scaling, theta of the windowed layers or None) from either config layout: transformers < 5 writes
    ``rope_theta`` + ``rope_scaling`` (+ Gemma's ``rope_local_base_freq``), transformers >= 5 one
    ``rope_parameters`` dict (for Gemma 3 one per layer type)."""
    params = d.get("rope_parameters")
    local: float | None = None
    if family == "gemma3":
        if isinstance(params, dict) and "full_attention" in params:
            sliding = params.get("sliding_attention") or {}
            if _scaling_of(sliding) is not None:
                raise ValueError("gemma3 config scales the RoPE of the sliding-window layers: not supported")
            local = float(sliding.get("rope_theta", 10000.0))
            params = params["full_attention"]
        else:
            local = float(d.get("rope_local_base_freq", 10000.0))
        default_theta = 1_000_000.0
    else:
        default_theta = 10000.0
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", d.get("rope_theta", default_theta)))
        return theta, _scaling_of(params), local
    return float(d.get("rope_theta", default_theta)), _scaling_of(d.get("rope_scaling") or {}), local


def _scaling_of(params: dict[str, Any]) -> dict[str, Any] | None:
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else scaling
