"""GGUF weights for a GPU: quantized matrices are dequantised at load to the engine's dtype and placed on the device
(the CPU kernel's block records are never built there). Runs on CUDA when present, else checks the same rule on the
CPU with a half-precision dtype (which also turns the records off)."""

from __future__ import annotations

import pytest
import torch

from leapdecode.models.loader import load_model
from tests.test_gguf_types import write_tiny_gguf

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gguf_dequantised_to_the_chosen_dtype(tmp_path, dtype):
    path = write_tiny_gguf(tmp_path / "m.gguf", {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q8_0"})
    model, _ = load_model(path, dtype, DEVICE)
    ref, _ = load_model(path, torch.float32, "cpu", keep_blocks=False)  # gguf's float32 dequantisation
    assert not any(getattr(m, "quant", None) is not None for m in model.modules())
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == dtype and p.device.type == DEVICE.type, name
        assert torch.equal(p.cpu(), q.to(dtype)), name  # one rounding, from the exact float32 weights
