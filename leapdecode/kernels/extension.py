"""The one C++ extension every CPU kernel is compiled into (kernels/*.cpp): its sources, its build on first use
(behind :mod:`leapdecode.kernels.build`'s OS lock) for this CPU and these headers, and the loaded module.

Each source has its Python wrapper: ``layers/small_gemm.py`` (small_gemm.cpp), ``layers/int8_gemm.py``
(int8_gemm.cpp, quantize_rows.cpp, amx_int8.cpp), ``layers/block_formats.py`` (gguf_blocks.cpp),
``layers/layer_ops.py`` (layer_ops.cpp), ``layers/attention_rows.py`` (attention_rows.cpp, attention_rows_i8.cpp),
``layers/int8_kv.py`` (int8_kv.cpp) and ``layers/decoder_stack.py`` (decoder_stack.cpp);
``speculative/methods/suffix.py`` uses suffix_index.cpp's class, ``bench/hardware.py`` isa_peak.cpp's probe.
bindings.cpp is the Python module over them all.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import warnings
from pathlib import Path

from leapdecode.kernels.build import load_extension

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = [KERNELS / name for name in ("bindings.cpp", "small_gemm.cpp", "int8_gemm.cpp", "quantize_rows.cpp",
                                       "amx_int8.cpp", "gguf_blocks.cpp", "layer_ops.cpp", "attention_rows.cpp",
                                       "attention_rows_i8.cpp", "int8_kv.cpp", "decoder_stack.cpp", "suffix_index.cpp",
                                       "isa_peak.cpp")]  # one build, one load
ext = None
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


def _checkout_tag() -> str:
    """Short hash of this checkout's kernel folder: torch rebuilds whenever a build's include path changes, so two
    checkouts sharing one build folder would rebuild each other's kernels on every alternate run."""
    return hashlib.sha256(str(KERNELS).encode()).hexdigest()[:6]


def _headers_tag() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(KERNELS.glob("*.h")))).hexdigest()[:12]


def load_kernel(required: bool = False):
    """The compiled extension, building it on first use; None (with one warning) if it cannot be built, or an
    error when ``required``."""
    global ext, _error
    if ext is not None:
        return ext
    if _error is None:
        try:
            from torch.utils.cpp_extension import _get_build_directory

            name = f"leapdecode_small_gemm_{_cpu_tag()}_{_checkout_tag()}"
            if not any(Path(_get_build_directory(name, verbose=False)).glob("*.so")):
                print("leapdecode: building the CPU kernels (once, ~1-2 minutes)", file=sys.stderr, flush=True)
            ext = load_extension(  # behind an OS lock: a killed build cannot wedge later runs
                name=name,
                sources=[str(p) for p in SOURCES],
                # torch rebuilds when a source or a build flag changes: the header's hash is a flag
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-Wno-psabi",
                              f"-DLEAPDECODE_HEADERS={_headers_tag()}"],
                extra_include_paths=[str(KERNELS)],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            return ext
        except Exception as e:  # no compiler, no ninja, unsupported platform
            _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            if not required:
                warnings.warn(f"packed CPU linear kernel unavailable, using torch's linear ({_error})", stacklevel=2)
    if required:
        raise RuntimeError(f'linear_kernel="packed" but the kernel could not be built: {_error}')
    return None

