"""Python side of kernels/layer_ops.cpp: RMSNorm, RoPE, the gated activations, the logits rows' argmax and their top-k
with their logsumexp, as one C++ call each."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leapdecode.kernels import extension


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in one C++ call (kernels/layer_ops.cpp) for CPU float32 inference; torch's otherwise."""
    if extension.ext is not None and x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad:
        return extension.ext.rms_norm(x.contiguous(), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, num_heads: int) -> None:
    """RoPE in place on the first ``num_heads`` heads of each row of a fused [T, W] QKV (layer_ops.cpp)."""
    extension.ext.rope_(qkv, cos, sin_signed, num_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [T, 2I] projection -> [T, I] (layer_ops.cpp)."""
    return extension.ext.silu_mul(gate_up.contiguous())


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up (GELU's tanh form) of a fused [T, 2I] projection -> [T, I] (layer_ops.cpp)."""
    return extension.ext.gelu_tanh_mul(gate_up.contiguous())


def row_argmax(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest value of ``logits`` [T, V], as ``logits.argmax(-1).tolist()`` gives it (the
    first of equal maxima, the first NaN), in one C++ vector pass per row (layer_ops.cpp) for CPU float32."""
    if (extension.ext is not None and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and logits.dim() == 2 and logits.shape[1] > 0 and not logits.requires_grad):
        return extension.ext.row_argmax(logits.contiguous())
    return logits.argmax(dim=-1).tolist()


def row_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` [T, V]: its ``k`` largest values (descending), their indices and the row's logsumexp,
    in one C++ pass pair over each row (layer_ops.cpp) for CPU float32; torch's topk and logsumexp otherwise (the
    same values; equal logits may come in another order)."""
    if (extension.ext is not None and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and logits.dim() == 2 and not logits.requires_grad):
        vals, idx, lse = extension.ext.row_top_k(logits.contiguous(), k)
        return vals, idx, lse
    vals, idx = logits.topk(k, dim=-1)
    return vals, idx, logits.logsumexp(dim=-1)


def record_successors(logits: torch.Tensor, tokens: list[int], succ_tokens: torch.Tensor,
                      succ_probs: torch.Tensor) -> None:
    """Row ``i`` of ``logits`` [T, V] had input token ``tokens[i]``: its top-k ids and probabilities (softmax over
    the whole row) become row ``tokens[i]`` of ``succ_tokens`` (int32) and ``succ_probs`` (float16) [rows, k], in
    order (a token given twice keeps its last row; one outside the rows is skipped). One C++ call for CPU float32
    (layer_ops.cpp); torch's ops otherwise."""
    k = succ_tokens.shape[1]
    if (extension.ext is not None and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and logits.dim() == 2 and not logits.requires_grad):
        extension.ext.record_successors(logits.contiguous(), tokens, succ_tokens, succ_probs)
        return
    vals, idx, lse = row_top_k(logits, k)
    rows = torch.tensor(tokens, dtype=torch.long)
    keep = (rows >= 0) & (rows < succ_tokens.shape[0])
    succ_tokens[rows[keep]] = idx[keep].to(device="cpu", dtype=torch.int32)
    succ_probs[rows[keep]] = (vals - lse.unsqueeze(-1)).exp()[keep].to(device="cpu", dtype=torch.float16)
