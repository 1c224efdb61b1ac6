"""Checked configuration for the engine and for speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LINEAR_KERNELS = ("auto", "packed", "packed-float32", "packed-int8act", "torch")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


T = TypeVar("T")
# the keys of a speculative_config dict that are fields of SpeculativeConfig itself; a method declares which of them it
# reads (speculative/method.py), every other key belongs to one of its typed option groups
SHARED_KEYS = ("model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "gamma_init", "gamma_max",
               "gamma_min", "raise_after", "raise_above", "lower_after", "lower_below", "use_cost_model",
               "draft_linear_kernel")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A parsed ``speculative_config`` (vLLM's dict): the method's name, the settings several methods share, and the
    method's own typed option groups. ``num_speculative_tokens=None`` enables the dynamic-γ rule.

    Built by ``leapdecode.speculative.registry.parse_config`` from the flat dict, which refuses every key the
    method does not read (its descriptor says which); this module knows no method, so the engine's config depends
    on nothing of the speculative package."""

    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # dynamic draft length (speculative/policy.py): +1 after raise_after verifications above raise_above, -1
    # after lower_after below lower_below, within [gamma_min, gamma_max]
    gamma_init: int = 3
    gamma_max: int = 8
    gamma_min: int = 1
    raise_after: int = 5
    raise_above: float = 0.8
    lower_after: int = 3
    lower_below: float = 0.5
    # cost model: skip speculation when expected tokens per unit of step time do not beat plain decoding
    use_cost_model: bool = True
    # draft_model: the drafter's linear_kernel (EngineConfig.linear_kernel), e.g. "packed-int8act" to draft with
    # int8 activations while the target verifies in float32 (the target checks every token, so the drafter's
    # precision moves acceptance, never the output); None = the target's. With "model": "target" the drafter
    # is the target model itself.
    draft_linear_kernel: str | None = None
    # the method's option groups (frozen dataclasses, one instance per class it reads; speculative/options.py and
    # the method modules define them); a group not given reads as its defaults (``options``)
    groups: tuple[Any, ...] = ()

    def options(self, kind: type[T]) -> T:
        """The config's instance of the option group ``kind`` (its defaults when the dict gave none of its keys)."""
        for g in self.groups:
            if isinstance(g, kind):
                return g
        return kind()

    def __post_init__(self) -> None:
        _check(isinstance(self.method, str) and bool(self.method), f"method must be a name, got {self.method!r}")
        if self.num_speculative_tokens is not None:
            _check(
                isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 64,
                f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}",
            )
        _check(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
            f"{self.prompt_lookup_max}",
        )
        _check(
            1 <= self.gamma_min <= self.gamma_init <= self.gamma_max, "need 1 <= gamma_min <= gamma_init <= gamma_max"
        )
        _check(self.raise_after >= 1 and self.lower_after >= 1, "raise_after and lower_after must be >= 1")
        _check(0 <= self.lower_below <= self.raise_above <= 1, "need 0 <= lower_below <= raise_above <= 1")
        _check(isinstance(self.use_cost_model, bool),
               f"use_cost_model must be true or false, got {self.use_cost_model!r}")
        _check(
            self.draft_linear_kernel is None or self.draft_linear_kernel in LINEAR_KERNELS,
            f"draft_linear_kernel must be None or one of {LINEAR_KERNELS}, got {self.draft_linear_kernel!r}",
        )

    @property
    def max_draft_tokens(self) -> int:
        return self.num_speculative_tokens or self.gamma_max


@dataclass
class EngineConfig:
    model: str | None = None
    # the tokenizer's folder, .gguf file or repo id, when it is not the model's (vLLM's ``tokenizer``)
    tokenizer: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_blocks: int | None = None
    # share of free memory the KV pool may take when kv_cache_blocks is None (it is also capped at what
    # max_num_seqs full-length sequences need); pages are touched only as blocks are first used. Not on CUDA,
    # which sizes the pool from gpu_memory_utilization
    kv_cache_memory_fraction: float = 0.05
    # on CUDA instead: the share of the GPU's whole memory this engine may hold -- weights, the largest step's
    # activations and the KV pool together -- as vLLM's option of the same name (engine/gpu_memory.py)
    gpu_memory_utilization: float = 0.9
    # CUDA: False captures decode and verification steps in CUDA graphs per padded batch size
    # (engine/cuda_graphs.py); True always runs eagerly (vLLM's name)
    enforce_eager: bool = False
    # KV storage: "auto" = the model dtype; "int8" quantizes on write (3.9x smaller than float32; kv_quant.py)
    kv_cache_dtype: str = "auto"
    # int8 only: fit the keys' per-channel shift and smoothing on a few built-in texts at start-up (~1 s;
    # engine/kv_calibration.py); False keeps the rotation and grouped scales alone
    kv_calibration: bool = True
    # host-memory KV tier for preempted sequences (0 = off: preemption recomputes); swap_path backs it by a file
    swap_space_gb: float = 0.0
    # layer tier: keep only the last N layers' KV in the device pool, the rest in host memory, fetched per step
    # (None = all layers on the device; engine/kv_cache.py); pays when device memory, not bandwidth, binds
    kv_device_layers: int | None = None
    swap_path: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    speculative_config: SpeculativeConfig | None = None
    num_threads: int | None = None
    # few-row projections (decode, verification, small batches), CPU float32 only: "auto" = the packed kernel of
    # layers/small_gemm.py when it builds, reading a GGUF checkpoint's own Q4/Q8 blocks where they reproduce the
    # weights exactly (bit-identical results) and float32 panels elsewhere; "packed" = the same but the kernel
    # must build; "packed-float32" = float32 panels only; "torch" = F.linear only; "packed-int8act" = the Q4/Q8
    # layers quantize their input rows to int8 per 32 values (llama.cpp's arithmetic, AVX-512 VNNI): faster, and
    # lossy against the float32 model (opt-in; quality measured in the README), while speculation stays lossless
    # against plain decoding with the same kernel
    linear_kernel: str = "auto"
    # tensor parallelism (engine/executor.py): split every layer over this many processes (gloo on a CPU, each
    # rank on its share of the cores; NCCL on CUDA, one GPU each); the engine starts the other ranks itself, or
    # joins the group torchrun started
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"invalid device {self.device!r}: {e}") from None
        if dev.type == "cuda":
            _check(torch.cuda.is_available(), "device='cuda' requested but CUDA is not available")
        _check(
            isinstance(self.block_size, int) and self.block_size >= 1,
            f"block_size must be >= 1, got {self.block_size!r}",
        )
        _check(
            self.kv_cache_blocks is None or (isinstance(self.kv_cache_blocks, int) and self.kv_cache_blocks >= 1),
            f"kv_cache_blocks must be None (size from memory) or >= 1, got {self.kv_cache_blocks!r}",
        )
        _check(0 < self.kv_cache_memory_fraction <= 0.95, "kv_cache_memory_fraction must be in (0, 0.95]")
        _check(
            isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}",
        )
        _check(isinstance(self.enforce_eager, bool), f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _check(
            isinstance(self.kv_calibration, bool), f"kv_calibration must be True or False, got {self.kv_calibration!r}"
        )
        _check(
            self.kv_device_layers is None or (isinstance(self.kv_device_layers, int) and self.kv_device_layers >= 1),
            f"kv_device_layers must be None (all layers) or >= 1, got {self.kv_device_layers!r}",
        )
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        _check(
            isinstance(self.swap_space_gb, (int, float)) and self.swap_space_gb >= 0,
            f"swap_space_gb must be >= 0, got {self.swap_space_gb!r}",
        )
        _check(
            self.linear_kernel in LINEAR_KERNELS,
            f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}",
        )
        if self.linear_kernel.startswith("packed"):
            _check(
                dev.type == "cpu" and self.dtype == "float32",
                f"linear_kernel={self.linear_kernel!r} is for CPU float32 models",
            )
        _check(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}",
        )
        _check(self.speculative_config is None or isinstance(self.speculative_config, SpeculativeConfig),
               "speculative_config must be parsed first (leapdecode.speculative.registry.parse_config; LLM does it)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def engine_default(name: str) -> Any:
    """``EngineConfig``'s default for the option ``name``: the one place a default is declared (``LLM``, the
    command lines and ``serve`` read it here)."""
    return EngineConfig.__dataclass_fields__[name].default
