"""A packed float32 matrix kernel for the few-row projections that dominate decoding on a CPU.

A decode step multiplies 1 row per sequence by every weight matrix; verifying k drafts multiplies k+1 rows. Both
should cost what it costs to read the weights once. torch's CPU ``linear`` does that for one row (a vector-matrix
product), but from 2 rows up it switches to a general GEMM that costs 2-2.5x as much on the machines we measured,
which is exactly why draft verification is expensive on CPUs (the technique brief's "verifying 8 tokens costs ~1x
a step" is a GPU fact). ``kernels/small_gemm.cpp`` keeps it at ~1.0-1.3x up to 8-16 rows; see the bench notes.

Layout: each weight [N, K] gets a second copy packed as [N/16, K, 16] (16 output features per contiguous panel),
built once at load time. Calls with at most ``MAX_ROWS`` rows use it; larger ones (prefill) keep torch's GEMM,
which is compute-bound there and tuned for it. The copy costs one more set of weights in memory
(``linear_kernel="torch"`` turns the kernel off).

Numerics: every output of the kernel is summed in one fixed order whatever the number of rows, so a token's
projections are bit-identical whether it is decoded alone, in a batch of 40, or verified among drafts.

The kernel is C++ compiled on first use with the host compiler (``-march=native``; ~30 s once, cached by torch in
``~/.cache/torch_extensions``). Without a compiler, ``"auto"`` falls back to torch with one warning.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 64  # beyond this the call is compute-bound and torch's GEMM is as fast (measured up to 64)
SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "small_gemm.cpp"
_ext = None
_error: str | None = None


def _cpu_tag() -> str:
    """Short hash of the CPU model and flags: a ``-march=native`` build must not be reused on another CPU."""
    info = platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info += "".join(ln for ln in lines if ln.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha256(info.encode()).hexdigest()[:10]


def load_kernel(required: bool = False):
    """The compiled extension, building it on first use; None (with one warning) if it cannot be built, or an
    error when ``required``."""
    global _ext, _error
    if _ext is not None:
        return _ext
    if _error is None:
        try:
            from torch.utils.cpp_extension import _get_build_directory, load

            name = f"leapdecode_small_gemm_{_cpu_tag()}"
            if not any(Path(_get_build_directory(name, verbose=False)).glob("*.so")):
                print("leapdecode: building the few-row linear kernel (once, ~30 s)", file=sys.stderr, flush=True)
            _ext = load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            return _ext
        except Exception as e:  # no compiler, no ninja, unsupported platform
            _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            if not required:
                warnings.warn(f"packed CPU linear kernel unavailable, using torch's linear ({_error})", stacklevel=2)
    if required:
        raise RuntimeError(f'linear_kernel="packed" but the kernel could not be built: {_error}')
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K, 16]; N must be a multiple of 16 and K even (true of every layer of the models we load)."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def packable(weight: torch.Tensor) -> bool:
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 2 == 0
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """``F.linear`` that takes the packed kernel for few rows (inference only: the kernel has no backward)."""
    if packed is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS and not x.requires_grad and x.shape[0] > 0:
        y = _ext.small_linear(x.contiguous(), packed)
        return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


def enable(model: torch.nn.Module, required: bool = False) -> int:
    """Give every packable projection of ``model`` (layers with a ``packed`` slot) its packed copy. Returns how
    many were packed (0 when the kernel is unavailable). Idempotent."""
    if load_kernel(required) is None:
        return 0
    n = 0
    for mod in model.modules():
        if not hasattr(mod, "packed"):
            continue
        w = mod.get_weight() if hasattr(mod, "get_weight") else mod.weight
        if mod.packed is None and packable(w):
            mod.packed = pack(w)
        n += mod.packed is not None
    return n
