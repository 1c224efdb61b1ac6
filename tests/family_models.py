"""Tiny random models of each supported family, built with HF transformers (the reference), saved as an HF folder and
written as a GGUF file the way llama.cpp's converter writes that family (tensor names, metadata, Llama's Q/K row
permutation, Gemma's norms stored as 1 + w, Phi-3's fused tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

VOCAB = 512
WINDOW = 8  # short, so that a 30-token prompt crosses it several times

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)

# family -> (HF config overrides, GGUF architecture)
FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "mistral": ({"sliding_window": WINDOW, "rope_theta": 10000.0}, "llama"),
    "qwen3": ({"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 0, "head_dim": 16,
               "num_hidden_layers": 3, "rope_theta": 10000.0}, "qwen3"),
    "phi3": ({"sliding_window": WINDOW, "rope_theta": 10000.0, "pad_token_id": 0}, "phi3"),
    # six layers: llama.cpp fixes the pattern at five windowed layers, then a global one; and the query scale at
    # head_dim ** -0.5, which HF reads a GGUF file with only when query_pre_attn_scalar keeps its default, 256
    "gemma3": ({"sliding_window": WINDOW, "num_hidden_layers": 6, "head_dim": 256, "query_pre_attn_scalar": 256,
                "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "pad_token_id": 0,
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
               "gemma3"),
}


def build_hf(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    import transformers

    cfg_cls, model_cls = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]
    cfg = cfg_cls(**{**BASE, **FAMILIES[family][0], **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # widen the tiny init so that logits are far from uniform; make every norm matter
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(4.0)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for its "llama" architecture (HF's rotate-half pairs made adjacent)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: torch.nn.Module, path: Path, matrix_type: str = "F32",
               extra: dict[str, np.ndarray] | None = None, eot_token_id: int | None = None) -> Path:
    """``model`` (from :func:`build_hf`, or an HF Llama) as a GGUF file in llama.cpp's layout for its family: norms
    in float32, matrices (the embedding included) in ``matrix_type`` ("F32" or a block type gguf can quantize to),
    plus the ``extra`` tensors (and ``tokenizer.ggml.eot_token_id`` when given)."""
    cfg = model.config
    family = {"llama": "llama", "mistral": "mistral", "qwen3": "qwen3", "phi3": "phi3",
              "gemma3_text": "gemma3"}[cfg.model_type]
    arch = "llama" if family in ("llama", "mistral") else family
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny {family}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float((rope.get("full_attention") or rope)["rope_theta"]))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if eot_token_id is not None:
        w.add_eot_token_id(eot_token_id)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = _tensor_names(family, cfg.num_hidden_layers)
    for hf_name, gguf_name in names.items():
        if hf_name not in sd or (hf_name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        a = sd[hf_name]
        if family == "gemma3" and hf_name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp stores Gemma's norm weights as the scale they multiply by
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            a = _permute(a, heads)
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim == 2 and matrix_type != "F32":
            kind = GGMLQuantizationType[matrix_type]
            w.add_tensor(gguf_name, quantize(a, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, a)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensor_names(family: str, layers: int) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {
        "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q",
        "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
        "self_attn.o_proj.weight": "attn_output", "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
        "mlp.down_proj.weight": "ffn_down", "post_attention_layernorm.weight": "ffn_norm",
        "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
        "self_attn.qkv_proj.weight": "attn_qkv", "mlp.gate_up_proj.weight": "ffn_up",
    }
    if family == "gemma3":
        per_layer.update({"post_attention_layernorm.weight": "post_attention_norm",
                          "pre_feedforward_layernorm.weight": "ffn_norm",
                          "post_feedforward_layernorm.weight": "post_ffw_norm"})
    for i in range(layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}.weight"
    return names
