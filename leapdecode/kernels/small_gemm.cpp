// y[M, N] = x[M, K] @ W^T for few rows (decode steps, draft/tree verification, small batches): M <= 64.
//
// W is pre-packed into panels of 16 output features, [N/16][K][16]: one panel is one contiguous stream and each
// 64-byte row of it (16 outputs at one k) is one cache line. For each panel the kernel walks the rows of x in
// chunks of up to 8 (AVX-512) or 4 (AVX2, one 8-output half of the panel at a time), keeping a chunk's partial
// sums in vector registers (two sets, for even and odd k, to halve the FMA dependency chains). The panel (36 KB
// at K = 576) comes from memory once and stays in L1/L2 for the later chunks, so the call stays bound by weight
// bandwidth well past M = 8, where a general small-M GEMM costs 2-2.5x a vector-matrix product on the CPUs we
// measured.
//
// Every output element is summed in the same order (even and odd k separately, then added) whatever M and the
// row's chunk are, so a token's result does not depend on how many rows share the call: plain decoding and the
// verification of drafts see bit-identical projections.
#include "tensor_api.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "block_formats.h"
#include "few_rows.h"
#include "ops.h"

typedef float v16f __attribute__((vector_size(64)));
constexpr int64_t PREFETCH = 32;  // k-rows (cache lines) ahead in the panel stream
// The one accumulation every kernel here uses (even and odd k in separate sums, added at the end): sharing it is
// what keeps the block-format kernels bit-identical to the float32 one.
template <int R>
static inline void accumulate_pair(v16f* acc0, v16f* acc1, v16f w0, v16f w1, const float* x, int64_t K, int64_t k) {
  for (int r = 0; r < R; ++r) {
    acc0[r] += w0 * x[r * K + k];
    acc1[r] += w1 * x[r * K + k + 1];
  }
}

template <int R>
static inline void store_rows(const v16f* acc0, const v16f* acc1, float* y, int64_t N) {
  for (int r = 0; r < R; ++r) {
    v16f s = acc0[r] + acc1[r];
    __builtin_memcpy(y + r * N, &s, 64);
  }
}

template <int R>
static inline void rows_x_panel(const float* __restrict x, const float* __restrict w, float* __restrict y,
                                int64_t K, int64_t N) {
  v16f acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = v16f{};
  for (int64_t k = 0; k < K; k += 2) {
    __builtin_prefetch(w + (k + PREFETCH) * 16);
    __builtin_prefetch(w + (k + PREFETCH + 1) * 16);
    v16f w0, w1;
    __builtin_memcpy(&w0, w + k * 16, 64);
    __builtin_memcpy(&w1, w + (k + 1) * 16, 64);
    accumulate_pair<R>(acc0, acc1, w0, w1, x, K, k);
  }
  store_rows<R>(acc0, acc1, y, N);
}

static void rows_x_panel_any(int64_t rows, const float* x, const float* w, float* y, int64_t K, int64_t N) {
  with_rows(rows, [&](auto R) { rows_x_panel<R.value>(x, w, y, K, N); });
}

#ifdef HALF_PANELS
// AVX2 (16 registers of 8 floats). The v16f kernels kept 8 rows x 16 outputs x 2 sums, which spilled to the
// stack here: a 1-row Q4 call ran at 2.7 GB/s and its cost grew linearly with rows. These kernels take one 8-output
// half of a panel at a time (the second pass finds the panel in L1/L2). Per lane: w * x fused into the even or
// odd sum in k order, the two added at the end. The FMA is explicit because the compiler's own contraction of a
// multiply and an add differed between instantiations, which broke the float32 / block-kernel identity.

// One panel's weights, visited as f(k, w0, w1) for each input pair (k, k + 1) of inputs k0 .. k0+31, outputs
// 8h .. 8h+7 (or both halves at once, `both`): read from a float32 panel, or rebuilt from Q4/Q8 records exactly as
// dequant_pair does
struct FloatPanel {
  const float* w;
  int64_t K;
  template <class F>
  void operator()(int64_t k0, int h, F&& f) const {
    for (int64_t k = k0; k < std::min<int64_t>(k0 + 32, K); k += 2) {
      if (h == 0) {
        __builtin_prefetch(w + (k + PREFETCH) * 16);
        __builtin_prefetch(w + (k + PREFETCH + 1) * 16);
      }
      f(k, _mm256_loadu_ps(w + k * 16 + 8 * h), _mm256_loadu_ps(w + (k + 1) * 16 + 8 * h));
    }
  }
  template <class F>
  void both(int64_t k0, F&& f) const {
    for (int64_t k = k0; k < std::min<int64_t>(k0 + 32, K); k += 2) {
      __builtin_prefetch(w + (k + PREFETCH) * 16);
      __builtin_prefetch(w + (k + PREFETCH + 1) * 16);
      f(k, _mm256_loadu_ps(w + k * 16), _mm256_loadu_ps(w + (k + 1) * 16), _mm256_loadu_ps(w + k * 16 + 8),
        _mm256_loadu_ps(w + (k + 1) * 16 + 8));
    }
  }
};

// one 32-input block's weights for outputs 8 ho .. 8 ho + 7: its scales and minima read once, then the weights
// of input pair i (0..15) rebuilt on demand
template <int KIND>
struct BlockHalf {
  static constexpr int64_t REC = record_bytes(KIND), SPAN = kind_span(KIND), SUB = REC * 32 / SPAN;
  const uint8_t* rec;
  const uint8_t* c;
  int sb, ho;
  __m256 s[2], m[2];  // per block half (inputs 0-15, 16-31): scale and minimum of the 8 outputs
  __m128i bytes(const uint8_t* p) const { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * ho)); }
  __m256 i8f(const uint8_t* p) const { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(p))); }
  __m256 u8f(const uint8_t* p) const { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes(p))); }
  __m256 f32(int64_t off) const { return _mm256_loadu_ps(reinterpret_cast<const float*>(rec + off) + 8 * ho); }

  BlockHalf(const uint8_t* records, int64_t k0, int half)
      : rec(records + (k0 / SPAN) * REC), sb(int((k0 % SPAN) / 32)), ho(half) {
    if constexpr (KIND == KIND_Q4 || KIND == KIND_Q8M) {
      s[0] = s[1] = f32(0), m[0] = m[1] = f32(64);
    } else if constexpr (KIND == KIND_Q4H) {
      s[0] = s[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * ho)));
      m[0] = m[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 + 16 * ho)));
    } else if constexpr (KIND == KIND_Q8S) {
      for (int h = 0; h < 2; ++h) s[h] = _mm256_mul_ps(f32(0), i8f(rec + 64 + 16 * h)), m[h] = _mm256_setzero_ps();
    } else if constexpr (KIND == KIND_Q4S) {
      for (int h = 0; h < 2; ++h) {
        s[h] = _mm256_mul_ps(f32(0), u8f(rec + 128 + 16 * h));
        m[h] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(f32(64), u8f(rec + 160 + 16 * h)));
      }
    } else if constexpr (KIND == KIND_Q4K) {
      s[0] = s[1] = _mm256_mul_ps(f32(0), u8f(rec + 128 + 16 * sb));
      m[0] = m[1] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(f32(64), u8f(rec + 256 + 16 * sb)));
    } else if constexpr (KIND == KIND_Q6K) {
      for (int h = 0; h < 2; ++h)
        s[h] = _mm256_mul_ps(f32(0), i8f(rec + 64 + 16 * (2 * sb + h))), m[h] = _mm256_setzero_ps();
    } else {
      s[0] = s[1] = f32(0), m[0] = m[1] = _mm256_setzero_ps();
    }
    c = rec + kind_codes_offset(KIND) + (KIND == KIND_Q4K ? 256 * sb : 0);
  }
  void prefetch() const {  // about PREFETCH_RECORDS 32-input blocks ahead, whatever the record's span
    for (int64_t line = 0; line < SUB; line += 64) __builtin_prefetch(rec + sb * SUB + PREFETCH_RECORDS * SUB + line);
  }
  // the weights of inputs k0 + 2i and k0 + 2i + 1
  void pair(int i, __m256& w0, __m256& w1) const {
    const int h = i / 8;
    if constexpr (KIND == KIND_Q6K) {
      const __m256i lo = _mm256_cvtepu8_epi32(bytes(c + 256 * sb + i * 16));
      const __m256i hi = _mm256_srli_epi32(_mm256_cvtepu8_epi32(bytes(rec + 2368 + 128 * sb + (i / 2) * 16)),
                                           4 * (i % 2));
      const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32), low4 = _mm256_set1_epi32(15);
      const __m256i q0 = _mm256_or_si256(_mm256_and_si256(lo, low4), _mm256_slli_epi32(_mm256_and_si256(hi, three), 4));
      const __m256i q1 = _mm256_or_si256(_mm256_srli_epi32(lo, 4),
                                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 2), three), 4));
      w0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(q0, bias)), w1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, bias));
    } else if constexpr (kind_nibbles(KIND)) {
      const __m256i b = _mm256_cvtepu8_epi32(bytes(c + i * 16));
      w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
      w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    } else if constexpr (kind_unsigned(KIND)) {
      w0 = u8f(c + i * 32), w1 = u8f(c + i * 32 + 16);
    } else {
      w0 = i8f(c + i * 32), w1 = i8f(c + i * 32 + 16);
    }
    if constexpr (KIND == KIND_Q8 || KIND == KIND_Q8S || KIND == KIND_Q6K) {
      w0 = _mm256_mul_ps(w0, s[h]), w1 = _mm256_mul_ps(w1, s[h]);
    } else {
      w0 = _mm256_add_ps(_mm256_mul_ps(w0, s[h]), m[h]), w1 = _mm256_add_ps(_mm256_mul_ps(w1, s[h]), m[h]);
    }
  }
};

// The pair loops are unrolled (pragmas): rolled, GCC read the block's scales through a stack array at a computed
// index on every pair. Same operations in the same order, so the same bits; a float32 step 1.35-1.43x faster at
// one row, 1.14-1.23x at 4-16 (kernel_ab, bundled model, Zen 3). FloatPanel's loops measured the same either way.
template <int KIND>
struct BlockPanel {
  const uint8_t* records;
  template <class F>
  void operator()(int64_t k0, int ho, F&& f) const {
    const BlockHalf<KIND> half(records, k0, ho);
    if (ho == 0) half.prefetch();
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      __m256 w0, w1;
      half.pair(i, w0, w1);
      f(k0 + 2 * i, w0, w1);
    }
  }
  // both halves at once: f(k, w0, w1 of outputs 0-7, w0, w1 of outputs 8-15)
  template <class F>
  void both(int64_t k0, F&& f) const {
    const BlockHalf<KIND> lo(records, k0, 0), hi(records, k0, 1);
    lo.prefetch();
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      __m256 a0, a1, b0, b1;
      lo.pair(i, a0, a1);
      hi.pair(i, b0, b1);
      f(k0 + 2 * i, a0, a1, b0, b1);
    }
  }
};

template <int R>
static inline void fma_rows(__m256* a0, __m256* a1, __m256 w0, __m256 w1, const float* x, int64_t K, int64_t k) {
  for (int r = 0; r < R; ++r) {
    a0[r] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x + r * K + k), a0[r]);
    a1[r] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(x + r * K + k + 1), a1[r]);
  }
}

// y [M, the panel's 16 outputs] = x @ W^T, ROW_CHUNK rows at a time with their sums in registers for the whole
// panel; each chunk rebuilds the block weights again, which still beat rebuilding a block once into an L1 buffer
// and streaming the chunks' sums through memory (~2x at 8-16 rows, 1.3x at 32: linear_bench, Q4_1)
template <int R, class Panel>
static inline void rows_x_half_panels(const Panel& panel, const float* x, float* y, int64_t K, int64_t N) {
  // one or two rows take both halves in one pass: each sum in the same order, twice the FMA chains in flight (one
  // row 1.08-1.22x a step, where one chain's FMA latency bounded the loop; two rows, once BlockPanel's loops were
  // unrolled and stopped spilling, 1.02-1.14x a step and 1.55-1.59x on float32 panels; kernel_ab, Zen 3; 3 rows 0.85x)
  if constexpr (R <= 2) {
    __m256 a0[R], a1[R], b0[R], b1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = b0[r] = b1[r] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 32)
      panel.both(k0, [&](int64_t k, __m256 u0, __m256 u1, __m256 v0, __m256 v1) {
        fma_rows<R>(a0, a1, u0, u1, x, K, k);
        fma_rows<R>(b0, b1, v0, v1, x, K, k);
      });
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * N, _mm256_add_ps(a0[r], a1[r]));
      _mm256_storeu_ps(y + r * N + 8, _mm256_add_ps(b0[r], b1[r]));
    }
    return;
  }
  for (int h = 0; h < 2; ++h) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 32)
      panel(k0, h, [&](int64_t k, __m256 w0, __m256 w1) { fma_rows<R>(a0, a1, w0, w1, x, K, k); });
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + 8 * h, _mm256_add_ps(a0[r], a1[r]));
  }
}

template <class Panel>
static void panel_rows(int64_t M, const Panel& panel, const float* x, float* y, int64_t K, int64_t N) {
  for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK)
    with_rows(M - r0, [&](auto R) { rows_x_half_panels<R.value>(panel, x + r0 * K, y + r0 * N, K, N); });
}
#endif

torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "small_linear: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == torch::kFloat &&
                  packed.is_contiguous(),
              "small_linear: packed weight must be a contiguous [N/16, K, 16] float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) == K && K % 2 == 0, "small_linear: K mismatch or odd K");
  TORCH_CHECK(M >= 1 && M <= 64, "small_linear: 1..64 rows");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // ~8 panels (300 KB of weights at K = 576) per task keeps the threading overhead small against the reads
  auto panels = [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* w = wp + p * K * 16;
#ifdef HALF_PANELS
      panel_rows(M, FloatPanel{w, K}, xp, yp + p * 16, K, N);
#else
      for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK)
        rows_x_panel_any(std::min<int64_t>(ROW_CHUNK, M - r0), xp + r0 * K, w, yp + r0 * N + p * 16, K, N);
#endif
    }
  };
  over_panels(N / 16, 8, 4, panels);
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// The same products with the weights kept in the checkpoint's own block formats, repacked into the records of
// block_formats.h (kernels/gguf_blocks.cpp): per record of 16 output rows and 32 inputs, the kernel rebuilds in
// registers exactly the float32 weights gguf's dequantisation produces (code * scale + minimum, with every
// product exact or rounded as gguf rounds it), and sums them in exactly the order of the float32 kernel above.
// Results are bit-identical to it (tested) while a step reads 4.75-10 bits per weight instead of 32.
// AVX2 builds rebuild the weights in BlockPanel (above); the v16f conversions below serve the other builds.
#ifndef HALF_PANELS
#ifdef __AVX512F__
// 16 bytes -> 16 floats: the low / high nibbles of unsigned bytes, signed bytes, unsigned bytes
static inline void nibbles_to_floats(const uint8_t* p, v16f& lo, v16f& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = (v16f)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = (v16f)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
static inline v16f int8s_to_floats(const uint8_t* p) {
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline v16f uint8s_to_floats(const uint8_t* p) {
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline v16f halves_to_floats(const uint8_t* p) {
  return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else  // portable (slow) fallback: GCC turns byte-vector conversions into scalar code anyway
static inline void nibbles_to_floats(const uint8_t* p, v16f& lo, v16f& hi) {
  for (int j = 0; j < 16; ++j) lo[j] = float(p[j] & 15), hi[j] = float(p[j] >> 4);
}
static inline v16f int8s_to_floats(const uint8_t* p) {
  v16f v;
  for (int j = 0; j < 16; ++j) v[j] = float(static_cast<int8_t>(p[j]));
  return v;
}
static inline v16f uint8s_to_floats(const uint8_t* p) {
  v16f v;
  for (int j = 0; j < 16; ++j) v[j] = float(p[j]);
  return v;
}
static inline v16f halves_to_floats(const uint8_t* p) {
  v16f v;
  for (int j = 0; j < 16; ++j) {
    uint16_t h;
    __builtin_memcpy(&h, p + 2 * j, 2);
    v[j] = half_bits_to_float(h);
  }
  return v;
}
#endif

// One record's scale and minimum for its two block halves (inputs 0-15 and 16-31), as block_formats.h defines them
template <int KIND>
static inline void record_header(const uint8_t* rec, int sb, v16f* s, v16f* m) {
  auto f32 = [&](int64_t off) {
    v16f v;
    __builtin_memcpy(&v, rec + off, 64);
    return v;
  };
  if constexpr (KIND == KIND_Q4 || KIND == KIND_Q8M) {
    s[0] = s[1] = f32(0), m[0] = m[1] = f32(64);
  } else if constexpr (KIND == KIND_Q4H) {
    s[0] = s[1] = halves_to_floats(rec), m[0] = m[1] = halves_to_floats(rec + 32);
  } else if constexpr (KIND == KIND_Q8S) {
    for (int h = 0; h < 2; ++h) s[h] = f32(0) * int8s_to_floats(rec + 64 + 16 * h), m[h] = v16f{};
  } else if constexpr (KIND == KIND_Q4S) {
    for (int h = 0; h < 2; ++h)
      s[h] = f32(0) * uint8s_to_floats(rec + 128 + 16 * h), m[h] = -(f32(64) * uint8s_to_floats(rec + 160 + 16 * h));
  } else if constexpr (KIND == KIND_Q4K) {
    s[0] = s[1] = f32(0) * uint8s_to_floats(rec + 128 + 16 * sb);
    m[0] = m[1] = -(f32(64) * uint8s_to_floats(rec + 256 + 16 * sb));
  } else if constexpr (KIND == KIND_Q6K) {
    // m: the code's offset, -32 s, for the kernels that add it (q6k_weights); exact
    for (int h = 0; h < 2; ++h) s[h] = f32(0) * int8s_to_floats(rec + 64 + 16 * (2 * sb + h)), m[h] = -32.f * s[h];
  } else {
    s[0] = s[1] = f32(0), m[0] = m[1] = v16f{};
  }
}

#ifdef __AVX512F__
// Q6K: the codes of inputs 2i, 2i + 1 of sub-block sb, (low | high << 4) - 32, as floats
static inline void q6k_pair(const uint8_t* rec, int sb, int i, v16f& w0, v16f& w1) {
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 320 + 256 * sb + i * 16)));
  const __m512i hi = _mm512_srli_epi32(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2368 + 128 * sb + (i / 2) * 16))),
      4 * (i % 2));
  const __m512i three = _mm512_set1_epi32(3), low4 = _mm512_set1_epi32(15), bias = _mm512_set1_epi32(32);
  const __m512i q0 = _mm512_or_si512(_mm512_and_si512(lo, low4), _mm512_slli_epi32(_mm512_and_si512(hi, three), 4));
  const __m512i q1 = _mm512_or_si512(_mm512_srli_epi32(lo, 4),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, 2), three), 4));
  w0 = (v16f)_mm512_cvtepi32_ps(_mm512_sub_epi32(q0, bias));
  w1 = (v16f)_mm512_cvtepi32_ps(_mm512_sub_epi32(q1, bias));
}
// Q6K's weights of inputs 2i, 2i + 1 directly, without building the integer code: w = (lo + 16 hi - 32) * s is
// taken as lo * s + (16 hi * s + m) with m = -32 s (record_header). Every term is exact in float32 (s = d * sc has
// at most 18 significant bits, the code at most 6), so each FMA's one rounding changes nothing: bitwise the product
// gguf computes. The parts come from lookups that read only an index's low 4 bits (vpermps): no masks, no
// conversions.
static inline void q6k_weights(const uint8_t* rec, int sb, int i, v16f s, v16f m, v16f& w0, v16f& w1) {
  const __m512 nibble = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 high = _mm512_setr_ps(0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48);
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 320 + 256 * sb + i * 16)));
  const __m512i hi = _mm512_srli_epi32(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2368 + 128 * sb + (i / 2) * 16))),
      4 * (i % 2));
  const __m512 t0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(hi, high), (__m512)s, (__m512)m);
  const __m512 t1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(hi, 2), high), (__m512)s, (__m512)m);
  w0 = (v16f)_mm512_fmadd_ps(_mm512_permutexvar_ps(lo, nibble), (__m512)s, t0);
  w1 = (v16f)_mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(lo, 4), nibble), (__m512)s, t1);
}
#else
static inline void q6k_pair(const uint8_t* rec, int sb, int i, v16f& w0, v16f& w1) {
  for (int j = 0; j < 16; ++j) {
    const int lo = rec[320 + 256 * sb + i * 16 + j], hi = rec[2368 + 128 * sb + (i / 2) * 16 + j] >> (4 * (i % 2));
    w0[j] = float(((lo & 15) | ((hi & 3) << 4)) - 32);
    w1[j] = float(((lo >> 4) | (((hi >> 2) & 3) << 4)) - 32);
  }
}
#endif

// The 32 x 16 float32 weights of one record, w0 = inputs k0 + 2i, w1 = k0 + 2i + 1 for the 16 outputs.
template <int KIND>
static inline void dequant_pair(const uint8_t* rec, int sb, int i, const v16f* s, const v16f* m, v16f& w0,
                                v16f& w1) {
  const int h = i / 8;
  const uint8_t* c = rec + kind_codes_offset(KIND) + (KIND == KIND_Q4K ? 256 * sb : 0);
#ifdef __AVX512F__
  if constexpr (KIND == KIND_Q6K) return q6k_weights(rec, sb, i, s[h], m[h], w0, w1);
#endif
  if constexpr (KIND == KIND_Q6K) {
    q6k_pair(rec, sb, i, w0, w1);
  } else if constexpr (kind_nibbles(KIND)) {
    nibbles_to_floats(c + i * 16, w0, w1);
  } else if constexpr (kind_unsigned(KIND)) {
    w0 = uint8s_to_floats(c + i * 32), w1 = uint8s_to_floats(c + i * 32 + 16);
  } else {
    w0 = int8s_to_floats(c + i * 32), w1 = int8s_to_floats(c + i * 32 + 16);
  }
  // kinds with one scale and minimum per block read them at a constant index: kept in registers
  constexpr bool per_half = KIND == KIND_Q8S || KIND == KIND_Q4S || KIND == KIND_Q6K;
  const int hh = per_half ? h : 0;
  if constexpr (KIND == KIND_Q8 || KIND == KIND_Q8S || KIND == KIND_Q6K) {
    w0 = w0 * s[hh], w1 = w1 * s[hh];
  } else {
    w0 = w0 * s[hh] + m[hh], w1 = w1 * s[hh] + m[hh];
  }
}

// f(p, k, w0, w1) for every input pair (k, k + 1) of P panels (panel p's records at rec + p * panel_bytes), in k
// order, with the 16 + 16 rebuilt weights of panel p; the P panels' rebuilds interleave pair by pair
template <int KIND, int P, class F>
static inline void for_each_pair(const uint8_t* rec, int64_t panel_bytes, int64_t K, F&& f) {
  constexpr int64_t REC = record_bytes(KIND), SPAN = kind_span(KIND), SUB = REC * 32 / SPAN;
  const uint8_t* start = rec;
  for (int64_t k0 = 0; k0 < K; k0 += SPAN, rec += REC) {
    for (int sb = 0; sb < SPAN / 32; ++sb) {
      // about PREFETCH_RECORDS 32-input blocks ahead, whatever the record's span; past a panel's end, into the
      // panel this stream takes next (P panels on: the panels are contiguous)
      int64_t ahead = (rec - start) + sb * SUB + PREFETCH_RECORDS * SUB;
      ahead += ahead >= panel_bytes ? (P - 1) * panel_bytes : 0;
      v16f s[P][2], m[P][2];
      for (int p = 0; p < P; ++p) {
        for (int64_t line = 0; line < SUB; line += 64) __builtin_prefetch(start + p * panel_bytes + ahead + line);
        record_header<KIND>(rec + p * panel_bytes, sb, s[p], m[p]);
      }
      for (int i = 0; i < 16; ++i)
        for (int p = 0; p < P; ++p) {
          v16f w0, w1;
          dequant_pair<KIND>(rec + p * panel_bytes, sb, i, s[p], m[p], w0, w1);
          f(p, k0 + 32 * sb + 2 * i, w0, w1);
        }
    }
  }
}

// y [R rows, P panels' outputs]. One row's even and odd sums are two chains of dependent FMAs, and at one or two
// rows the FMA latency along them, not the rebuild or the memory, bounds a panel: interleaving P panels keeps
// 2 P R independent chains in flight. Each output is still summed in the one order, whatever P and R are.
template <int R, int KIND, int P>
static inline void rows_x_qpanels(const float* __restrict x, const uint8_t* __restrict rec, int64_t panel_bytes,
                                  float* __restrict y, int64_t K, int64_t N) {
  v16f acc0[P][R], acc1[P][R];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) acc0[p][r] = acc1[p][r] = v16f{};
  for_each_pair<KIND, P>(rec, panel_bytes, K, [&](int p, int64_t k, v16f w0, v16f w1) {
    accumulate_pair<R>(acc0[p], acc1[p], w0, w1, x, K, k);
  });
  for (int p = 0; p < P; ++p) store_rows<R>(acc0[p], acc1[p], y + 16 * p, N);
}

// panels [begin, end) for up to ROW_CHUNK rows: one or two rows take PANELS_FEW_ROWS panels at a time
#ifndef PANELS_FEW_ROWS
#define PANELS_FEW_ROWS 2
#endif
template <int KIND>
static void rows_x_qpanels_any(int64_t rows, const float* x, const uint8_t* w, int64_t panel_bytes, float* y,
                               int64_t K, int64_t N, int64_t begin, int64_t end) {
  int64_t p = begin;
  if (rows <= 2)
    for (; p + PANELS_FEW_ROWS <= end; p += PANELS_FEW_ROWS) {
      if (rows == 1)
        rows_x_qpanels<1, KIND, PANELS_FEW_ROWS>(x, w + p * panel_bytes, panel_bytes, y + p * 16, K, N);
      else
        rows_x_qpanels<2, KIND, PANELS_FEW_ROWS>(x, w + p * panel_bytes, panel_bytes, y + p * 16, K, N);
    }
  for (; p < end; ++p)
    with_rows(rows, [&](auto R) { rows_x_qpanels<R.value, KIND, 1>(x, w + p * panel_bytes, panel_bytes, y + p * 16, K, N); });
}
#endif

// AVX2: Q6_K weights for this many rows or more are made into a float32 panel once (K x 64 bytes, in L2) for all
// chunks of 4 rows (a 6-bit code costs twice a Q4 code to rebuild); FloatPanel sums as BlockPanel does, so the same
// bits. Q6_K calls (Zen 3): 12 / 16 / 64 rows 1.08-1.15x / 1.21-1.25x / 1.42-1.47x, 5-8 rows 0.95-1.04x; Q4_1 and
// Q4_K from a panel ran 0.82-0.94x at 32-64 rows, so they are rebuilt per chunk
#ifndef FLOAT_PANEL_ROWS
#define FLOAT_PANEL_ROWS 12
#endif
template <int KIND>
static torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed) {
  constexpr int64_t REC = record_bytes(KIND);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "quant_linear: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == REC && packed.scalar_type() == torch::kByte &&
                  packed.is_contiguous(),
              "quant_linear: packed weight must be a contiguous [N/16, K/32, record] uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * kind_span(KIND) == K, "quant_linear: K mismatch");
  TORCH_CHECK(M >= 1 && M <= 64, "quant_linear: 1..64 rows");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t panel_bytes = packed.size(1) * REC;
  auto panels = [&](int64_t begin, int64_t end) {
#ifdef HALF_PANELS
    if (KIND != KIND_Q6K || M < FLOAT_PANEL_ROWS) {
      for (int64_t p = begin; p < end; ++p)
        panel_rows(M, BlockPanel<KIND>{wp + p * panel_bytes}, xp, yp + p * 16, K, N);
      return;
    }
    std::vector<float> panel(K * 16);
    for (int64_t p = begin; p < end; ++p) {
      const BlockPanel<KIND> bp{wp + p * panel_bytes};
      for (int64_t k0 = 0; k0 < K; k0 += 32)
        bp.both(k0, [&](int64_t k, __m256 a0, __m256 a1, __m256 b0, __m256 b1) {
          float* row = panel.data() + k * 16;  // inputs k and k + 1, outputs 0-7 then 8-15
          _mm256_storeu_ps(row, a0), _mm256_storeu_ps(row + 8, b0);
          _mm256_storeu_ps(row + 16, a1), _mm256_storeu_ps(row + 24, b1);
        });
      panel_rows(M, FloatPanel{panel.data(), K}, xp, yp + p * 16, K, N);
    }
#else
    if (M <= ROW_CHUNK)  // rebuild each weight in registers, use it for every row
      return rows_x_qpanels_any<KIND>(M, xp, wp, panel_bytes, yp, K, N, begin, end);
    // two chunks of rows: rebuild each panel's weights in registers once per chunk (the second pass finds the
    // records in L1/L2). The float32 panel below (K x 64 B) outgrows L1 at K >= 512, and its two passes over it
    // from L2 cost more than a second rebuild: a 12-16 row step 1.08-1.15x faster (bundled model and the 1.1B
    // file, A/B in one process); from 24 rows the two ways measure the same, and at 64 the panel wins
    if (M <= 2 * ROW_CHUNK) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK)
          rows_x_qpanels_any<KIND>(std::min<int64_t>(ROW_CHUNK, M - r0), xp + r0 * K, wp, panel_bytes,
                                   yp + r0 * N, K, N, p, p + 1);
      return;
    }
    // more rows: rebuild the panel once into float32 (K x 64 B, in L2) and run the float32 kernel over it, so
    // the rebuild is not repeated per chunk of 8 rows; the sums are the float32 kernel's own, so still identical
    std::vector<float> panel(K * 16);
    for (int64_t p = begin; p < end; ++p) {
      for_each_pair<KIND, 1>(wp + p * panel_bytes, panel_bytes, K, [&](int, int64_t k, v16f w0, v16f w1) {
        __builtin_memcpy(panel.data() + k * 16, &w0, 64);
        __builtin_memcpy(panel.data() + (k + 1) * 16, &w1, 64);
      });
      for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK)
        rows_x_panel_any(std::min<int64_t>(ROW_CHUNK, M - r0), xp + r0 * K, panel.data(), yp + r0 * N + p * 16, K,
                         N);
    }
#endif
  };
  over_panels(N / 16, 8, 4, panels);
  return y;
}


// A weight fused from parts of different record kinds (Q4_K_M's QKV where V is Q6_K and Q, K are Q4_K) keeps
// each part's own records: segments one after another in one 1-D byte tensor (uint8 for float-activation records,
// int8 for int8-activation ones), after a header of int64 fields: SEGMENTS_MAGIC, the segment count, then per
// segment its dimension count, 4 sizes and its byte offset (layers/small_gemm.py join_segments writes it). Each
// segment's outputs are computed by its own kernel, as they would be alone, and placed side by side.
constexpr int64_t SEGMENTS_MAGIC = 0x53544e454d474553;  // "SEGMENTS"

static torch::Tensor segments_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(packed.is_contiguous() && packed.numel() >= 16, "packed_linear: not a segmented weight");
  const auto* base = static_cast<const uint8_t*>(packed.data_ptr());
  const auto* h = reinterpret_cast<const int64_t*>(base);
  TORCH_CHECK(h[0] == SEGMENTS_MAGIC && h[1] >= 1 && 8 * (2 + 6 * h[1]) <= packed.numel(),
              "packed_linear: not a segmented weight");
  std::vector<torch::Tensor> ys;
  for (int64_t i = 0; i < h[1]; ++i) {
    const int64_t* f = h + 2 + 6 * i;
    TORCH_CHECK(f[0] >= 1 && f[0] <= 4, "packed_linear: bad segment header");
    const std::vector<int64_t> sizes(f + 1, f + 1 + f[0]);
    int64_t bytes = 1;
    for (int64_t d : sizes) bytes *= d;
    TORCH_CHECK(f[5] >= 0 && f[5] + bytes <= packed.numel(), "packed_linear: segment ", i, " out of bounds");
    ys.push_back(packed_linear(x, torch::from_blob(const_cast<uint8_t*>(base + f[5]), sizes,
                                                   packed.options().dtype(torch::kByte))));
  }
  return ys.size() == 1 ? ys[0] : torch::cat(ys, 1);
}

// y = x @ W^T through whichever packed format W has (float32 panels, int8-activation records, the records of
// block_formats.h, told apart by their size, or segments of these)
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed) {
  if (packed.scalar_type() == torch::kFloat) return small_linear(x, packed);
  if (packed.dim() == 1) return segments_linear(x, packed);
  if (packed.dim() == 4) return a8_linear(x, packed);
  switch (kind_of_record(packed.size(2))) {
    case KIND_Q4: return quant_linear<KIND_Q4>(x, packed);
    case KIND_Q8: return quant_linear<KIND_Q8>(x, packed);
    case KIND_Q8M: return quant_linear<KIND_Q8M>(x, packed);
    case KIND_Q8S: return quant_linear<KIND_Q8S>(x, packed);
    case KIND_Q4S: return quant_linear<KIND_Q4S>(x, packed);
    case KIND_Q4K: return quant_linear<KIND_Q4K>(x, packed);
    case KIND_Q6K: return quant_linear<KIND_Q6K>(x, packed);
    case KIND_Q4H: return quant_linear<KIND_Q4H>(x, packed);
  }
  TORCH_CHECK(false, "packed_linear: unknown packed format of record size ", packed.size(2));
}
