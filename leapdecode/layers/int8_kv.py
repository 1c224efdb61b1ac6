"""Python side of kernels/int8_kv.cpp: the int8 KV cache's quantize-on-write and basis changes in C++."""

from __future__ import annotations

import torch

from leapdecode.kernels import extension


def int8_kv_kernels(plane) -> bool:
    """Whether the int8 C++ ops serve this kv_quant.QuantizedKV plane (CPU, 16 channels per scale, kernel built)."""
    return (extension.ext is not None and plane.data.device.type == "cpu"
            and plane.scale.shape[-1] * 16 == plane.data.shape[-1])


def quantize_kv_rows(x: torch.Tensor, plane, slots: torch.Tensor) -> None:
    """kv_quant.QuantizedKV.write in one C++ call: shift, smooth, rotate, quantize x [T, Hkv, D] into the plane."""
    empty = x.new_empty(0)
    extension.ext.quantize_kv_rows(x.float().contiguous(), empty if plane.shift is None else plane.shift.contiguous(),
                          empty if plane.smooth is None else plane.smooth.contiguous(),
                          empty if plane.rotation is None else plane.rotation.contiguous(), slots, plane.data,
                          plane.scale)  # fmt: skip


def rotate_rows(x: torch.Tensor, smooth: torch.Tensor | None, rotation: torch.Tensor | None,
                transpose: bool) -> torch.Tensor:
    """``(x * smooth) @ R`` (or ``x @ R.T``) for rows x [T, H, D] in one C++ call: the int8 KV cache's query and
    output basis changes, shared by the per-op path and the fused layer so both round alike (int8_kv.cpp)."""
    empty = x.new_empty(0)
    return extension.ext.rotate_rows(x, empty if smooth is None else smooth, empty if rotation is None else rotation,
                            transpose)

