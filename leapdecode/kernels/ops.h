// The functions each source of the extension defines for the others and for the Python binding (bindings.cpp
// binds them all): one list, included everywhere, instead of declarations copied by hand.
#pragma once
#include "tensor_api.h"

#include <optional>
#include <string>
#include <vector>

// small_gemm.cpp: float32 panels and block records
torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed);
// int8_gemm.cpp: int8 activations
// amx_rows: AMX tiles (amx_int8.cpp, the same results) for calls of at least this many rows where the CPU has
// them; -1: the setting of set_a8_amx_rows (0: never)
torch::Tensor a8_linear(torch::Tensor x, torch::Tensor packed, int64_t amx_rows = -1);
std::string a8_isa();
void set_a8_amx_rows(int64_t rows);
int64_t a8_amx_rows();
bool a8_amx_available();  // amx_int8.cpp
// gguf_blocks.cpp: GGUF blocks <-> records
void repack_gguf(torch::Tensor raw, int64_t type, torch::Tensor rows, torch::Tensor out);
torch::Tensor unpack_records(torch::Tensor records, torch::Tensor rows);
int64_t natural_kind(int64_t type);
// layer_ops.cpp: per-row ops of a layer
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed, int64_t num_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> row_top_k(torch::Tensor logits, int64_t k);
std::vector<int64_t> row_argmax(torch::Tensor logits);
void record_successors(torch::Tensor logits, const std::vector<int64_t>& tokens, torch::Tensor succ_tokens,
                       torch::Tensor succ_probs);
// attention_rows.cpp, attention_rows_i8.cpp: few-row attention over the paged cache (float32 and int8)
void attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor rows,
                    torch::Tensor spans, torch::Tensor slots, double scale, torch::Tensor out);
void attention_rows_i8(torch::Tensor q, torch::Tensor k_data, torch::Tensor k_scale, torch::Tensor v_data,
                       torch::Tensor v_scale, torch::Tensor rows, torch::Tensor spans, torch::Tensor slots,
                       double scale, torch::Tensor out);
// int8_kv.cpp: the int8 KV cache's writes and basis changes
void check_int8_plane(const torch::Tensor& data, const torch::Tensor& scale, const char* what);
void quantize_kv_rows(torch::Tensor x, torch::Tensor shift, torch::Tensor smooth, torch::Tensor rotation,
                      torch::Tensor slots, torch::Tensor data, torch::Tensor scale);
torch::Tensor rotate_rows(torch::Tensor x, torch::Tensor smooth, torch::Tensor rot, bool transpose);
// decoder_stack.cpp: a whole layer, and a run of layers, in one call
torch::Tensor decoder_layer(torch::Tensor x, std::vector<torch::Tensor> w, std::optional<torch::Tensor> qkv_bias,
                            torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slot_mapping, torch::Tensor rows, torch::Tensor spans, torch::Tensor slots,
                            int64_t num_heads, int64_t num_kv_heads, double eps, double scale);
torch::Tensor decoder_layer_i8(torch::Tensor x, std::vector<torch::Tensor> w, std::optional<torch::Tensor> qkv_bias,
                               torch::Tensor cos, torch::Tensor sin_signed, std::vector<torch::Tensor> planes,
                               std::vector<torch::Tensor> transform, torch::Tensor slot_mapping, torch::Tensor rows,
                               torch::Tensor spans, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads,
                               double eps, double scale);
torch::Tensor decoder_stack(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> biases,
                            std::vector<torch::Tensor> norms, std::vector<torch::Tensor> ropes,
                            std::vector<torch::Tensor> caches, std::vector<torch::Tensor> transforms,
                            torch::Tensor slot_mapping, std::vector<torch::Tensor> row_sets,
                            std::vector<int64_t> windowed, int64_t num_heads, int64_t num_kv_heads, double eps,
                            double scale, bool gelu);
// isa_peak.cpp: multiply-adds per second of all threads with the int8 or float32 kernels' instruction
double isa_peak_macs(const std::string& kind, double seconds);
