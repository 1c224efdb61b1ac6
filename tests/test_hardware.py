"""The hardware line of every benchmark table: the CPU's name, its x86 family and model, and the vector features
the kernels dispatch on, read from /proc/cpuinfo's text."""

from __future__ import annotations

from leapdecode.bench.hardware import cpu_description

AMD_VM = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 17
model name	: AMD EPYC
flags		: fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni
processor	: 1
cpu family	: 25
model		: 17
model name	: AMD EPYC
flags		: fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni
"""
XEON_AMX = """cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
AVX2_ONLY = """cpu family	: 23
model		: 49
model name	: AMD EPYC 7B12
flags		: fpu avx avx2 fma
"""


def test_cpu_line_names_family_model_and_features():
    assert cpu_description(AMD_VM) == "AMD EPYC (family 25 model 17), AVX-512 + VNNI + BF16"
    assert cpu_description(XEON_AMX) == ("Intel(R) Xeon(R) Platinum 8480+ (family 6 model 143), "
                                         "AVX-512 + VNNI + BF16 + AMX")
    assert cpu_description(AVX2_ONLY) == "AMD EPYC 7B12 (family 23 model 49), AVX2"


def test_cpu_line_without_a_model_name_is_empty():
    # e.g. an ARM machine's cpuinfo: the caller falls back to platform's processor name
    assert cpu_description("processor : 0\nFeatures : fp asimd\nCPU implementer : 0x41\n") == ""
