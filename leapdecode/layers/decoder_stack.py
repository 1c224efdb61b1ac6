"""Python side of kernels/decoder_stack.cpp: a decoder layer's whole few-row step, or a run of layers, in one
C++ call (models/llama.py builds the argument lists).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leapdecode.kernels import extension


def decoder_layer(*args) -> torch.Tensor:
    """One decoder layer for few-token rows in one C++ call (see models/llama.py ``DecoderLayer._fused``)."""
    return extension.ext.decoder_layer(*args)


def decoder_layer_i8(*args) -> torch.Tensor:
    """:func:`decoder_layer` over an int8 KV cache (kv_quant.QuantizedKV planes), bitwise equal to the per-op path."""
    return extension.ext.decoder_layer_i8(*args)


@dataclass
class StackWeights:
    """The per-layer arguments of :func:`decoder_stack` that do not change between steps, flattened once."""

    weights: list[torch.Tensor]  # 6 per layer, as decoder_layer takes them
    biases: list[torch.Tensor]  # 1 per layer; empty = no QKV bias
    norms: list[torch.Tensor]  # empty (Llama's layout), or 4 per layer: q, k, attention output, MLP output (or empty)
    windowed: list[int]  # 1 per layer: it attends within the sliding window (its RoPE table and rows are the 2nd)
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float
    gelu: bool  # GeGLU instead of SwiGLU


@dataclass
class LayerStack:
    """One step's :func:`decoder_stack` arguments: the weights, and this step's caches -- 2 float32 tensors (K, V)
    or 4 int8 planes (k data, k scales, v data, v scales) per layer, with 5 transforms per layer for int8
    (models/llama.py ``fused_kv``)."""

    weights: StackWeights
    caches: list[torch.Tensor]
    transforms: list[torch.Tensor]
    window: int | None = None  # the sliding window of the windowed layers (weights.windowed)


def stack_weights(layer_args: list[tuple]) -> StackWeights:
    """Flatten ``DecoderLayer.fused_args()`` of consecutive layers (which share heads, eps, scale and MLP)."""
    shared = {a[2:6] + a[8:] for a in layer_args}
    if len(shared) != 1:
        raise ValueError(f"decoder_stack needs layers of one shape, got {sorted(shared)}")
    heads, kv_heads, eps, scale, gelu = shared.pop()
    empty = torch.empty(0)
    norms = [n if n is not None else empty for a in layer_args if a[6] is not None for n in a[6]]
    if norms and len(norms) != 4 * len(layer_args):
        raise ValueError("decoder_stack needs the layers' q/k norms for all layers or none")
    return StackWeights([w for a in layer_args for w in a[0]], [empty if a[1] is None else a[1] for a in layer_args],
                        norms, [int(a[7]) for a in layer_args], heads, kv_heads, eps, scale, gelu)  # fmt: skip


def decoder_stack(x: torch.Tensor, stack: LayerStack, ropes: list[torch.Tensor], slot_mapping: torch.Tensor,
                  row_sets: list[torch.Tensor]) -> torch.Tensor:
    """Run a stack of decoder layers for one step of few-token rows in one C++ call (``decoder_layer``,
    ``decoder_layer_i8`` or the normed layout per layer, so bitwise the per-layer result); see models/llama.py
    ``_layer_stack``. ``ropes``: cos, sin of the global layers then of the windowed ones; ``row_sets``: the rows
    kernel's rows, spans, slots as the global layers see the step, then as the windowed ones do."""
    w = stack.weights
    return extension.ext.decoder_stack(x, w.weights, w.biases, w.norms, ropes, stack.caches, stack.transforms,
                                       slot_mapping, row_sets, w.windowed, w.num_heads, w.num_kv_heads, w.eps,
                                       w.scale, w.gelu)

