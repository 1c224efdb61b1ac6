"""Which compute path each part of a model takes on a CPU: decided once, after loading, in one place.

A model can run four ways, each faster than the one before for the few-token rows of decode and verification:

- **torch**: every op through torch (CUDA, bfloat16, ``linear_kernel="torch"``, or no C++ compiler);
- **packed projections**: each projection through the few-row kernel, from the GGUF file's own blocks (kept by the
  loader), their int8-activation layout (``linear_kernel="packed-int8act"``), or float32 panels;
- **op kernels**: RMSNorm, RoPE with the few-row attention, and the gated activation as one C++ call each;
- **fused layers**: a decoder layer's whole step in one C++ call when every projection of it is packed and nothing
  splits it across ranks, and runs of such layers in one call per step (``LlamaForCausalLM._layer_stack``).

:func:`plan_kernels` decides from the model's modules (a :class:`KernelPlan` that says what each one gets), and
:func:`apply_plan` does it: packs the weights and tells each module its path. ``LLMEngine`` does both at start-up,
drafters for their own layers; ``leapdecode bench`` and the tests read ``KernelPlan.formats``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

import torch

from leapdecode.kernels import extension
from leapdecode.layers import int8_gemm, small_gemm
from leapdecode.layers.linear import KernelWeight
from leapdecode.models.llama import MLP, Attention, DecoderLayer, RMSNorm


@dataclass(frozen=True)
class KernelPlan:
    """The path of each part of one model: ``packed`` maps each projection (module name) to where its packed
    form comes from ("blocks": the checkpoint's records or their int8 layout; "panels": float32 panels; absent:
    torch); ``op_kernels`` and ``fused_layers`` name the modules that run as one C++ call."""

    packed: dict[str, str]
    op_kernels: tuple[str, ...]
    fused_layers: tuple[str, ...]
    use_blocks: bool
    int8_activations: bool

    def summary(self) -> str:
        """One line: how many modules take each path."""
        sources = Counter(self.packed.values())
        return (f"{len(self.packed)} packed projections ({', '.join(f'{n} {s}' for s, n in sorted(sources.items()))})"
                f", {len(self.op_kernels)} op kernels, {len(self.fused_layers)} fused decoder layers"
                + (self._int8_paths() if self.int8_activations else ""))

    @staticmethod
    def _int8_paths() -> str:
        rows = int8_gemm.amx_rows()
        return ", int8 activations" + (f" (AMX tiles from {rows} rows)" if rows else "")


def _packed_source(mod: KernelWeight, use_blocks: bool, int8_activations: bool) -> str | None:
    """Where a projection's packed form would come from, without building it."""
    owner = mod.owner() if hasattr(mod, "owner") else mod  # a tied LM head packs its embedding's weight
    has_blocks = owner.quant is not None or (int8_activations and getattr(owner, "block_quantized", None) is not None)
    if use_blocks and has_blocks:
        return "blocks"
    return "panels" if small_gemm.packable(owner.dense_weight()) else None


def plan_kernels(model: torch.nn.Module, use_blocks: bool = True, int8_activations: bool = False) -> KernelPlan:
    """The paths ``model``'s modules take with the kernel built: its checkpoint blocks where the loader kept them
    (``use_blocks``), for the int8-activation kernel if ``int8_activations``, else float32 panels."""
    packed: dict[str, str] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, KernelWeight) and not getattr(mod, "looks_up_rows", False):  # embeddings look rows up
            source = "existing" if mod.packed is not None else _packed_source(mod, use_blocks, int8_activations)
            if source is not None:
                packed[name] = source
    ops = tuple(name for name, mod in model.named_modules() if isinstance(mod, (RMSNorm, Attention, MLP)))
    fused = []
    for name, mod in model.named_modules():
        if isinstance(mod, DecoderLayer):
            parts = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
            if all(f"{name}.{p}" in packed for p in parts) and not mod.self_attn.o_proj.reduce:
                fused.append(name)
    return KernelPlan(packed, ops, tuple(fused), use_blocks, int8_activations)


def _packed_form(mod: KernelWeight, source: str, plan: KernelPlan) -> torch.Tensor:
    if source == "blocks":
        owner = mod.owner() if hasattr(mod, "owner") else mod
        if owner.quant is not None:
            return owner.quant.int8_activation_records() if plan.int8_activations else owner.quant.records
        return owner.block_quantized.pack_int8_activations()
    # this rank's own rows: a vocabulary-parallel head gathers its shard's logits after the kernel (packing the
    # gathered whole vocabulary here would make every rank's logits as many vocabularies wide as there are ranks)
    owner = mod.owner() if hasattr(mod, "owner") else mod
    return small_gemm.pack(owner.dense_weight())


def apply_plan(model: torch.nn.Module, plan: KernelPlan) -> int:
    """Pack the weights and set each module's path as ``plan`` says. With int8 activations, a projection's own
    records are released once packed (the int8 records serve every row count). Returns how many projections are
    packed. Idempotent."""
    modules = dict(model.named_modules())
    for name, source in plan.packed.items():
        mod = modules[name]
        if mod.packed is None:
            mod.packed = _packed_form(mod, source, plan)
            if plan.int8_activations and source == "blocks" and not hasattr(mod, "owner"):
                mod.quant = mod.block_quantized = None
    for name in (*plan.op_kernels, *plan.fused_layers):
        modules[name].use_kernel = True
    if plan.int8_activations and any(int8_gemm.int8_activation_layout(modules[n].packed) for n in plan.packed):
        model.int8_activations = True  # read by the model runner: prompts attend through the rows kernel too
    return len(plan.packed)


def use_kernels(model: torch.nn.Module, required: bool = False, use_blocks: bool = True,
                int8_activations: bool = False) -> int:
    """Plan and apply the kernel paths of ``model``; 0 (torch everywhere) when the kernel cannot be built (an
    error when ``required``)."""
    if extension.load_kernel(required) is None:
        return 0
    if int8_activations and int8_gemm.int8_activation_isa() == "portable":
        warnings.warn("int8 activations on a CPU without AVX2 run a slow portable loop (exact, but several times "
                      "slower than float32)", stacklevel=2)
    plan = plan_kernels(model, use_blocks, int8_activations)
    n = apply_plan(model, plan)
    if plan.int8_activations:
        _choose_amx_rows(model, plan)
    return n


def _choose_amx_rows(model: torch.nn.Module, plan: KernelPlan) -> None:
    """Where AMX-INT8 tiles exist, from how many rows a step's projections take them: measured on the largest
    int8-activation weight of the decoder layers (int8_gemm.choose_amx_rows), once per model packed."""
    modules = dict(model.named_modules())
    weights = [modules[n].packed for n in plan.packed if ".layers." in f".{n}"]
    weights = [w for w in weights if isinstance(w, torch.Tensor) and w.dim() == 4]
    if weights:
        int8_gemm.choose_amx_rows(max(weights, key=lambda w: w.numel()))


def use_int8_drafting(module: torch.nn.Module) -> int:
    """A drafter's own projections (not the target's) as Q8_0 weights with int8 activations: each packable float
    weight is quantized to Q8_0 blocks and replaced by their dequantized values, so every code path computes the
    same draft, then packed for the int8-activation kernel. A draft pass reads ~4x fewer bytes and runs on VNNI or
    AVX2; the target still verifies every token, so this changes acceptance only, never the output. Returns how
    many layers were packed: 0 when the kernel is unavailable or only its slow portable loop was built (no AVX2),
    where drafting stays float32 because int8 would make it slower."""
    if int8_gemm.int8_activation_isa() in (None, "portable"):
        return 0
    for mod in module.modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, KernelWeight) and mod.packed is None and isinstance(w, torch.Tensor) \
                and small_gemm.packable(w) and w.shape[1] % 32 == 0:
            bq = int8_gemm.BlockQuantized.quantize_q8(w)
            with torch.no_grad():
                w.copy_(bq.dequantize())
            mod.block_quantized = bq
    return use_kernels(module, use_blocks=True, int8_activations=True)
