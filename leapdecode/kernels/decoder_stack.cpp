// A whole decoder layer, and a run of them, for a step whose rows are all few-token rows (decode, drafts, trees):
// the same kernels the per-op path calls (so results are bitwise equal to it), minus ~10 Python-level calls per
// layer.
#include "tensor_api.h"

#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"

// The glue between the kernels, without a torch op each: a step of one row spends more time in the dispatcher
// than in these copies and sums. Both give the bits the torch ops they replace give (a copy; one rounding per sum,
// and x + y == y + x in IEEE arithmetic).

// a float32 row stored into a cache row of element type E: copied, or rounded to bfloat16 / float16 as torch's
// .to() rounds
static inline void store_row(float* to, const float* from, int64_t n) { std::memcpy(to, from, n * sizeof(float)); }
template <typename E>
static inline void store_row(E* to, const float* from, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i] = E(from[i]);
}

template <typename E>
static void store_rows(torch::Tensor& cache, const int64_t* slot, const torch::Tensor& src, int64_t row) {
  const int64_t T = src.size(0), num_slots = cache.size(0);
  const float* from = src.data_ptr<float>();
  E* to = cache.data_ptr<E>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "decoder_layer: slot ", slot[t], " out of range [0, ",
                num_slots, ")");
    store_row(to + slot[t] * row, from + t * src.stride(0), row);
  }
}

// cache[slot_mapping[t]] = src[t] for each row t of src [T, Hkv, D] (rows may be strided, each row contiguous), as
// cache.index_copy_(0, slot_mapping, src.to(cache.dtype)) does
static void write_cache_rows(torch::Tensor& cache, const torch::Tensor& slot_mapping, const torch::Tensor& src) {
  const int64_t T = src.size(0), row = cache.size(1) * cache.size(2);
  const auto dtype = cache.scalar_type();
  TORCH_CHECK(cache.is_contiguous() && src.scalar_type() == torch::kFloat &&
                  (dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf) &&
                  src.dim() == 3 && src.size(1) * src.size(2) == row && src.stride(2) == 1 &&
                  src.stride(1) == src.size(2) && slot_mapping.numel() == T &&
                  slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous(),
              "decoder_layer: K/V rows [T, Hkv, D] float32 with contiguous rows, a float32, bfloat16 or float16 "
              "cache [slots, Hkv, D], T slots");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  if (dtype == torch::kFloat)
    store_rows<float>(cache, slot, src, row);
  else if (dtype == torch::kBFloat16)
    store_rows<c10::BFloat16>(cache, slot, src, row);
  else
    store_rows<c10::Half>(cache, slot, src, row);
}

// y += x, both [T, N] contiguous float32: the residual sum, in y's storage
static torch::Tensor add_rows_(torch::Tensor y, const torch::Tensor& x) {
  TORCH_CHECK(y.sizes() == x.sizes() && y.is_contiguous() && x.is_contiguous() &&
                  y.scalar_type() == torch::kFloat && x.scalar_type() == torch::kFloat,
              "decoder_layer: residual sum of two contiguous float32 [T, N] tensors");
  float* __restrict dst = y.data_ptr<float>();
  const float* __restrict src = x.data_ptr<float>();
  const int64_t n = y.numel();
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
  return y;
}

// w = [input_norm, qkv_packed, o_packed, post_attention_norm, gate_up_packed, down_packed].
// the parts of a decoder layer around attention, shared by decoder_layer and decoder_layer_i8: the fused QKV
// projection of the normed input with RoPE applied in place, and o_proj + residual + MLP + residual
static torch::Tensor layer_qkv(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                               const std::optional<torch::Tensor>& qkv_bias, const torch::Tensor& cos,
                               const torch::Tensor& sin_signed, int64_t rope_heads, double eps) {
  auto qkv = packed_linear(rms_norm(x, w[0], eps), w[1]);
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  rope_(qkv, cos, sin_signed, rope_heads);
  return qkv;
}

static torch::Tensor layer_out(const torch::Tensor& x, const torch::Tensor& attn, const std::vector<torch::Tensor>& w,
                               double eps) {
  const auto h = add_rows_(packed_linear(attn, w[2]), x);
  return add_rows_(packed_linear(silu_mul(packed_linear(rms_norm(h, w[3], eps), w[4])), w[5]), h);
}

torch::Tensor decoder_layer(torch::Tensor x, std::vector<torch::Tensor> w, std::optional<torch::Tensor> qkv_bias,
                            torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slot_mapping, torch::Tensor rows, torch::Tensor spans, torch::Tensor slots,
                            int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  TORCH_CHECK(w.size() == 6, "decoder_layer: 6 weights");
  const int64_t T = x.size(0), d = k_cache.size(2);
  auto qkv = layer_qkv(x, w, qkv_bias, cos, sin_signed, num_heads + num_kv_heads, eps);
  auto q = qkv.narrow(1, 0, num_heads * d).contiguous().view({T, num_heads, d});
  write_cache_rows(k_cache, slot_mapping, qkv.narrow(1, num_heads * d, num_kv_heads * d).view({T, num_kv_heads, d}));
  write_cache_rows(v_cache, slot_mapping,
                   qkv.narrow(1, (num_heads + num_kv_heads) * d, num_kv_heads * d).view({T, num_kv_heads, d}));
  auto o = torch::empty_like(q);
  attention_rows(q, k_cache, v_cache, rows, spans, slots, scale, o);
  return layer_out(x, o.view({T, num_heads * d}), w, eps);
}

// Attention of one layer's rows over an int8 KV cache (layers/kv_quant.py QuantizedKV planes): q [T, H, d], k and
// v [T, Hkv, d] in the model's basis (views of the projection's output). The per-op path's steps with its own C++
// routines (attention.paged_attention on int8 planes): queries into the cache's basis ((q s) @ R), keys and values
// quantized on write, the int8 rows kernel, outputs back out of the value basis (@ R^T); so the same bits. planes:
// k_data, k_scale, v_data, v_scale; transform: k_shift, k_smooth, k_rotation, v_rotation, v_rotation transposed
// (contiguous: made once by the cache, not per call; each may be empty = identity); rows: the rows kernel's rows,
// spans, slots. Returns the outputs [T, H * d].
static torch::Tensor attend_i8(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor* planes, const torch::Tensor* transform,
                               const torch::Tensor& slot_mapping, const torch::Tensor* rows, double scale) {
  const torch::Tensor &k_shift = transform[0], &k_smooth = transform[1], &k_rot = transform[2],
                      &v_rot = transform[3], &v_rot_t = transform[4];
  const int64_t T = q.size(0), H = q.size(1), d = q.size(2);
  const auto qb = rotate_rows(q, k_smooth, k_rot, false);
  const auto empty = q.new_empty({0});
  quantize_kv_rows(k.contiguous(), k_shift, k_smooth, k_rot, slot_mapping, planes[0], planes[1]);
  quantize_kv_rows(v.contiguous(), empty, empty, v_rot, slot_mapping, planes[2], planes[3]);
  auto o = torch::empty_like(qb);
  attention_rows_i8(qb.contiguous(), planes[0], planes[1], planes[2], planes[3], rows[0], rows[1], rows[2], scale, o);
  return rotate_rows(o, empty, v_rot_t, false).view({T, H * d});
}

// decoder_layer over an int8 KV cache: Llama's layer around attend_i8.
torch::Tensor decoder_layer_i8(torch::Tensor x, std::vector<torch::Tensor> w, std::optional<torch::Tensor> qkv_bias,
                               torch::Tensor cos, torch::Tensor sin_signed, std::vector<torch::Tensor> planes,
                               std::vector<torch::Tensor> transform, torch::Tensor slot_mapping, torch::Tensor rows,
                               torch::Tensor spans, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads,
                               double eps, double scale) {
  TORCH_CHECK(w.size() == 6 && planes.size() == 4 && transform.size() == 5,
              "decoder_layer_i8: 6 weights, 4 planes, 5 transforms");
  const int64_t T = x.size(0), d = planes[0].size(2), H = num_heads, Hkv = num_kv_heads;
  auto qkv = layer_qkv(x, w, qkv_bias, cos, sin_signed, H + Hkv, eps);
  const torch::Tensor row_set[3] = {rows, spans, slots};
  const auto o = attend_i8(qkv.narrow(1, 0, H * d).view({T, H, d}), qkv.narrow(1, H * d, Hkv * d).view({T, Hkv, d}),
                           qkv.narrow(1, (H + Hkv) * d, Hkv * d).view({T, Hkv, d}), planes.data(), transform.data(),
                           slot_mapping, row_set, scale);
  return layer_out(x, o, w, eps);
}

// The parts of Qwen3's and Gemma 3's layers beyond Llama's: q and k normed per head before RoPE (norms[0],
// norms[1]), the attention and MLP outputs normed before their residual adds (norms[2], norms[3]; Gemma), GeGLU for
// SiLU. Empty tensors are absent parts. caches: K, V (a float32, bfloat16 or float16 cache), or with `transform`
// (not null) the 4 int8 planes that attend_i8 takes. The same routines, in the same order, as models/llama.py's
// per-op path, so the same bits.
static torch::Tensor normed_layer(torch::Tensor x, const std::vector<torch::Tensor>& w,
                                  const std::optional<torch::Tensor>& qkv_bias, const torch::Tensor* norms,
                                  const torch::Tensor& cos, const torch::Tensor& sin_signed,
                                  const torch::Tensor* caches, const torch::Tensor* transform,
                                  const torch::Tensor& slot_mapping, const torch::Tensor* rows, int64_t H, int64_t Hkv,
                                  double eps, double scale, bool gelu) {
  const int64_t T = x.size(0), d = caches[0].size(2);
  auto qkv = packed_linear(rms_norm(x, w[0], eps), w[1]);
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  const auto v = qkv.narrow(1, (H + Hkv) * d, Hkv * d).view({T, Hkv, d});
  torch::Tensor qk = qkv;
  if (norms[0].numel()) {
    const auto q = rms_norm(qkv.narrow(1, 0, H * d).contiguous().view({T, H, d}), norms[0], eps);
    const auto k = rms_norm(qkv.narrow(1, H * d, Hkv * d).contiguous().view({T, Hkv, d}), norms[1], eps);
    qk = torch::cat({q, k}, 1).view({T, -1});
  }
  rope_(qk, cos, sin_signed, H + Hkv);
  auto q = qk.narrow(1, 0, H * d).contiguous().view({T, H, d});
  const auto k = qk.narrow(1, H * d, Hkv * d).view({T, Hkv, d});
  torch::Tensor o;
  if (transform != nullptr) {
    o = attend_i8(q, k, v, caches, transform, slot_mapping, rows, scale);
  } else {
    torch::Tensor k_cache = caches[0], v_cache = caches[1];
    write_cache_rows(k_cache, slot_mapping, k);
    write_cache_rows(v_cache, slot_mapping, v);
    o = torch::empty_like(q);
    attention_rows(q, k_cache, v_cache, rows[0], rows[1], rows[2], scale, o);
    o = o.view({T, H * d});
  }
  auto a = packed_linear(o, w[2]);
  const auto h = add_rows_(norms[2].numel() ? rms_norm(a, norms[2], eps) : a, x);
  const auto up = packed_linear(rms_norm(h, w[3], eps), w[4]);
  const auto m = packed_linear(gelu ? gelu_tanh_mul(up) : silu_mul(up), w[5]);
  return add_rows_(norms[3].numel() ? rms_norm(m, norms[3], eps) : m, h);
}

// A run of decoder layers for one step in one call: decoder_layer (float32 cache) or decoder_layer_i8 (int8
// cache) per layer, in order -- the same routines, so bitwise the per-layer result -- without a Python-level call
// per layer (~30 of them per decode step, ~10% of a 12 ms step on a 2-core CPU). The caller builds the flat
// argument lists once (models/llama.py LlamaForCausalLM._layer_stack). Per layer: 6 weights (as decoder_layer),
// 1 bias (empty = none), 2 caches (K, V float32) or 4 (int8 planes k_data, k_scale, v_data, v_scale), and with
// int8 planes 5 transforms (attend_i8's). `norms`: empty (Llama's layout) or 4 per layer for normed_layer (over
// either cache). `ropes`: cos, sin_signed of the global layers, then of the windowed ones; `row_sets`: rows,
// spans, slots of the attention rows kernel as the global layers see the step, then as the windowed ones do;
// `windowed[i]`: layer i takes the second of each.
torch::Tensor decoder_stack(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> biases,
                            std::vector<torch::Tensor> norms, std::vector<torch::Tensor> ropes,
                            std::vector<torch::Tensor> caches, std::vector<torch::Tensor> transforms,
                            torch::Tensor slot_mapping, std::vector<torch::Tensor> row_sets,
                            std::vector<int64_t> windowed, int64_t num_heads, int64_t num_kv_heads, double eps,
                            double scale, bool gelu) {
  const size_t n = biases.size();
  const bool int8 = !transforms.empty(), normed = !norms.empty();
  TORCH_CHECK(weights.size() == 6 * n && caches.size() == (int8 ? 4 : 2) * n && (!int8 || transforms.size() == 5 * n),
              "decoder_stack: per layer 6 weights, 1 bias, 2 float32 caches or 4 int8 planes + 5 transforms");
  TORCH_CHECK(ropes.size() == 4 && row_sets.size() == 6 && windowed.size() == n,
              "decoder_stack: 2 RoPE tables, 2 row sets, a window flag per layer");
  TORCH_CHECK(!normed || norms.size() == 4 * n, "decoder_stack: 4 norms per layer");
  TORCH_CHECK(normed || !gelu, "decoder_stack: GeGLU layers take the normed layout");
  for (size_t i = 0; i < n; ++i) {
    std::vector<torch::Tensor> w(weights.begin() + 6 * i, weights.begin() + 6 * (i + 1));
    const auto bias = biases[i].numel() ? std::optional<torch::Tensor>(biases[i]) : std::nullopt;
    const int64_t s = windowed[i] ? 1 : 0;
    const torch::Tensor &cos = ropes[2 * s], &sin_signed = ropes[2 * s + 1];
    const torch::Tensor* rows = row_sets.data() + 3 * s;
    if (normed) {
      x = normed_layer(x, w, bias, norms.data() + 4 * i, cos, sin_signed, caches.data() + (int8 ? 4 : 2) * i,
                       int8 ? transforms.data() + 5 * i : nullptr, slot_mapping, rows, num_heads, num_kv_heads, eps,
                       scale, gelu);
    } else if (int8) {
      x = decoder_layer_i8(x, w, bias, cos, sin_signed, {caches.begin() + 4 * i, caches.begin() + 4 * (i + 1)},
                           {transforms.begin() + 5 * i, transforms.begin() + 5 * (i + 1)}, slot_mapping, rows[0],
                           rows[1], rows[2], num_heads, num_kv_heads, eps, scale);
    } else {
      x = decoder_layer(x, w, bias, cos, sin_signed, caches[2 * i], caches[2 * i + 1], slot_mapping, rows[0],
                        rows[1], rows[2], num_heads, num_kv_heads, eps, scale);
    }
  }
  return x;
}
