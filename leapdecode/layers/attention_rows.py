"""Python side of kernels/attention_rows.cpp and attention_rows_i8.cpp: few-token rows' attention over listed paged
K/V slots, float32 or int8 caches (see attention.AttentionMetadata.kernel_rows).
"""

from __future__ import annotations

import torch

from leapdecode.kernels import extension


def attention_rows(q, k_cache, v_cache, rows, spans, slots, scale: float, out: torch.Tensor) -> None:
    """Fill ``out[rows[r]]`` ([T, H, D]) with row ``rows[r]``'s attention over the float32, bfloat16 or float16
    cache slots ``slots[spans[r, 0]:spans[r, 1]]`` (kernels/attention_rows.cpp; see
    attention.AttentionMetadata.kernel_rows)."""
    extension.ext.attention_rows(q, k_cache, v_cache, rows, spans, slots, scale, out)


def attention_rows_i8(q, k_plane, v_plane, rows, spans, slots, scale: float, out: torch.Tensor) -> None:
    """:func:`attention_rows` over an int8 cache (kv_quant.QuantizedKV planes with 16 channels per scale), reading
    the int8 rows directly; ``q`` must already be in the cache's basis, and ``out`` is in it too."""
    extension.ext.attention_rows_i8(q, k_plane.data, k_plane.scale, v_plane.data, v_plane.scale, rows, spans,
                                    slots, scale, out)

