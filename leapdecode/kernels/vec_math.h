// The float32 vector helpers the decode-step sources share (layer_ops.cpp, attention_rows.h, int8_kv.cpp): fixed
// summation orders, so a result never depends on which source or which caller computed it. Without -ffast-math the
// compiler keeps these orders; explicit vector types make it vectorise them anyway.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

// 8 lanes summed as hsum's last steps: halves added, then (c0 + c2) + (c1 + c3)
static inline float hsum8(v8f a) {
  v4f c, d;
  __builtin_memcpy(&c, &a, 16);
  __builtin_memcpy(&d, reinterpret_cast<const char*>(&a) + 16, 16);
  c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// the 16 lanes summed pairwise (a log-depth tree: a serial loop over lanes cost more than the products). The
// AVX-512 version is the same tree in registers: taking the vector's address made GCC keep a dot product's
// accumulator in memory across iterations (a store-to-load chain per 16 products)
static inline float hsum(v16f v) {
#if defined(__AVX512F__)
  const __m512 x = (__m512)v;
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(x), hi);
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));  // (c0 + c2, c1 + c3, ...)
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 0x55)));
#else
  v8f a, b;
  __builtin_memcpy(&a, &v, 32);
  __builtin_memcpy(&b, reinterpret_cast<const char*>(&v) + 32, 32);
  return hsum8(a + b);
#endif
}

// q . k over d floats in a fixed order (16 lanes, then the lanes summed): vectorised without -ffast-math. Below
// AVX-512 the 16 lanes are two 8-lane registers, the same sums in the same order: GCC kept a 16-lane accumulator
// in memory there (RMSNorm over 16 rows of 576 took 14.4 us, ~1.3 ns a value, on Zen 3)
static inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  int64_t i = 0;
  float tail = 0.f;
  if (d >= 16) {
#if defined(__AVX512F__)
    v16f acc = v16f{};
    for (; i + 16 <= d; i += 16) {
      v16f x, y;
      __builtin_memcpy(&x, a + i, 64);
      __builtin_memcpy(&y, b + i, 64);
      acc += x * y;
    }
    tail = hsum(acc);
#else
    v8f lo = v8f{}, hi = v8f{};
    for (; i + 16 <= d; i += 16) {
      v8f x0, y0, x1, y1;
      __builtin_memcpy(&x0, a + i, 32);
      __builtin_memcpy(&y0, b + i, 32);
      __builtin_memcpy(&x1, a + i + 8, 32);
      __builtin_memcpy(&y1, b + i + 8, 32);
      lo += x0 * y0;
      hi += x1 * y1;
    }
    tail = hsum8(lo + hi);  // hsum's 16 lanes: halves added, then its last steps
#endif
  }
  for (; i < d; ++i) tail += a[i] * b[i];
  return tail;
}

// y += a * x over d floats (explicit vectors: the compiler cannot rule out aliasing of y and x)
static inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t d) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    v16f xv, yv;
    __builtin_memcpy(&xv, x + i, 64);
    __builtin_memcpy(&yv, y + i, 64);
    yv += xv * a;
    __builtin_memcpy(y + i, &yv, 64);
  }
  for (; i < d; ++i) y[i] += a * x[i];
}

typedef int32_t v16i __attribute__((vector_size(64)));

// whether any lane of a comparison's mask (-1 / 0 per lane) is set: one mask test with AVX-512, halves folded
// otherwise (a lane-by-lane loop costs as much as the comparison it tests)
static inline bool any_lane(v16i m) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#else
  typedef int32_t v8i __attribute__((vector_size(32)));
  v8i a, b;
  __builtin_memcpy(&a, &m, 32);
  __builtin_memcpy(&b, reinterpret_cast<const char*>(&m) + 32, 32);
  a |= b;
  int64_t q[4];
  __builtin_memcpy(q, &a, 32);
  return (q[0] | q[1] | q[2] | q[3]) != 0;
#endif
}

// e^x lane by lane (Cephes' expf: range reduction by ln 2 in two parts, degree-6 polynomial; ~1 ulp), since
// scalar std::exp was most of a decode attention's time. Inputs here are scores minus their max (<= 0).
template <class V, class VI>
static inline V exp_lanes(V x) {
  const V lo = V{} - 87.3f, hi = V{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  V t = x * 1.44269504088896341f + 0.5f;
  V fx = __builtin_convertvector(__builtin_convertvector(t, VI), V);
  fx = fx + __builtin_convertvector(fx > t, V);  // truncation -> floor (the mask is -1 where fx > t)
  x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
  V y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x +
         1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  VI e = (__builtin_convertvector(fx, VI) + 127) << 23;
  return y * (V)e;
}

// The lanes of the loops over long rows (a logits row's argmax and top-k, the gated products): 16 with AVX-512,
// else 8, the register's width. GCC lowered those loops' 16-lane compares and selects through memory on AVX2: a
// 49,152-wide row's argmax took 110-170 us there, where torch sums the row in 7-13 us.
#if defined(__AVX512F__)
constexpr int kRowLanes = 16;
#else
constexpr int kRowLanes = 8;
#endif
typedef float vrf __attribute__((vector_size(4 * kRowLanes)));
typedef int32_t vri __attribute__((vector_size(4 * kRowLanes)));
static inline vrf exp_row_lanes(vrf x) { return exp_lanes<vrf, vri>(x); }

// the row lanes summed (hsum's tree where they are 16; its last steps where they are 8)
static inline float hsum_row_lanes(vrf v) {
#if defined(__AVX512F__)
  return hsum(v);
#else
  return hsum8(v);
#endif
}

// whether any lane of a row-lane comparison's mask is set
static inline bool any_row_lane(vri m) {
#if defined(__AVX512F__)
  return any_lane(m);
#elif defined(__AVX__)
  return _mm256_movemask_ps((__m256)m) != 0;
#else
  bool any = false;
  for (int l = 0; l < kRowLanes; ++l) any = any || m[l] != 0;
  return any;
#endif
}

// z[0 .. D) = y @ R (R row-major [D, D]): rows of R weighted by y and summed in i order; the int8 KV write and
// rotate_rows share it, so keys and queries change basis with the same rounding. Each output's sum is axpy's
// expression in the same order (one multiply-add per input, contracted alike in the vector and scalar forms), kept
// in a register's lanes, 64 outputs at a time. Summed in memory, one axpy per input, every step waited on the
// last one's store, and 16-lane vectors went through the stack on AVX2: rotate_rows was 9% of a 16-row tree
// step's samples with an int8 cache, on one thread while the other waited (16 rows x 9 heads of 64: 182 -> 29 us
// a call, Zen 3).
static inline void row_times(const float* y, const float* R, float* z, int64_t D) {
  constexpr int W = 64 / kRowLanes;
  auto piece = [&](int64_t e0, auto regs) {  // outputs e0 .. e0 + kRowLanes * regs
    constexpr int P = decltype(regs)::value;
    vrf acc[P] = {};
    for (int64_t i = 0; i < D; ++i) {
      const float a = y[i];
      for (int c = 0; c < P; ++c) {
        vrf x;
        __builtin_memcpy(&x, R + i * D + e0 + kRowLanes * c, sizeof(vrf));
        acc[c] += x * a;
      }
    }
    for (int c = 0; c < P; ++c) __builtin_memcpy(z + e0 + kRowLanes * c, &acc[c], sizeof(vrf));
  };
  int64_t e = 0;
  for (; e + 64 <= D; e += 64) piece(e, std::integral_constant<int, W>{});
  for (; e + kRowLanes <= D; e += kRowLanes) piece(e, std::integral_constant<int, 1>{});
  for (int64_t t = e; t < D; ++t) z[t] = 0.f;
  for (int64_t i = 0; i < D && e < D; ++i)
    for (int64_t t = e; t < D; ++t) z[t] += y[i] * R[i * D + t];
}

// row_times for n rows (y's and z's rows D apart), each row's outputs summed exactly as row_times sums them. With
// AVX-512 and R past L1 (D a multiple of 16, from 128), four rows take each pass over R together, each piece of R
// loaded once for all four: 1.45-1.55x a call at D = 128 and 256 (Zen 4); at D = 64, R stays in L1 and one row at
// a time measured faster (0.92x grouped).
// (kRowsTimesGroup rows a pass: callers that gather rows for it gather this many at a time)
constexpr int64_t kRowsTimesGroup = 4;
static inline void rows_times(const float* y, int64_t n, const float* R, float* z, int64_t D) {
  int64_t r = 0;
#if defined(__AVX512F__)
  constexpr int K = int(kRowsTimesGroup), W = 64 / kRowLanes;
  auto piece = [&](int64_t e0, auto regs) {  // outputs e0 .. e0 + kRowLanes * regs of rows r .. r + K
    constexpr int P = decltype(regs)::value;
    vrf acc[K][P] = {};
    for (int64_t i = 0; i < D; ++i) {
      vrf x[P];
      for (int c = 0; c < P; ++c) __builtin_memcpy(&x[c], R + i * D + e0 + kRowLanes * c, sizeof(vrf));
      for (int k = 0; k < K; ++k) {
        const float a = y[(r + k) * D + i];
        for (int c = 0; c < P; ++c) acc[k][c] += x[c] * a;
      }
    }
    for (int k = 0; k < K; ++k)
      for (int c = 0; c < P; ++c) __builtin_memcpy(z + (r + k) * D + e0 + kRowLanes * c, &acc[k][c], sizeof(vrf));
  };
  if (D % kRowLanes == 0 && D >= 128)
    for (; r + K <= n; r += K) {
      int64_t e = 0;
      for (; e + 64 <= D; e += 64) piece(e, std::integral_constant<int, W>{});
      for (; e < D; e += kRowLanes) piece(e, std::integral_constant<int, 1>{});
    }
#endif
  for (; r < n; ++r) row_times(y + r * D, R, z + r * D, D);
}

