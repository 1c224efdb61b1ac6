"""Architecture description of a Llama-family decoder, read from an HF ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


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

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; leapdecode runs Llama-family decoders: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        heads = d["num_attention_heads"]
        rope_theta, rope_scaling = _rope_settings(d)
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", SUPPORTED_ARCHITECTURES[arch] == "qwen2"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )

    def num_params(self, include_embeddings: bool = True) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        n = L * per_layer + h
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element


def _rope_settings(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either config layout: transformers < 5 writes ``rope_theta`` + ``rope_scaling``,
    transformers >= 5 writes one ``rope_parameters`` dict holding ``rope_theta`` and the scaling keys."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        return theta, (None if kind == "default" else scaling)
    scaling = d.get("rope_scaling") or None
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(d.get("rope_theta", 10000.0)), scaling
