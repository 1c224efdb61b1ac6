// y[M, N] = x[M, K] @ W^T for few rows (decode steps, draft/tree verification, small batches): M <= 64.
//
// W is pre-packed into panels of 16 output features, [N/16][K][16]: one panel is one contiguous stream and each
// 64-byte row of it (16 outputs at one k) is one cache line. For each panel the kernel walks the rows of x in
// chunks of up to 8 (AVX-512) or 4 (AVX2, one 8-output half of the panel at a time), keeping a chunk's partial
// sums in vector registers (two sets, for even and odd k, to halve the FMA dependency chains). The panel (36 KB
// at K = 576) comes from memory once and stays in L1/L2 for the later chunks, so the call stays bound by weight bandwidth well past M = 8, where a general small-M GEMM
// costs 2-2.5x a vector-matrix product on the CPUs we measured.
//
// Every output element is summed in the same order (even and odd k separately, then added) whatever M and the
// row's chunk are, so a token's result does not depend on how many rows share the call: plain decoding and the
// verification of drafts see bit-identical projections.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "block_formats.h"

typedef float v16f __attribute__((vector_size(64)));
constexpr int64_t PREFETCH = 32;  // k-rows (cache lines) ahead in the panel stream
// block records (384-576 bytes each) prefetched ahead in the Q4/Q8 record streams: 8 rather than 2 made a decode
// step 8% (int8 activations) to 17% (float activations) faster here, interleaved A/B in one process; with the
// weights resident in the shared L3 it hardly matters, when other tenants push them to DRAM it does
#ifndef PREFETCH_RECORDS
#define PREFETCH_RECORDS 8
#endif
// rows per chunk: 8 x 16 partial sums (x2 for even / odd k) fill half of AVX-512's 32 registers; AVX2 has 16
// registers of half the width, so its kernels (below) take 4 rows over one 8-output half of a panel at a time
#if defined(__AVX2__) && !defined(__AVX512F__)
#define HALF_PANELS 1
constexpr int ROW_CHUNK = 4;
#else
constexpr int ROW_CHUNK = 8;
#endif

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

// f(std::integral_constant<int, R>{}) for R = rows (1 .. ROW_CHUNK - 1), or ROW_CHUNK for more: the kernels' row
// count is a template parameter so that a chunk's partial sums live in registers
template <int R = 1, class F>
static inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R < ROW_CHUNK) {
    if (rows <= R) return f(std::integral_constant<int, R>{});
    return with_rows<R + 1>(rows, f);
  } else {
    f(std::integral_constant<int, R>{});
  }
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
// 8h .. 8h+7: read from a float32 panel, or rebuilt from Q4/Q8 records exactly as dequant_pair does
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
};

template <int KIND>
struct BlockPanel {
  const uint8_t* records;
  template <class F>
  void operator()(int64_t k0, int ho, F&& f) const {
    constexpr int64_t REC = record_bytes(KIND), SPAN = kind_span(KIND), SUB = REC * 32 / SPAN;
    const uint8_t* rec = records + (k0 / SPAN) * REC;
    const int sb = int((k0 % SPAN) / 32);
    if (ho == 0)  // about PREFETCH_RECORDS 32-input blocks ahead, whatever the record's span
      for (int64_t line = 0; line < SUB; line += 64) __builtin_prefetch(rec + sb * SUB + PREFETCH_RECORDS * SUB + line);
    auto f32 = [&](int64_t off) { return _mm256_loadu_ps(reinterpret_cast<const float*>(rec + off) + 8 * ho); };
    auto bytes = [&](const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * ho)); };
    auto i8f = [&](const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(p))); };
    auto u8f = [&](const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes(p))); };
    __m256 s[2], m[2];  // per block half (inputs 0-15, 16-31): scale and minimum of outputs 8 ho .. 8 ho + 7
    if constexpr (KIND == KIND_Q4 || KIND == KIND_Q8M) {
      s[0] = s[1] = f32(0), m[0] = m[1] = f32(64);
    } else if constexpr (KIND == KIND_Q8S) {
      for (int h = 0; h < 2; ++h) s[h] = _mm256_mul_ps(f32(0), i8f(rec + 64 + 16 * h)), m[h] = _mm256_setzero_ps();
    } else if constexpr (KIND == KIND_Q4S) {
      for (int h = 0; h < 2; ++h) {
        s[h] = _mm256_mul_ps(f32(0), u8f(rec + 128 + 16 * h));
        m[h] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(f32(64), u8f(rec + 160 + 16 * h)));
      }
    } else if constexpr (KIND == KIND_Q8G) {
      for (int h = 0; h < 2; ++h) s[h] = f32(64 * h), m[h] = f32(128 + 64 * h);
    } else if constexpr (KIND == KIND_Q4K) {
      s[0] = s[1] = _mm256_mul_ps(f32(0), u8f(rec + 128 + 16 * sb));
      m[0] = m[1] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(f32(64), u8f(rec + 256 + 16 * sb)));
    } else if constexpr (KIND == KIND_Q6K) {
      for (int h = 0; h < 2; ++h)
        s[h] = _mm256_mul_ps(f32(0), i8f(rec + 64 + 16 * (2 * sb + h))), m[h] = _mm256_setzero_ps();
    } else {
      s[0] = s[1] = f32(0), m[0] = m[1] = _mm256_setzero_ps();
    }
    const uint8_t* c = rec + kind_codes_offset(KIND) + (KIND == KIND_Q4K ? 256 * sb : 0);
    for (int i = 0; i < 16; ++i) {
      const int h = i / 8;
      __m256 w0, w1;
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
      f(k0 + 2 * i, w0, w1);
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
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "small_linear: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == torch::kFloat32 &&
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
  at::parallel_for(0, N / 16, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* w = wp + p * K * 16;
#ifdef HALF_PANELS
      panel_rows(M, FloatPanel{w, K}, xp, yp + p * 16, K, N);
#else
      for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK)
        rows_x_panel_any(std::min<int64_t>(ROW_CHUNK, M - r0), xp + r0 * K, w, yp + r0 * N + p * 16, K, N);
#endif
    }
  });
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
  } else if constexpr (KIND == KIND_Q8S) {
    for (int h = 0; h < 2; ++h) s[h] = f32(0) * int8s_to_floats(rec + 64 + 16 * h), m[h] = v16f{};
  } else if constexpr (KIND == KIND_Q4S) {
    for (int h = 0; h < 2; ++h)
      s[h] = f32(0) * uint8s_to_floats(rec + 128 + 16 * h), m[h] = -(f32(64) * uint8s_to_floats(rec + 160 + 16 * h));
  } else if constexpr (KIND == KIND_Q8G) {
    for (int h = 0; h < 2; ++h) s[h] = f32(64 * h), m[h] = f32(128 + 64 * h);
  } else if constexpr (KIND == KIND_Q4K) {
    s[0] = s[1] = f32(0) * uint8s_to_floats(rec + 128 + 16 * sb);
    m[0] = m[1] = -(f32(64) * uint8s_to_floats(rec + 256 + 16 * sb));
  } else if constexpr (KIND == KIND_Q6K) {
    for (int h = 0; h < 2; ++h) s[h] = f32(0) * int8s_to_floats(rec + 64 + 16 * (2 * sb + h)), m[h] = v16f{};
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
  if constexpr (KIND == KIND_Q6K) {
    q6k_pair(rec, sb, i, w0, w1);
  } else if constexpr (kind_nibbles(KIND)) {
    nibbles_to_floats(c + i * 16, w0, w1);
  } else if constexpr (kind_unsigned(KIND)) {
    w0 = uint8s_to_floats(c + i * 32), w1 = uint8s_to_floats(c + i * 32 + 16);
  } else {
    w0 = int8s_to_floats(c + i * 32), w1 = int8s_to_floats(c + i * 32 + 16);
  }
  if constexpr (KIND == KIND_Q8 || KIND == KIND_Q8S || KIND == KIND_Q6K) {
    w0 = w0 * s[h], w1 = w1 * s[h];
  } else {
    w0 = w0 * s[h] + m[h], w1 = w1 * s[h] + m[h];
  }
}

// f(k, w0, w1) for every input pair (k, k + 1) of one panel, in k order, with its 16 + 16 rebuilt weights
template <int KIND, class F>
static inline void for_each_pair(const uint8_t* rec, int64_t K, F&& f) {
  constexpr int64_t REC = record_bytes(KIND), SPAN = kind_span(KIND), SUB = REC * 32 / SPAN;
  for (int64_t k0 = 0; k0 < K; k0 += SPAN, rec += REC) {
    for (int sb = 0; sb < SPAN / 32; ++sb) {
      // about PREFETCH_RECORDS 32-input blocks ahead, whatever the record's span
      for (int64_t line = 0; line < SUB; line += 64) __builtin_prefetch(rec + sb * SUB + PREFETCH_RECORDS * SUB + line);
      v16f s[2], m[2];
      record_header<KIND>(rec, sb, s, m);
      for (int i = 0; i < 16; ++i) {
        v16f w0, w1;
        dequant_pair<KIND>(rec, sb, i, s, m, w0, w1);
        f(k0 + 32 * sb + 2 * i, w0, w1);
      }
    }
  }
}

template <int R, int KIND>
static inline void rows_x_qpanel(const float* __restrict x, const uint8_t* __restrict rec, float* __restrict y,
                                 int64_t K, int64_t N) {
  v16f acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = v16f{};
  for_each_pair<KIND>(rec, K, [&](int64_t k, v16f w0, v16f w1) { accumulate_pair<R>(acc0, acc1, w0, w1, x, K, k); });
  store_rows<R>(acc0, acc1, y, N);
}

template <int KIND>
static void rows_x_qpanel_any(int64_t rows, const float* x, const uint8_t* rec, float* y, int64_t K, int64_t N) {
  with_rows(rows, [&](auto R) { rows_x_qpanel<R.value, KIND>(x, rec, y, K, N); });
}
#endif

template <int KIND>
static torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed) {
  constexpr int64_t REC = record_bytes(KIND);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "quant_linear: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == REC && packed.scalar_type() == torch::kUInt8 &&
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
  at::parallel_for(0, N / 16, 8, [&](int64_t begin, int64_t end) {
#ifdef HALF_PANELS
    for (int64_t p = begin; p < end; ++p)
      panel_rows(M, BlockPanel<KIND>{wp + p * panel_bytes}, xp, yp + p * 16, K, N);
#else
    if (M <= ROW_CHUNK) {  // rebuild each weight in registers, use it for every row
      for (int64_t p = begin; p < end; ++p)
        rows_x_qpanel_any<KIND>(M, xp, wp + p * panel_bytes, yp + p * 16, K, N);
      return;
    }
    // more rows: rebuild the panel once into float32 (K x 64 B, in L2) and run the float32 kernel over it, so
    // the rebuild is not repeated per chunk of 8 rows; the sums are the float32 kernel's own, so still identical
    std::vector<float> panel(K * 16);
    for (int64_t p = begin; p < end; ++p) {
      for_each_pair<KIND>(wp + p * panel_bytes, K, [&](int64_t k, v16f w0, v16f w1) {
        __builtin_memcpy(panel.data() + k * 16, &w0, 64);
        __builtin_memcpy(panel.data() + (k + 1) * 16, &w1, 64);
      });
      for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK)
        rows_x_panel_any(std::min<int64_t>(ROW_CHUNK, M - r0), xp + r0 * K, panel.data(), yp + r0 * N + p * 16, K,
                         N);
    }
#endif
  });
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// int8 activations (opt-in, lossy): llama.cpp's arithmetic for Q4_1 / Q8_0 weights. Each row of x is quantised
// per block of 32 inputs to int8 with one float scale (dx = max|x| / 127, q = round(x / dx)), and each block's
// product is an exact integer sum of weight codes times activation codes, done by AVX-512 VNNI (vpdpbusd: 64
// u8 x s8 products per instruction instead of 16 float FMAs), then scaled:
//   y += (d_w * dx) * sum(qw * qx) + m_w * (dx * sum(qx))        (Q4: w = d_w * qw + m_w, qw in 0..15)
//   y += (d_w * dx) * (sum((qw + 128) * qx) - 128 * sum(qx))      (Q8: w = d_w * qw, stored offset to u8)
// A row's quantisation and sums do not depend on the other rows, so results stay batch-invariant: speculation
// at this precision is lossless against plain decoding at this precision. Prompts go through it too (any M).
//
// Packed layout [N/16, K/32, lines, 64] (the 4-D shape is how packed_linear tells it from the float-activation
// records), per panel of 16 outputs and block of 32 inputs; in each 64-byte line, output j owns bytes 4j..4j+3:
//   Q4 (6 lines): d[16] f32 | m[16] f32 | line g = 0..3: byte (j, t) = qw(j, k0+8g+t) | qw(j, k0+8g+4+t) << 4
//   Q8 (9 lines): d[16] f32 | line g = 0..7: byte (j, t) = qw(j, k0+4g+t) + 128
// and, for Q4_K's super-blocks of 256 inputs, one record [N/16, K/256, 38, 64] holding what the float record
// holds (block_formats.h's Q4K: d, dmin, sc[8], mq[8]) followed by the 8 sub-blocks' code lines in the Q4 form:
//   Q4K (38 lines): d[16] f32 | dmin[16] f32 | sc[8][16] u8 | mq[8][16] u8 | 8 x 4 lines as Q4
// whose block scale d * sc and minimum -(dmin * mq) are computed as gguf computes them, so a Q4_K layer gives
// bitwise the result of its Q4 records.
constexpr int64_t A8_Q4_LINES = 6, A8_Q8_LINES = 9, A8_Q4K_LINES = 38;
enum A8Kind : int { A8_Q4 = 0, A8_Q8 = 1, A8_Q4K = 2 };

// Block b (32 inputs) of one panel's int8-activation records: where its code lines start, and the record (and
// sub-block) whose scales it takes
template <int A>
struct A8Block {
  static constexpr bool Q4 = A != A8_Q8;
  const uint8_t* rec;
  int sb;
  A8Block(const uint8_t* base, int64_t b)
      : rec(base + (A == A8_Q4K ? (b / 8) * A8_Q4K_LINES : b * (Q4 ? A8_Q4_LINES : A8_Q8_LINES)) * 64),
        sb(A == A8_Q4K ? int(b % 8) : 0) {}
  const uint8_t* codes() const { return rec + (A == A8_Q4K ? 384 + 256 * sb : Q4 ? 128 : 64); }
  int64_t code_bytes() const { return Q4 ? 256 : 512; }
  // row j's scale and minimum (scalar form; the vector kernels compute the same products lane by lane)
  float scale(int j) const {
    float d;
    __builtin_memcpy(&d, rec + 4 * j, 4);
    return A == A8_Q4K ? d * float(rec[128 + 16 * sb + j]) : d;
  }
  float minimum(int j) const {
    float m;
    __builtin_memcpy(&m, rec + 64 + 4 * j, 4);
    return A == A8_Q4K ? -(m * float(rec[256 + 16 * sb + j])) : m;
  }
};

struct QuantizedRows {  // x [M, K] as int8 codes with per-32 scales
  std::vector<int8_t> q;
  std::vector<float> d, s;      // dx and dx * sum(qx) per (row, block)
  std::vector<int32_t> sum;     // sum(qx) per (row, block)
};

static QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb),
                  std::vector<int32_t>(M * nb)};
  for (int64_t b = 0; b < M * nb; ++b) {
    const float* v = x + b * 32;
#if defined(__AVX512F__)
    // the scalar loop below, vectorised: cvtps rounds to nearest even as nearbyint does, and |v * id| <= 127
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + b * 32), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t acc = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    r.d[b] = d, r.sum[b] = acc, r.s[b] = d * static_cast<float>(acc);
#else
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int32_t acc = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t qi = std::max(-127, std::min(127, static_cast<int32_t>(std::nearbyint(v[i] * id))));
      r.q[b * 32 + i] = static_cast<int8_t>(qi);
      acc += qi;
    }
    r.d[b] = d, r.sum[b] = acc, r.s[b] = d * static_cast<float>(acc);
#endif
  }
  return r;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// the 16 rows' scale and minimum of one block, as A8Block's scalar forms compute them
template <int A>
static inline __m512 a8_scale(const A8Block<A>& blk) {
  const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk.rec));
  if constexpr (A != A8_Q4K) return d;
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 128 + 16 * blk.sb)))));
}
template <int A>
static inline __m512 a8_minimum(const A8Block<A>& blk) {
  const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(blk.rec + 64));
  if constexpr (A != A8_Q4K) return m;
  const __m512 mq = _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 256 + 16 * blk.sb))));
  return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(m, mq));
}

template <int R, int A>
static inline void rows_x_a8panel(const QuantizedRows& xr, int64_t r0, const uint8_t* __restrict base,
                                  float* __restrict y, int64_t K, int64_t N) {
  constexpr bool Q4 = A != A8_Q8;
  const int64_t nb = K / 32;
  const int8_t* xq = xr.q.data() + r0 * K;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const A8Block<A> blk(base, b), ahead(base, b + PREFETCH_RECORDS);
    for (int64_t line = 0; line < ahead.code_bytes(); line += 64) __builtin_prefetch(ahead.codes() + line);
    __builtin_prefetch(ahead.rec), __builtin_prefetch(ahead.rec + 64);
    const uint8_t* codes = blk.codes();
    __m512i i0[R], i1[R];  // two integer chains per row (even / odd quarter-lines) against vpdpbusd latency
    for (int r = 0; r < R; ++r) i0[r] = i1[r] = _mm512_setzero_si512();
    const int8_t* xb = xq + b * 32;
    auto xword = [&](int r, int64_t k) {
      int32_t v;
      __builtin_memcpy(&v, xb + r * K + k, 4);
      return _mm512_set1_epi32(v);
    };
    if (Q4) {
      for (int g = 0; g < 4; ++g) {
        const __m512i L = _mm512_loadu_si512(codes + 64 * g);
        const __m512i lo = _mm512_and_si512(L, low4), hi = _mm512_and_si512(_mm512_srli_epi16(L, 4), low4);
        for (int r = 0; r < R; ++r) {
          i0[r] = _mm512_dpbusd_epi32(i0[r], lo, xword(r, 8 * g));
          i1[r] = _mm512_dpbusd_epi32(i1[r], hi, xword(r, 8 * g + 4));
        }
      }
    } else {
      for (int g = 0; g < 8; g += 2) {
        const __m512i L0 = _mm512_loadu_si512(codes + 64 * g), L1 = _mm512_loadu_si512(codes + 64 + 64 * g);
        for (int r = 0; r < R; ++r) {
          i0[r] = _mm512_dpbusd_epi32(i0[r], L0, xword(r, 4 * g));
          i1[r] = _mm512_dpbusd_epi32(i1[r], L1, xword(r, 4 * g + 4));
        }
      }
    }
    const __m512 d = a8_scale(blk), m = Q4 ? a8_minimum(blk) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      __m512i isum = _mm512_add_epi32(i0[r], i1[r]);
      if (!Q4) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * xr.sum[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(xr.d[i])), acc[r]);
      if (Q4) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xr.s[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}
constexpr const char* A8_ISA = "avx512-vnni";
#elif defined(__AVX2__)
// AVX2 (no VNNI: AMD Zen 1-3, most client x86): vpmaddubsw + vpmaddwd make the same 4-product integer sums per
// 32-bit lane as vpdpbusd, over 8 outputs per 256-bit half of a line. vpmaddubsw saturates pairs at int16, which
// Q4 codes (<= 15 x 127 x 2) never reach but Q8's offset codes (<= 255 x 127 x 2) would: Q8 multiplies |q| by
// x carrying q's sign instead (<= 128 x 127 x 2), the same integer sum(q * x) the offset form makes. The float
// steps are the VNNI loop's, lane for lane, so results are bit-identical to it.
// 8 rows' (half h of a block's 16) scale and minimum, as A8Block's scalar forms compute them
template <int A>
static inline __m256 a8_scale8(const A8Block<A>& blk, int h) {
  const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(blk.rec) + 8 * h);
  if constexpr (A != A8_Q4K) return d;
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.rec + 128 + 16 * blk.sb + 8 * h)))));
}
template <int A>
static inline __m256 a8_minimum8(const A8Block<A>& blk, int h) {
  const __m256 m = _mm256_loadu_ps(reinterpret_cast<const float*>(blk.rec + 64) + 8 * h);
  if constexpr (A != A8_Q4K) return m;
  const __m256 mq = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.rec + 256 + 16 * blk.sb + 8 * h))));
  return _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(m, mq));
}

template <int R, int A>
static inline void rows_x_a8panel(const QuantizedRows& xr, int64_t r0, const uint8_t* __restrict base,
                                  float* __restrict y, int64_t K, int64_t N) {
  constexpr bool Q4 = A != A8_Q8;
  const int64_t nb = K / 32;
  const int8_t* xq = xr.q.data() + r0 * K;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8(-128);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  // one block's weights unpacked once for all rows: group v (inputs 4v .. 4v+3) of each output, per half line,
  // as unsigned multipliers (and, for Q8, the signed codes whose signs go onto x)
  alignas(32) uint8_t wu[8][2][32];
  alignas(32) int8_t ws[8][2][32];
  for (int64_t b = 0; b < nb; ++b) {
    const A8Block<A> blk(base, b), ahead(base, b + PREFETCH_RECORDS);
    for (int64_t line = 0; line < ahead.code_bytes(); line += 64) __builtin_prefetch(ahead.codes() + line);
    __builtin_prefetch(ahead.rec), __builtin_prefetch(ahead.rec + 64);
    const uint8_t* codes = blk.codes();
    for (int h = 0; h < 2; ++h) {
      if (Q4) {
        for (int g = 0; g < 4; ++g) {  // line g: low nibbles are inputs 8g .. 8g+3, high nibbles 8g+4 .. 8g+7
          const __m256i L = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * g + 32 * h));
          _mm256_store_si256(reinterpret_cast<__m256i*>(wu[2 * g][h]), _mm256_and_si256(L, low4));
          _mm256_store_si256(reinterpret_cast<__m256i*>(wu[2 * g + 1][h]),
                             _mm256_and_si256(_mm256_srli_epi16(L, 4), low4));
        }
      } else {
        for (int g = 0; g < 8; ++g) {  // line g: inputs 4g .. 4g+3, stored as q + 128
          const __m256i q = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * g + 32 * h)), bias);
          _mm256_store_si256(reinterpret_cast<__m256i*>(ws[g][h]), q);
          _mm256_store_si256(reinterpret_cast<__m256i*>(wu[g][h]), _mm256_abs_epi8(q));
        }
      }
    }
    const __m256 d0 = a8_scale8(blk, 0), d1 = a8_scale8(blk, 1);
    const __m256 m0 = Q4 ? a8_minimum8(blk, 0) : _mm256_setzero_ps();
    const __m256 m1 = Q4 ? a8_minimum8(blk, 1) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + b * 32;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int v = 0; v < 8; ++v) {
        int32_t word;
        __builtin_memcpy(&word, xb + 4 * v, 4);
        const __m256i xv = _mm256_set1_epi32(word);
        const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wu[v][0]));
        const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wu[v][1]));
        const __m256i x0 = Q4 ? xv : _mm256_sign_epi8(xv, _mm256_load_si256(reinterpret_cast<const __m256i*>(ws[v][0])));
        const __m256i x1 = Q4 ? xv : _mm256_sign_epi8(xv, _mm256_load_si256(reinterpret_cast<const __m256i*>(ws[v][1])));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones));
      }
      const int64_t i = (r0 + r) * nb + b;
      const __m256 xd = _mm256_set1_ps(xr.d[i]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, xd), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, xd), acc[r][1]);
      if (Q4) {
        const __m256 xs = _mm256_set1_ps(xr.s[i]);
        acc[r][0] = _mm256_fmadd_ps(m0, xs, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(m1, xs, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * N, acc[r][0]);
    _mm256_storeu_ps(y + r * N + 8, acc[r][1]);
  }
}
constexpr const char* A8_ISA = "avx2";
#else  // portable reference: the same integer sums and float steps, one lane at a time (slow, but exact)
template <int R, int A>
static inline void rows_x_a8panel(const QuantizedRows& xr, int64_t r0, const uint8_t* __restrict base,
                                  float* __restrict y, int64_t K, int64_t N) {
  constexpr bool Q4 = A != A8_Q8;
  const int64_t nb = K / 32;
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = xr.q.data() + (r0 + r) * K;
    float acc[16] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const A8Block<A> blk(base, b);
      const uint8_t* codes = blk.codes();
      const int64_t i = (r0 + r) * nb + b;
      for (int j = 0; j < 16; ++j) {
        int32_t isum = 0;
        for (int t = 0; t < 32; ++t) {
          int32_t w;
          if (Q4) {
            const uint8_t byte = codes[64 * (t / 8) + 4 * j + t % 4];
            w = (t % 8) < 4 ? (byte & 15) : (byte >> 4);
          } else {
            w = codes[64 * (t / 4) + 4 * j + t % 4];
          }
          isum += w * xq[b * 32 + t];
        }
        if (!Q4) isum -= 128 * xr.sum[i];
        acc[j] = std::fma(static_cast<float>(isum), blk.scale(j) * xr.d[i], acc[j]);
        if (Q4) acc[j] = std::fma(blk.minimum(j), xr.s[i], acc[j]);
      }
    }
    __builtin_memcpy(y + r * N, acc, 64);
  }
}
constexpr const char* A8_ISA = "portable";
#endif

template <int A>
static void rows_x_a8panel_any(int64_t rows, const QuantizedRows& xr, int64_t r0, const uint8_t* rec, float* y,
                               int64_t K, int64_t N) {
  with_rows(rows, [&](auto R) { rows_x_a8panel<R.value, A>(xr, r0, rec, y, K, N); });
}

torch::Tensor a8_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "a8_linear: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.size(3) == 64 && packed.scalar_type() == torch::kUInt8 &&
                  packed.is_contiguous() && (packed.size(2) == A8_Q4_LINES || packed.size(2) == A8_Q8_LINES ||
                                             packed.size(2) == A8_Q4K_LINES),
              "a8_linear: packed weight must be a contiguous [N/16, K/32, 6 or 9, 64] or [N/16, K/256, 38, 64] "
              "uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  const int kind = packed.size(2) == A8_Q4_LINES ? A8_Q4 : packed.size(2) == A8_Q8_LINES ? A8_Q8 : A8_Q4K;
  TORCH_CHECK(packed.size(1) * (kind == A8_Q4K ? 256 : 32) == K, "a8_linear: K mismatch");
  // any number of rows: at this precision a prompt's rows must be computed exactly as a decoded token's would
  // be, or a prefix-cache hit (which prefills fewer rows) would change the result; each panel stays in L1/L2
  // while its chunks of 8 rows pass over it
  TORCH_CHECK(M >= 1, "a8_linear: at least one row");
  const QuantizedRows xr = quantize_rows(x.data_ptr<float>(), M, K);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t panel_bytes = packed.size(1) * packed.size(2) * 64;
  at::parallel_for(0, N / 16, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int64_t rows = std::min<int64_t>(ROW_CHUNK, M - r0);
        const uint8_t* panel = wp + p * panel_bytes;
        if (kind == A8_Q4) rows_x_a8panel_any<A8_Q4>(rows, xr, r0, panel, yp + r0 * N + p * 16, K, N);
        else if (kind == A8_Q8) rows_x_a8panel_any<A8_Q8>(rows, xr, r0, panel, yp + r0 * N + p * 16, K, N);
        else rows_x_a8panel_any<A8_Q4K>(rows, xr, r0, panel, yp + r0 * N + p * 16, K, N);
      }
  });
  return y;
}

std::string a8_isa() { return A8_ISA; }

// y = x @ W^T through whichever packed format W has (float32 panels, int8-activation records, or the records of
// block_formats.h, told apart by their size)
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed) {
  if (packed.scalar_type() == torch::kFloat32) return small_linear(x, packed);
  if (packed.dim() == 4) return a8_linear(x, packed);
  switch (kind_of_record(packed.size(2))) {
    case KIND_Q4: return quant_linear<KIND_Q4>(x, packed);
    case KIND_Q8: return quant_linear<KIND_Q8>(x, packed);
    case KIND_Q8M: return quant_linear<KIND_Q8M>(x, packed);
    case KIND_Q8S: return quant_linear<KIND_Q8S>(x, packed);
    case KIND_Q4S: return quant_linear<KIND_Q4S>(x, packed);
    case KIND_Q8G: return quant_linear<KIND_Q8G>(x, packed);
    case KIND_Q4K: return quant_linear<KIND_Q4K>(x, packed);
    case KIND_Q6K: return quant_linear<KIND_Q6K>(x, packed);
  }
  TORCH_CHECK(false, "packed_linear: unknown packed format of record size ", packed.size(2));
}

// kernels/gguf_blocks.cpp and kernels/decode_ops.cpp, built into the same extension
void repack_gguf(torch::Tensor raw, int64_t type, torch::Tensor rows, torch::Tensor out);
torch::Tensor unpack_records(torch::Tensor records, torch::Tensor rows);
int64_t natural_kind(int64_t type);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
void attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor rows,
                    torch::Tensor spans, torch::Tensor slots, double scale, torch::Tensor out);
void attention_rows_i8(torch::Tensor q, torch::Tensor k_data, torch::Tensor k_scale, torch::Tensor v_data,
                       torch::Tensor v_scale, torch::Tensor rows, torch::Tensor spans, torch::Tensor slots,
                       double scale, torch::Tensor out);
void quantize_kv_rows(torch::Tensor x, torch::Tensor shift, torch::Tensor smooth, torch::Tensor rotation,
                      torch::Tensor slots, torch::Tensor data, torch::Tensor scale);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed, int64_t num_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor decoder_layer(torch::Tensor x, std::vector<torch::Tensor> w, std::optional<torch::Tensor> qkv_bias,
                            torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slot_mapping, torch::Tensor rows, torch::Tensor spans, torch::Tensor slots,
                            int64_t num_heads, int64_t num_kv_heads, double eps, double scale);

torch::Tensor rotate_rows(torch::Tensor x, torch::Tensor smooth, torch::Tensor rot, bool transpose);
torch::Tensor decoder_layer_i8(torch::Tensor x, std::vector<torch::Tensor> w, std::optional<torch::Tensor> qkv_bias,
                               torch::Tensor cos, torch::Tensor sin_signed, std::vector<torch::Tensor> planes,
                               std::vector<torch::Tensor> transform, torch::Tensor slot_mapping, torch::Tensor rows,
                               torch::Tensor spans, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads,
                               double eps, double scale);

torch::Tensor decoder_stack(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> biases,
                            torch::Tensor cos, torch::Tensor sin_signed, std::vector<torch::Tensor> caches,
                            std::vector<torch::Tensor> transforms, torch::Tensor slot_mapping, torch::Tensor rows,
                            torch::Tensor spans, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads,
                            double eps, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "y = x @ W^T for 1..64 rows, W packed as [N/16, K, 16]");
  m.def("repack_gguf", &repack_gguf, "raw GGUF blocks [N, row bytes] (rows permuted) -> kernel records out [N/16, K/32, bytes]");
  m.def("unpack_records", &unpack_records, "float32 rows of kernel records (bitwise gguf's dequantisation)");
  m.def("natural_kind", &natural_kind, "the record kind of a ggml quantization type id (-1: none)");
  m.def("a8_linear", &a8_linear, "y = x @ W^T with x quantised to int8 per 32 inputs (W4A8 / W8A8, VNNI)");
  m.def("a8_isa", &a8_isa, "what a8_linear was built for: avx512-vnni, avx2, or portable (a slow scalar loop)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32)");
  m.def("attention_rows", &attention_rows, "query rows' attention over listed paged K/V slots (float32)");
  m.def("attention_rows_i8", &attention_rows_i8, "the same over an int8 cache (float16 scales per 16 channels)");
  m.def("quantize_kv_rows", &quantize_kv_rows, "int8 KV quantize-on-write (shift, smooth, rotate, 16-channel scales)");
  m.def("packed_linear", &packed_linear, "y = x @ W^T through W's packed format");
  m.def("rope_", &rope_, "RoPE in place on the first num_heads heads of each row of a fused QKV");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] gate/up projection");
  m.def("decoder_layer", &decoder_layer, "one Llama decoder layer for few-token rows in one call");
  m.def("rotate_rows", &rotate_rows, "(x * smooth) @ R, or x @ R^T, per row of [T, H, D] (int8 KV basis changes)");
  m.def("decoder_layer_i8", &decoder_layer_i8, "the same over an int8 KV cache (kv_quant.QuantizedKV planes)");
  m.def("decoder_stack", &decoder_stack, "a run of decoder layers (float32 or int8 cache) for one step in one call");
}
