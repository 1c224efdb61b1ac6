// The Python module of the extension: every function the sources list in ops.h, and suffix_index.cpp's class. The
// only source that compiles torch's Python headers (pybind11 and its tensor conversions; suffix_index.cpp takes
// pybind11 alone); the others take tensor_api.h, and the build is 3x shorter for it.
#include <torch/csrc/utils/pybind.h>  // pybind11 with its at::Tensor conversions

#include "ops.h"

// suffix_index.cpp: the suffix tries of suffix drafting, a request's own and the engine's (a Python class)
void bind_suffix_index(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "y = x @ W^T for 1..64 rows, W packed as [N/16, K, 16]");
  m.def("repack_gguf", &repack_gguf, "raw GGUF blocks [N, row bytes] (rows permuted) -> kernel records out [N/16, K/32, bytes]");
  m.def("unpack_records", &unpack_records, "float32 rows of kernel records (bitwise gguf's dequantisation)");
  m.def("natural_kind", &natural_kind, "the record kind of a ggml quantization type id (-1: none)");
  m.def("a8_linear", &a8_linear, "y = x @ W^T with x quantised to int8 per 32 inputs (W4A8 / W8A8, VNNI or AMX)",
        py::arg("x"), py::arg("packed"), py::arg("amx_rows") = -1);
  m.def("set_a8_amx_rows", &set_a8_amx_rows, "the fewest rows a8_linear runs on AMX tiles (0: never)");
  m.def("a8_amx_available", &a8_amx_available, "whether AMX-INT8 tiles are usable here (CPU and OS grant)");
  m.def("a8_amx_rows", &a8_amx_rows, "that setting where AMX tiles are usable here, else 0");
  m.def("isa_peak_macs", &isa_peak_macs, "multiply-adds per second of all threads: int8 (VNNI / AVX2) or float32 FMA");
  m.def("a8_isa", &a8_isa, "what a8_linear was built for: avx512-vnni, avx2, or portable (a slow scalar loop)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32)");
  m.def("attention_rows", &attention_rows, "query rows' attention over listed paged K/V slots (float32)");
  m.def("attention_rows_i8", &attention_rows_i8, "the same over an int8 cache (float16 scales per 16 channels)");
  m.def("quantize_kv_rows", &quantize_kv_rows, "int8 KV quantize-on-write (shift, smooth, rotate, 16-channel scales)");
  m.def("packed_linear", &packed_linear, "y = x @ W^T through W's packed format");
  m.def("rope_", &rope_, "RoPE in place on the first num_heads heads of each row of a fused QKV");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] gate/up projection");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu(gate) * up (tanh form) of a fused [T, 2I] gate/up projection");
  m.def("row_top_k", &row_top_k, "per logits row: its k largest values and indices, and its logsumexp");
  m.def("row_argmax", &row_argmax, "per logits row: the index of its largest value (torch.argmax's)");
  m.def("record_successors", &record_successors, "each logits row's top-k into the successor matrix row of its input token");
  m.def("decoder_layer", &decoder_layer, "one Llama decoder layer for few-token rows in one call");
  m.def("rotate_rows", &rotate_rows, "(x * smooth) @ R, or x @ R^T, per row of [T, H, D] (int8 KV basis changes)");
  m.def("decoder_layer_i8", &decoder_layer_i8, "the same over an int8 KV cache (kv_quant.QuantizedKV planes)");
  m.def("decoder_stack", &decoder_stack, "a run of decoder layers (float32 or int8 cache) for one step in one call");
  bind_suffix_index(m);
}
