"""Trained drafters on disk: one artifact format for every kind, saving, loading, fingerprints and the shipped ones.

An artifact is a folder with

- ``config.json``: ``"type"`` (what it holds: ``ADAPTER_TYPE`` or ``HEADS_TYPE``), the shapes it needs of its
  target, a fingerprint of the target it was trained on, held-out validation, and the method's own settings;
- one safetensors file of weights (``adapter.safetensors`` or ``heads.safetensors``);
- ``record.json``: how it was made (the exact command, data digest and manifest, seed, history, timings).

Three kinds: an *exit adapter* (``ExitAdapter``: self_spec's exit, a trained small draft, EAGLE's feature draft),
*heads* (``MedusaHeads``: Medusa trees, a hybrid's branches) and *block heads* (``BlockHeads``: blockwise
decoding's proposals, with their block-causal attention layer). Folders in the format before
this one are refused with an error that says to retrain (every shipped artifact uses this one).

The package ships one artifact per method for the bundled SmolLM2-135M-Instruct under ``leapdecode/artifacts/``;
a shipped artifact is only offered (``auto``, a method without ``"model"``) to the target it was trained on.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from leapdecode.atomic_files import (
    begin_folder_write,
    finish_folder_write,
    replace_in_folder,
    save_tensors_atomic,
    verify_folder,
    write_json_atomic,
)
from leapdecode.models.config import ModelConfig
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.speculative.block_heads import BlockHeads
from leapdecode.speculative.exit_adapter import ExitAdapter
from leapdecode.speculative.heads import MedusaHeads

ARTIFACTS_ROOT = Path(__file__).resolve().parent.parent / "artifacts"
SELF_SPEC_DIR = ARTIFACTS_ROOT / "self_spec"  # the exit adapter (``leapdecode train self-spec``)
DRAFT_DIR = ARTIFACTS_ROOT / "draft_model"  # the small draft: an adapter with L = 0 (``leapdecode train draft-model``)
EAGLE_DIR = ARTIFACTS_ROOT / "eagle"  # the feature-conditioned draft (``leapdecode train eagle``)
MEDUSA_DIR = ARTIFACTS_ROOT / "medusa"  # pyramid heads (``leapdecode train medusa``)
BLOCKWISE_DIR = ARTIFACTS_ROOT / "blockwise"  # block heads (``leapdecode train blockwise``)
# per kind of adapter drafter, the command that trains one
TRAIN_COMMANDS = {"self_spec": "`leapdecode train self-spec`", "draft_model": "`leapdecode train draft-model`",
                  "eagle": "`leapdecode train eagle`"}

CONFIG_FILE = "config.json"
RECORD_FILE = "record.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
HEADS_WEIGHTS = "heads.safetensors"
ADAPTER_TYPE = "leapdecode.exit_adapter"
HEADS_TYPE = "leapdecode.medusa_heads"
BLOCK_HEADS_TYPE = "leapdecode.blockwise_heads"  # BlockHeads: blockwise decoding's block-causal proposal heads
# the target's architecture fields an adapter must match to run on it
ARCH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size")


def shipped_dir(kind: str) -> Path:
    """Where the shipped adapter of ``kind`` lives (looked up on each call, so tests can point it elsewhere)."""
    return {"self_spec": SELF_SPEC_DIR, "draft_model": DRAFT_DIR, "eagle": EAGLE_DIR}[kind]


# --------------------------------------------------------------------------------------------- the format
def write_artifact(folder: str | Path, kind: str, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                   record: dict[str, Any] | None = None) -> Path:
    """Write one artifact folder: the weights, ``config.json`` with its ``type`` first, and ``record.json``, each
    atomically, then the manifest of their digests (atomic_files.py: an interrupted write is refused on load)."""
    folder = begin_folder_write(folder)
    weights = ADAPTER_WEIGHTS if kind == ADAPTER_TYPE else HEADS_WEIGHTS
    save_tensors_atomic(folder / weights, tensors)
    write_json_atomic(folder / CONFIG_FILE, {"type": kind, **config})
    names = [weights, CONFIG_FILE]
    if record is not None:
        write_json_atomic(folder / RECORD_FILE, record)
        names.append(RECORD_FILE)
    finish_folder_write(folder, names)
    return folder


def write_record(folder: str | Path, record: dict[str, Any]) -> None:
    replace_in_folder(folder, RECORD_FILE, (json.dumps(record, indent=2) + "\n").encode("utf-8"))


def read_record(folder: str | Path) -> dict[str, Any]:
    """How the artifact in ``folder`` was made (``record.json``)."""
    path = Path(folder) / RECORD_FILE
    if path.is_file():
        return _read_json(path)
    raise FileNotFoundError(f"{folder} has no {RECORD_FILE}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}); retrain or restore the artifact") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    verify_folder(path.parent)  # the weights and configs of one complete write
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise ValueError(f"{path} is not a readable safetensors file ({e}); retrain or restore the artifact") from None


def artifact_type(cfg: dict[str, Any]) -> str | None:
    """The kind a config says it holds (``ADAPTER_TYPE`` or ``HEADS_TYPE``; None: not an artifact's config)."""
    t = cfg.get("type")
    return t if isinstance(t, str) else None


# ------------------------------------------------------------------------------------------- fingerprints
def target_fingerprint(model: LlamaForCausalLM) -> list[float]:
    """A few norm-weight sums that identify a checkpoint (norms stay float even in quantized GGUF files, so a
    GGUF and its HF original agree); used to offer a shipped adapter only to the model it was trained on."""
    vals = [model.norm.weight, model.layers[0].input_layernorm.weight, model.layers[-1].post_attention_layernorm.weight]
    return [float(w.detach().double().sum()) for w in vals]


def lm_head_fingerprint(weight: torch.Tensor) -> list[float]:
    """A few sums of the LM head (the heads' own read-out), to tell heads trained on another model of the same
    shape."""
    w = weight.detach().float().cpu()
    return [round(float(w[:256].sum()), 3), round(float(w[-256:].abs().sum()), 3)]


def _adapter_fingerprint_matches(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-3) for x, y in zip(a, b))


def _head_fingerprint_matches(stored: list[float], here: list[float]) -> bool:
    return all(abs(a - b) <= 1e-2 * max(1.0, abs(a)) for a, b in zip(stored, here))


def arch_of(cfg: ModelConfig) -> dict[str, int]:
    return {f: int(getattr(cfg, f)) for f in ARCH_FIELDS}


# --------------------------------------------------------------------------------------------- adapters
def save_adapter(adapter: ExitAdapter, folder: str | Path, target: LlamaForCausalLM, extra: dict[str, Any],
                 vocab_ranked: torch.Tensor | None = None) -> Path:
    """Write an adapter artifact (weights in the engine's fused layout, plus the frequency-ranked vocabulary if
    given); returns the folder."""
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapter.state_dict().items()}
    if vocab_ranked is not None:
        tensors["vocab_ranked"] = vocab_ranked.to("cpu", torch.int64).contiguous()
    config = {
        "layer": adapter.layer_index,
        "num_layers": adapter.num_layers,
        "input": "features" if adapter.feature_input else "hidden",
        "arch": arch_of(adapter.config),
        "target_fingerprint": target_fingerprint(target),
        **extra,
    }
    return write_artifact(folder, ADAPTER_TYPE, tensors, config)


def read_adapter_config(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(
            f"{folder} is not a self_spec adapter folder (needs {CONFIG_FILE} and {ADAPTER_WEIGHTS}); train one with "
            "`leapdecode train self-spec`"
        )
    cfg = _read_json(path)
    if artifact_type(cfg) != ADAPTER_TYPE:
        raise ValueError(f"{path} is not a self_spec exit adapter (type {cfg.get('type')!r})")
    for key in ("layer", "arch"):
        if key not in cfg:
            raise ValueError(f"{path} lacks {key!r}: the artifact is incomplete; retrain it")
    return cfg


def is_adapter_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a drafter written by ``leapdecode train self-spec`` / ``train draft-model``."""
    try:
        read_adapter_config(path)
        return True
    except (FileNotFoundError, ValueError, OSError):
        return False


def is_feature_draft(path: str | Path) -> bool:
    """Whether ``path`` holds a feature-conditioned (EAGLE) draft."""
    return is_adapter_folder(path) and read_adapter_config(path).get("input") == "features"


def check_compatible(cfg: dict[str, Any], target: LlamaForCausalLM) -> None:
    want, have = cfg["arch"], arch_of(target.config)
    diff = {k: (want.get(k), v) for k, v in have.items() if want.get(k) != v}
    if diff:
        raise ValueError(
            "this self_spec adapter was trained for another model architecture "
            + ", ".join(f"{k}: adapter {a} vs target {b}" for k, (a, b) in diff.items())
        )


def load_adapter(
    folder: str | Path, target: LlamaForCausalLM
) -> tuple[ExitAdapter, dict[str, Any], torch.Tensor | None]:
    """The adapter on the target's device and dtype, its config, and the ranked vocabulary (or None)."""
    cfg = read_adapter_config(folder)
    check_compatible(cfg, target)
    tensors = _load_tensors(Path(folder) / ADAPTER_WEIGHTS)
    ranked = tensors.pop("vocab_ranked", None)
    # one-layer adapters written before adapters could have several layers named it "layer"
    tensors = {("layers.0." + k[len("layer."):] if k.startswith("layer.") else k): v for k, v in tensors.items()}
    adapter = ExitAdapter(target.config, int(cfg["layer"]), int(cfg.get("num_layers", 1)),
                          feature_input=cfg.get("input") == "features")
    p = next(target.parameters())
    adapter.to(device=p.device, dtype=p.dtype)
    params = dict(adapter.named_parameters())
    missing = set(params) - set(tensors)
    if missing:
        raise ValueError(f"{folder}/{ADAPTER_WEIGHTS} lacks {sorted(missing)}")
    with torch.no_grad():
        for name, prm in params.items():
            prm.copy_(tensors[name])
    return adapter.eval(), cfg, ranked


def shipped_adapter_path(folder: Path | None = None) -> Path | None:
    """The adapter shipped in ``folder`` (default: the exit adapter), if present."""
    folder = SELF_SPEC_DIR if folder is None else folder
    return folder if (folder / CONFIG_FILE).is_file() and (folder / ADAPTER_WEIGHTS).is_file() else None


def shipped_adapter_for(target: LlamaForCausalLM, folder: Path | None = None) -> Path | None:
    """The shipped adapter (or the drafter in ``folder``) when it was trained for this very target (architecture
    and fingerprint), else None; ``auto`` only offers it then."""
    path = shipped_adapter_path(folder)
    if path is None:
        return None
    try:
        cfg = read_adapter_config(path)
        check_compatible(cfg, target)
    except (ValueError, FileNotFoundError, KeyError):
        return None
    return path if _adapter_fingerprint_matches(cfg.get("target_fingerprint", []), target_fingerprint(target)) \
        else None


# ------------------------------------------------------------------------------------------------ heads
def save_heads(
    folder: str | Path,
    heads: MedusaHeads,
    vocab_subset: torch.Tensor | None,
    meta: dict[str, Any],
    record: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float16,
) -> None:
    """Write a heads artifact (fp16 weights keep the shipped pyramid at ~6.6 MB for d = 576)."""
    tensors = {"weight": heads.weight.detach().to(dtype).contiguous(), "bias": heads.bias.detach().to(dtype)}
    if vocab_subset is not None:
        tensors["vocab_subset"] = vocab_subset.to(torch.int32).contiguous()
    cfg = {"hidden_size": heads.hidden_size, "offsets": heads.offsets, "diversity": heads.diversity, **meta}
    write_artifact(folder, HEADS_TYPE, tensors, cfg, record)


def read_heads_config(folder: str | Path, kind: str = HEADS_TYPE) -> dict[str, Any]:
    """The config of a heads artifact of ``kind`` (``HEADS_TYPE`` or ``BLOCK_HEADS_TYPE``)."""
    folder = Path(folder)
    command = "train blockwise" if kind == BLOCK_HEADS_TYPE else "train medusa"
    if not (folder / HEADS_WEIGHTS).is_file() or not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"no heads in {folder} (need {HEADS_WEIGHTS} and {CONFIG_FILE}); train them with "
            f"`leapdecode {command} --data DIR --out FOLDER`"
        )
    cfg = _read_json(folder / CONFIG_FILE)
    if artifact_type(cfg) != kind:
        raise ValueError(f"{folder}/{CONFIG_FILE} is not a {kind} artifact (type={cfg.get('type')!r}); train one "
                         f"with `leapdecode {command}`")
    for key in ("hidden_size", "offsets"):
        if key not in cfg:
            raise ValueError(f"{folder}/{CONFIG_FILE} lacks {key!r}: the artifact is incomplete; retrain it")
    return cfg


def load_heads(folder: str | Path) -> tuple[MedusaHeads, torch.Tensor | None, dict[str, Any]]:
    """(heads in float32, vocab subset ids or None, config dict) from an artifact folder."""
    cfg = read_heads_config(folder)
    t = _load_tensors(Path(folder) / HEADS_WEIGHTS)
    heads = MedusaHeads(cfg["hidden_size"], cfg["offsets"], cfg.get("diversity", "exclude"))
    missing = {"weight", "bias"} - set(t)
    if missing:
        raise ValueError(f"{folder}/{HEADS_WEIGHTS} lacks {sorted(missing)}")
    with torch.no_grad():
        heads.weight.copy_(t["weight"].float())
        heads.bias.copy_(t["bias"].float())
    subset = t["vocab_subset"].long() if "vocab_subset" in t else None
    return heads.requires_grad_(False).eval(), subset, cfg


def shipped_heads_for(target: LlamaForCausalLM, folder: Path = MEDUSA_DIR, kind: str = HEADS_TYPE) -> Path | None:
    """The shipped heads of ``kind`` in ``folder`` (Medusa's, or blockwise's) when they were trained for this
    target (same shapes and LM-head fingerprint), else None; ``auto`` only offers them then."""
    try:
        meta = read_heads_config(folder, kind)
    except (OSError, ValueError):
        return None
    mcfg = target.config
    if meta.get("hidden_size") != mcfg.hidden_size or meta.get("vocab_size", mcfg.vocab_size) != mcfg.vocab_size:
        return None
    fp = meta.get("base_model", {}).get("lm_head_fingerprint")
    here = lm_head_fingerprint(target.lm_head.get_weight())
    if fp is None or any(abs(a - b) > 1e-2 * max(1.0, abs(b)) for a, b in zip(fp, here)):
        return None
    return folder


def save_block_heads(folder: str | Path, heads: BlockHeads, vocab_subset: torch.Tensor | None, meta: dict[str, Any],
                     record: dict[str, Any] | None = None, dtype: torch.dtype = torch.float16) -> None:
    """Write a block-heads artifact: every parameter of ``heads`` (fp16), the vocabulary subset, and the module's
    settings in config.json."""
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    if vocab_subset is not None:
        tensors["vocab_subset"] = vocab_subset.to(torch.int32).contiguous()
    cfg = {"hidden_size": heads.hidden_size, "offsets": heads.offsets, "block_heads": heads.settings(), **meta}
    write_artifact(folder, BLOCK_HEADS_TYPE, tensors, cfg, record)


def load_block_heads(folder: str | Path) -> tuple[BlockHeads, torch.Tensor | None, dict[str, Any]]:
    """(block heads in float32, vocab subset ids or None, config dict) from a ``leapdecode train blockwise``
    artifact."""
    cfg = read_heads_config(folder, BLOCK_HEADS_TYPE)
    settings = cfg.get("block_heads")
    if not isinstance(settings, dict):
        raise ValueError(f"{folder}/{CONFIG_FILE} lacks 'block_heads': the artifact is incomplete; retrain it")
    heads = BlockHeads(int(cfg["hidden_size"]), **{k: int(v) for k, v in settings.items()})
    t = _load_tensors(Path(folder) / HEADS_WEIGHTS)
    subset = t.pop("vocab_subset").long() if "vocab_subset" in t else None
    params = heads.state_dict()
    if set(t) != set(params) or any(t[k].shape != v.shape for k, v in params.items()):
        raise ValueError(f"{folder}/{HEADS_WEIGHTS} does not hold the block heads its config describes; retrain it")
    heads.load_state_dict({k: v.float() for k, v in t.items()})
    return heads.requires_grad_(False).eval(), subset, cfg


def check_heads_fit(folder: Path, heads: MedusaHeads | BlockHeads, meta: dict[str, Any], target: LlamaForCausalLM,
                    kind: str = "Medusa") -> torch.Tensor:
    """The target's LM-head weight (the heads' own output layer) once the heads are known to fit it: a wrong
    hidden size or vocabulary is an error; heads trained on another model of the same shape (LM-head fingerprint
    differs) only warn, since they still run, just with low acceptance. Shared by every method whose heads come
    from ``leapdecode train medusa`` or ``train blockwise`` (Medusa trees, blockwise chains, hybrid branches)."""
    mcfg = target.config
    if heads.hidden_size != mcfg.hidden_size:
        raise ValueError(
            f"the {kind} heads in {folder} are for hidden size {heads.hidden_size} "
            f"({meta.get('base_model', {}).get('name', 'another model')}), this model has {mcfg.hidden_size}; "
            'pass "model": PATH to heads trained for it (leapdecode train medusa)'
        )
    if meta.get("vocab_size", mcfg.vocab_size) != mcfg.vocab_size:
        raise ValueError(f"the {kind} heads in {folder} are for a {meta['vocab_size']}-token vocabulary, "
                         f"this model has {mcfg.vocab_size}")
    weight = target.lm_head.get_weight()
    fp = meta.get("base_model", {}).get("lm_head_fingerprint")
    if fp is not None and not _head_fingerprint_matches(fp, lm_head_fingerprint(weight)):
        warnings.warn(f"the {kind} heads in {folder} were trained on another model "
                      f"({meta.get('base_model', {}).get('name')}); expect low acceptance", stacklevel=3)
    return weight


__all__ = [
    "ADAPTER_TYPE",
    "BLOCK_HEADS_TYPE",
    "HEADS_TYPE",
    "check_compatible",
    "check_heads_fit",
    "is_adapter_folder",
    "is_feature_draft",
    "lm_head_fingerprint",
    "load_adapter",
    "load_block_heads",
    "load_heads",
    "read_record",
    "save_adapter",
    "save_block_heads",
    "save_heads",
    "shipped_adapter_for",
    "shipped_dir",
    "target_fingerprint",
    "write_record",
]
