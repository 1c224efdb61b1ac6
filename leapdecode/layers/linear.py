"""Shard-aware linear layers and embeddings.

With tensor-parallel size 1 these are plain ``F.linear`` / ``F.embedding``. Each parameter carries
``shard_dim`` (which dimension a rank slices, or None for replicated) so the loader can cut a full checkpoint tensor
into this rank's piece; fused layers (QKV, gate+up) record the sizes of their parts in ``shard_parts`` so each
part is cut separately before concatenation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from leapdecode.layers import small_gemm
from leapdecode.layers.block_formats import QuantizedWeight
from leapdecode.parallel import all_gather_last_dim, all_reduce, divide, tp_rank, tp_size

Ranges = list[tuple[int, int]]


def even_ranges(parts: list[int]) -> Ranges:
    """This rank's (start, length) in each part when every part divides evenly."""
    return [(tp_rank() * n, n) for n in (divide(p, tp_size(), "sharded dimension") for p in parts)]


def shard_tensor(full: torch.Tensor, shard_dim: int | None, parts: list[int] | None = None,
                 ranges: Ranges | None = None) -> torch.Tensor:
    """This rank's piece of a full checkpoint tensor: (start, length) ``ranges`` of each fused part (default: an
    even split of each)."""
    if shard_dim is None or tp_size() == 1:
        return full
    if parts is None:
        parts = [full.shape[shard_dim]]
    ranges = ranges or even_ranges(parts)
    pieces = [chunk.narrow(shard_dim, start, n)
              for chunk, (start, n) in zip(torch.split(full, parts, dim=shard_dim), ranges)]
    return torch.cat(pieces, dim=shard_dim)


def shard_quantized(full: QuantizedWeight, shard_dim: int | None, parts: list[int] | None = None,
                    ranges: Ranges | None = None) -> QuantizedWeight | torch.Tensor:
    """This rank's piece of a weight kept as kernel records: output rows (each fused part split separately) are
    a row subset of the records, input columns a run of whole records along each row. Where the piece does not
    fall on record boundaries (rows in 16s, inputs in 32s or 256s) it is the float piece of the rebuilt weight,
    which is bitwise the dequantised checkpoint, so the model is the same either way."""
    if shard_dim is None or tp_size() == 1:
        return full
    n, k = full.shape
    parts = parts or [full.shape[shard_dim]]
    ranges = ranges or even_ranges(parts)
    if shard_dim == 0:
        offsets = [sum(parts[:i]) for i in range(len(parts))]
        piece = full.select_rows(torch.cat([torch.arange(o + s, o + s + m) for o, (s, m) in zip(offsets, ranges)]))
    else:
        (start, cols), span = ranges[0], k // full.records.shape[1]
        piece = None
        if start % span == 0 and cols % span == 0:
            records = full.records[:, start // span: (start + cols) // span].contiguous()
            piece = QuantizedWeight(records, (n, cols), full.source)
    return piece if piece is not None else shard_tensor(full.dequantize(), shard_dim, parts, ranges)


def kernel_linear(x: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None, records_only: bool,
                  dense: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``x @ W^T (+ bias)``: the packed kernel for few rows; for more rows, a weight that exists only as block
    records goes through the kernel 64 rows at a time (rebuilding the whole float matrix for each prompt chunk
    cost 10x more, measured on a 1.1B model, and the rows stay bitwise what they are decoded alone), a float
    weight through torch's GEMM."""
    if small_gemm.takes_packed(x, packed):
        return small_gemm.packed_linear(x, packed, bias)
    if records_only and packed is not None and small_gemm.takes_packed(x[:1], packed):
        return small_gemm.packed_linear_rows(x, packed, bias)
    return F.linear(x, dense(), bias)


class KernelWeight(nn.Module):
    """A layer whose weight is a float Parameter or, for a GGUF checkpoint on a CPU, kernel records that replace it
    (``quant``, layers/block_formats.py); ``packed`` is what the few-row kernel reads (set by
    models/kernel_plan.py)."""

    weight: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.packed: torch.Tensor | None = None
        self.quant: QuantizedWeight | None = None

    def set_quantized(self, quant: QuantizedWeight) -> None:
        """Hold the weight as records only: the float Parameter goes (it was never materialised)."""
        self.register_parameter("weight", None)
        self.quant = quant

    def dense_weight(self) -> torch.Tensor:
        """The float32 weight: the Parameter, or rebuilt from the records (for readers of the whole matrix, and
        for torch's path; bitwise the dequantised checkpoint)."""
        if self.quant is not None:
            return self.quant.dequantize()
        if self.weight is None:
            raise RuntimeError("this layer's weight lives only in its int8-activation records (packed-int8act)")
        return self.weight

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return kernel_linear(x, self.packed, bias, self.quant is not None, self.dense_weight)


class ColumnParallelLinear(KernelWeight):
    """y = x W^T (+ b), with W's output rows split across ranks; the output stays sharded."""

    def __init__(self, in_features: int, out_parts: list[int], bias: bool = False,
                 ranges: Ranges | None = None) -> None:
        """``ranges``: this rank's (start, length) in each part (default: an even split of each)."""
        super().__init__()
        ranges = ranges or even_ranges(out_parts)
        self.out_parts = [n for _, n in ranges]
        self.weight = nn.Parameter(torch.empty(sum(self.out_parts), in_features), requires_grad=False)
        self.weight.shard_dim, self.weight.shard_parts, self.weight.shard_ranges = 0, list(out_parts), ranges
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(self.out_parts)), requires_grad=False)
            self.bias.shard_dim, self.bias.shard_parts, self.bias.shard_ranges = 0, list(out_parts), ranges

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class RowParallelLinear(KernelWeight):
    """y = x W^T with W's input columns split across ranks, then summed over ranks."""

    def __init__(self, in_features: int, out_features: int, in_range: tuple[int, int] | None = None) -> None:
        """``in_range``: this rank's (start, length) of the inputs (default: an even split)."""
        super().__init__()
        in_range = in_range or even_ranges([in_features])[0]
        self.weight = nn.Parameter(torch.empty(out_features, in_range[1]), requires_grad=False)
        self.weight.shard_dim, self.weight.shard_parts, self.weight.shard_ranges = 1, None, [in_range]
        # decided once, when built: a decode step calls this 60 times, and asking torch.distributed each time is not
        # free; a layer built inside parallel.replicated() stays whole and never reduces
        self.reduce = tp_size() > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        return all_reduce(y) if self.reduce else y


class ReplicatedLinear(KernelWeight):
    """y = x W^T, the whole W on every rank (small layers that are not worth splitting, e.g. a feature draft's
    input projection); takes the few-row kernel like the parallel layers."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.shard_dim, self.weight.shard_parts = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


class VocabParallelEmbedding(KernelWeight):
    """Token embedding whose vocabulary rows are split across ranks (masked lookup + all-reduce); a GGUF
    embedding kept as records rebuilds just the looked-up rows."""

    looks_up_rows = True  # not a projection: kernel_plan packs its LM head instead

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_rank, self.tp_size = tp_rank(), tp_size()  # as built (see parallel.replicated)
        self.shard_size = divide(vocab_size, self.tp_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.shard_size, dim), requires_grad=False)
        self.weight.shard_dim, self.weight.shard_parts = 0, None

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this rank's shard."""
        if self.quant is not None:
            return self.quant.dequantize(ids).view(*ids.shape, -1).to(ids.device)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(ids)
        # each token's row lives on one rank; the others add zeros, so the sum is that row exactly
        local = ids - self.tp_rank * self.shard_size
        inside = (local >= 0) & (local < self.shard_size)
        out = self.lookup(local.clamp(0, self.shard_size - 1)) * inside.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(KernelWeight):
    """Vocabulary-parallel output projection; logits are gathered to full width. A tied head reads the
    embedding's weight (or records)."""

    def __init__(self, vocab_size: int, dim: int, tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tied_to = tied_to
        self.gather = tp_size() > 1  # as built (see parallel.replicated)
        if tied_to is None:
            shard = divide(vocab_size, tp_size(), "vocab_size")
            self.weight = nn.Parameter(torch.empty(shard, dim), requires_grad=False)
            self.weight.shard_dim, self.weight.shard_parts = 0, None

    def owner(self) -> KernelWeight:
        """The layer that holds the weight: the embedding when tied."""
        return self.tied_to if self.tied_to is not None else self

    def get_weight(self) -> torch.Tensor:
        """The float32 weight of the whole vocabulary; a split head gathers every rank's rows (a collective:
        every rank must ask at the same point)."""
        w = self.owner().dense_weight()
        return all_gather_last_dim(w.t().contiguous()).t() if self.gather else w

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = kernel_linear(h, self.packed, None, self.owner().quant is not None, self.owner().dense_weight)
        return all_gather_last_dim(logits) if self.gather else logits
