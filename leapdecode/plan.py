"""``leapdecode plan``: how much memory a model, its KV cache and a batch of long contexts need.

Answers "will it fit?" before anything is loaded: only the model's config is read (an HF folder with just a
``config.json`` is enough, or a ``.gguf`` header), so it works for models far bigger than this machine.

The KV numbers are the engine's own: the cache allocates whole blocks of ``block_size`` tokens per sequence,
and an int8 cache also stores a float16 scale per 16 channels per token per KV head (see
:mod:`leapdecode.layers.kv_quant`), so the per-token cost here is exactly what ``LLM(kv_cache_dtype=...)``
allocates. Weights (``--weight-dtype auto``) are counted as the engine holds them: a GGUF file's quantized
matrices as the kernel records they are repacked into (layers/block_formats.py; ~6 bits a weight for Q4_K,
~9.5 for Q6_K), everything else as float32; ``float32`` / ``float16`` / ``bfloat16`` count every parameter in
that dtype (what CUDA or ``linear_kernel="torch"`` hold). Activations, the sampler and the Python runtime are
not counted.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from leapdecode.engine.kv_cache import available_memory_bytes
from leapdecode.layers.kv_quant import KV_DTYPES, kv_bytes_per_token
from leapdecode.models.config import ModelConfig
from leapdecode.models.loader import kept_weight_bytes, load_config, resolve_model

WEIGHT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
GIB = 1 << 30
MIB = 1 << 20


@dataclass
class MemoryPlan:
    """Everything ``plan`` prints; byte counts are exact integers (``--json`` emits this dict)."""

    model: str
    num_params: int
    weight_dtype: str
    kv_dtype: str
    context: int
    batch: int
    block_size: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int  # context rounded up to whole blocks
    kv_blocks_per_sequence: int
    batch_kv_bytes: int
    total_bytes: int  # weights + batch KV
    memory_bytes: int
    memory_source: str  # "--memory-gb" or "available system memory"
    kv_budget_bytes: int  # memory left after weights (0 if the weights alone do not fit)
    max_sequences: int  # sequences of `context` tokens that fit in kv_budget_bytes
    max_context_at_batch: int  # longest context (whole blocks) `batch` sequences can each have
    fits: bool  # weights + batch sequences of `context` tokens fit in memory
    kv_cache_blocks: int  # the LLM(kv_cache_blocks=...) value that holds `batch` full sequences
    tensor_parallel_size: int = 1
    weight_bytes_per_rank: int = 0  # the largest rank's share: split matrices / N, plus the replicated norms
    kv_heads_per_rank: int = 0  # the largest rank's KV heads (the first ranks take one more when N does not divide)
    kv_bytes_per_token_per_rank: int = 0


def load_model_config(model: str | None) -> tuple[ModelConfig, str]:
    """Config of an HF folder (``config.json`` alone is enough), a .gguf file, or the bundled model."""
    if model is not None:
        path = Path(model).expanduser()
        if path.is_file() and path.name == "config.json":
            path = path.parent
        if path.is_dir() and (path / "config.json").is_file():
            with open(path / "config.json") as f:
                return ModelConfig.from_hf(json.load(f)), path.name
    path = resolve_model(model)
    return load_config(path), path.stem if path.is_file() else path.name


def make_plan(
    cfg: ModelConfig,
    context: int,
    batch: int = 1,
    kv_dtype: str = "auto",
    weight_dtype: str = "float32",
    block_size: int = 16,
    memory_bytes: int | None = None,
    model_name: str = "",
    weight_bytes: int | None = None,
    tensor_parallel_size: int = 1,
) -> MemoryPlan:
    """Count weight and KV bytes for ``batch`` sequences of ``context`` tokens; see the module docstring.
    ``weight_bytes`` (a GGUF file's kept blocks, :func:`leapdecode.models.loader.kept_weight_bytes`) replaces
    the count of parameters in ``weight_dtype``."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {sorted(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    kv_name = weight_dtype if kv_dtype == "auto" else kv_dtype
    if kv_name not in KV_DTYPES:
        raise ValueError(f"kv dtype must be 'auto' or one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    if context < 1 or batch < 1 or block_size < 1:
        raise ValueError(f"context, batch and block size must be >= 1, got {context}, {batch}, {block_size}")
    source = "--memory-gb"
    if memory_bytes is None:
        memory_bytes, source = available_memory_bytes(torch.device("cpu")), "available system memory"
    n_params = cfg.num_params()
    if weight_bytes is None:
        weight_bytes = n_params * torch.empty((), dtype=WEIGHT_DTYPES[weight_dtype]).element_size()
    per_token = kv_bytes_per_token(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, KV_DTYPES[kv_name]
    )
    tp = tensor_parallel_size
    _check_split(cfg, tp)
    replicated = 4 * cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)  # the float32 RMSNorm weights
    rank_heads = -(-cfg.num_key_value_heads // tp)
    # attention matrices split by whole KV heads (the largest rank's share), the rest (MLP, vocabulary) evenly
    attn = cfg.num_hidden_layers * cfg.hidden_size * cfg.head_dim * 2 * (cfg.num_attention_heads
                                                                          + cfg.num_key_value_heads)
    share = (attn / n_params) * rank_heads / cfg.num_key_value_heads + (1 - attn / n_params) / tp
    rank_weights = math.ceil(max(0, weight_bytes - replicated) * share) + replicated
    blocks = -(-context // block_size)
    per_seq = blocks * block_size * per_token
    budget = max(0, memory_bytes - weight_bytes)
    per_block = block_size * per_token
    return MemoryPlan(
        model=model_name,
        num_params=n_params,
        weight_dtype=weight_dtype,
        kv_dtype=kv_name,
        context=context,
        batch=batch,
        block_size=block_size,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=per_token,
        kv_bytes_per_sequence=per_seq,
        kv_blocks_per_sequence=blocks,
        batch_kv_bytes=batch * per_seq,
        total_bytes=weight_bytes + batch * per_seq,
        memory_bytes=memory_bytes,
        memory_source=source,
        kv_budget_bytes=budget,
        max_sequences=budget // per_seq,
        max_context_at_batch=(budget // (batch * per_block)) * block_size,
        fits=weight_bytes + batch * per_seq <= memory_bytes,
        kv_cache_blocks=batch * blocks,
        tensor_parallel_size=tp,
        weight_bytes_per_rank=rank_weights if tp > 1 else weight_bytes,
        kv_heads_per_rank=rank_heads,
        kv_bytes_per_token_per_rank=kv_bytes_per_token(cfg.num_hidden_layers, rank_heads, cfg.head_dim,
                                                       KV_DTYPES[kv_name]),
    )


def _check_split(cfg: ModelConfig, tp: int) -> None:
    """The splits the engine makes must exist: whole KV heads per rank, an even vocabulary and MLP."""
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if tp > cfg.num_key_value_heads:
        raise ValueError(f"{cfg.num_key_value_heads} KV heads cannot be split over {tp} ranks")
    for what, n in (("vocab_size", cfg.vocab_size), ("intermediate_size", cfg.intermediate_size)):
        if n % tp:
            raise ValueError(f"{what}={n} is not divisible by --tensor-parallel-size {tp}")


def _fmt(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def format_plan(p: MemoryPlan, cfg: ModelConfig) -> str:
    """Human-readable report; every figure also shows exact bytes where rounding could hide a difference."""
    lines = [
        f"model            {p.model}: {p.num_params / 1e6:,.1f}M params, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads x {cfg.head_dim}",
        f"weights          {_fmt(p.weight_bytes)} ({p.weight_bytes:,} B, {p.weight_dtype})",
        f"KV per token     {_fmt(p.kv_bytes_per_token)} ({p.kv_bytes_per_token:,} B, {p.kv_dtype}"
        + (", incl. float16 scales" if p.kv_dtype == "int8" else "")
        + ")",
        f"KV per sequence  {_fmt(p.kv_bytes_per_sequence)} ({p.kv_bytes_per_sequence:,} B) at "
        f"{p.context:,} tokens = {p.kv_blocks_per_sequence} blocks of {p.block_size}",
        f"batch of {p.batch:<7} {_fmt(p.batch_kv_bytes)} KV + weights = {_fmt(p.total_bytes)}",
        f"memory           {_fmt(p.memory_bytes)} ({p.memory_source}); {_fmt(p.kv_budget_bytes)} left for KV",
        f"fits             {'yes' if p.fits else 'NO'}: up to {p.max_sequences:,} sequences of "
        f"{p.context:,} tokens; {p.batch} sequence(s) can each hold {p.max_context_at_batch:,} tokens",
        f"engine           LLM(kv_cache_blocks={p.kv_cache_blocks}, block_size={p.block_size}"
        + (f", kv_cache_dtype={p.kv_dtype!r}" if p.kv_dtype != p.weight_dtype else "")
        + f") holds {p.batch} full sequence(s)",
    ]
    if p.tensor_parallel_size > 1:
        lines.append(
            f"per rank (of {p.tensor_parallel_size}) weights {_fmt(p.weight_bytes_per_rank)} "
            f"({p.weight_bytes_per_rank:,} B), KV {_fmt(p.kv_bytes_per_token_per_rank)} per token "
            f"({p.kv_heads_per_rank} KV heads); the ranks of one machine share its memory, so the totals above hold"
        )
    if p.context > cfg.max_position_embeddings:
        lines.append(
            f"warning          context {p.context:,} exceeds the model's "
            f"{cfg.max_position_embeddings:,} positions"
        )
    lines.append("(activations and runtime overhead are not counted)")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    cfg, name = load_model_config(args.model)
    memory = None if args.memory_gb is None else int(args.memory_gb * GIB)
    kept = None
    path = None if args.model is None else Path(args.model).expanduser()
    if args.weight_dtype == "auto" and (args.model is None or (path.is_file() and path.suffix == ".gguf")):
        kept = kept_weight_bytes(resolve_model(args.model))
    p = make_plan(
        cfg,
        context=args.context or cfg.max_position_embeddings,
        batch=args.batch,
        kv_dtype=args.kv_dtype,
        weight_dtype="float32" if args.weight_dtype == "auto" else args.weight_dtype,
        block_size=args.block_size,
        memory_bytes=memory,
        model_name=name,
        weight_bytes=kept,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if kept is not None:
        p.weight_dtype = "GGUF blocks"
    print(json.dumps(asdict(p), indent=2) if args.json else format_plan(p, cfg))
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register ``leapdecode plan`` on the top-level subparsers."""
    p = sub.add_parser(
        "plan",
        help="memory plan: weight and KV-cache bytes, and how many sequences fit",
        description=(
            "Count the memory a model needs before loading it: weight bytes, KV-cache bytes per token "
            "and per sequence (rounded up to whole KV blocks, int8 scales included), and how many "
            "sequences of --context tokens fit in --memory-gb after the weights. Only the model's config "
            "is read, so any size works; a folder holding just config.json is enough."
        ),
        epilog="example: leapdecode plan --model ./llama-7b --context 4096 --kv-dtype int8 --memory-gb 24",
    )
    p.add_argument(
        "--model", default=None, help="HF folder (config.json suffices) or .gguf (default: bundled SmolLM2)"
    )
    p.add_argument(
        "--context", type=int, default=None, help="tokens per sequence (default: the model's maximum)"
    )
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences (default 1)")
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", *KV_DTYPES],
        help="KV cache dtype (default: the weight dtype)",
    )
    p.add_argument("--weight-dtype", default="auto", choices=["auto", *WEIGHT_DTYPES],
                   help="auto (default): a GGUF file's quantized weights as the CPU engine keeps them (their "
                        "blocks), other weights float32; or count every parameter in this dtype")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    p.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory budget in GiB (default: this machine's available RAM)",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="also show each rank's share of weights and KV when the model is split over N processes")
    p.add_argument("--json", action="store_true", help="print one JSON object with exact byte counts")
    p.set_defaults(func=cmd_plan)
