// The AVX2 builds' score and weighted-sum loops of few-row attention (attention_rows.h): 16 registers of 8 floats,
// so the sums are blocked to fit them. Included by attention_rows.h after its loaders; empty on other builds.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "kv_prefetch.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (16 registers of 8 floats). attention_rows.h's 16-lane loops kept their sums on the stack here, a store and a
// load per product (one row's attention over 128 positions took 128 us a layer, more than the layer's projections);
// these keep every sum in a register. One fixed order per value, whoever calls: a score is q . k as a product of the
// first 8 elements and FMAs of the next 8s in order, its 8 lanes summed by hsum4's tree; a weighted sum is one FMA
// per key in key order, per lane. So a row's bits are its own, alone, batched or in a tree.
#define ATTENTION_AVX2 1
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {  // bfloat16 is float32's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// the lane sums of four vectors as four floats, by one fixed tree: lane u is ((a_u0 + a_u1) + (a_u2 + a_u3)) +
// ((a_u4 + a_u5) + (a_u6 + a_u7)), whatever the other three vectors hold
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 z = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

// scores sh[g * np + j] = scale * q_g . K[slots[j]] for GG (1-3) query heads q [GG, D] (D a multiple of 8), four
// keys at a time (12 sums in registers at most); a last key or three alone, by the same tree
template <int GG, typename T>
static inline void score_heads(const float* q, int64_t D, const T* k, const int64_t* slots, int64_t n, int64_t row,
                               float scale, float* sh, int64_t np) {
  const __m128 sc = _mm_set1_ps(scale);
  const int64_t bytes = D * int64_t(sizeof(T));
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* kj[4];
    for (int u = 0; u < 4; ++u) {
      if (j + u + kPrefetchKeys < n) prefetch_row(k + slots[j + u + kPrefetchKeys] * row, bytes);
      kj[u] = k + slots[j + u] * row;
    }
    __m256 acc[GG][4];
    for (int u = 0; u < 4; ++u) {
      const __m256 kc = load8(kj[u]);
      for (int g = 0; g < GG; ++g) acc[g][u] = _mm256_mul_ps(_mm256_loadu_ps(q + g * D), kc);
    }
    for (int64_t c = 8; c < D; c += 8)
      for (int u = 0; u < 4; ++u) {
        const __m256 kc = load8(kj[u] + c);
        for (int g = 0; g < GG; ++g) acc[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), kc, acc[g][u]);
      }
    for (int g = 0; g < GG; ++g)
      _mm_storeu_ps(sh + g * np + j, _mm_mul_ps(hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), sc));
  }
  const __m256 zero = _mm256_setzero_ps();
  for (; j < n; ++j) {
    const T* kj = k + slots[j] * row;
    __m256 acc[GG];
    for (int g = 0; g < GG; ++g) acc[g] = _mm256_mul_ps(_mm256_loadu_ps(q + g * D), load8(kj));
    for (int64_t c = 8; c < D; c += 8) {
      const __m256 kc = load8(kj + c);
      for (int g = 0; g < GG; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), kc, acc[g]);
    }
    for (int g = 0; g < GG; ++g) sh[g * np + j] = _mm_cvtss_f32(_mm_mul_ss(hsum4(acc[g], zero, zero, zero), sc));
  }
}

// out_g[0 .. 8 CC) (+)= sum_j p_g[j] * V[slots[j]][0 .. 8 CC) for GG query heads (p_g = p + g * np, out_g = out +
// g * stride; init: from zero), in key order
template <int GG, int CC, typename T>
static inline void weighted_heads(const float* p, int64_t np, const T* v, const int64_t* slots, int64_t n,
                                  int64_t row, float* out, int64_t stride, bool init) {
  __m256 acc[GG][CC];
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < CC; ++c) acc[g][c] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(out + g * stride + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v + slots[j] * row;
    if (j + kPrefetchKeys < n) prefetch_row(v + slots[j + kPrefetchKeys] * row, 8 * CC * int64_t(sizeof(T)));
    __m256 x[CC];
    for (int c = 0; c < CC; ++c) x[c] = load8(vj + 8 * c);
    for (int g = 0; g < GG; ++g) {
      const __m256 pj = _mm256_broadcast_ss(p + g * np + j);
      for (int c = 0; c < CC; ++c) acc[g][c] = _mm256_fmadd_ps(x[c], pj, acc[g][c]);
    }
  }
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < CC; ++c) _mm256_storeu_ps(out + g * stride + 8 * c, acc[g][c]);
}

// f(std::integral_constant<int, GG>{}, g) for the query heads g .. g + GG - 1 of G, three a pass over the keys
template <class F>
static inline void by_three_heads(int64_t G, F&& f) {
  for (int64_t g = 0; g < G; g += 3) {
    if (G - g >= 3) f(std::integral_constant<int, 3>{}, g);
    else if (G - g == 2) f(std::integral_constant<int, 2>{}, g);
    else f(std::integral_constant<int, 1>{}, g);
  }
}

// weighted_heads over all of D (a multiple of 8): 16 elements a pass, 8 for an odd last one
template <int GG, typename T>
static inline void weighted_heads_all(const float* p, int64_t np, const T* v, const int64_t* slots, int64_t n,
                                      int64_t row, int64_t D, float* out, int64_t stride, bool init) {
  int64_t c = 0;
  for (; c + 16 <= D; c += 16) weighted_heads<GG, 2>(p, np, v + c, slots, n, row, out + c, stride, init);
  if (c < D) weighted_heads<GG, 1>(p, np, v + c, slots, n, row, out + c, stride, init);
}

// Two rows over the same keys (a run's shared block, attention_rows.cpp): score_heads for both at once, each key's
// 8-element pieces loaded once for the two rows' 2 GG dot products and two keys a group (12 sums in registers at
// most). One row's loop loads a query piece per product, four loads for three FMAs, and is bound by its loads;
// here 2 + 2 GG loads feed 4 GG FMAs. Each score is still the product of the first 8 elements and FMAs of the
// next 8s in order, its lanes summed by hsum4's tree (whose lanes do not mix), so both rows get score_heads' bits.
template <int GG, typename T>
static inline void score_heads2(const float* q0, const float* q1, int64_t D, const T* k, const int64_t* slots,
                                int64_t n, int64_t row, float scale, float* s0, int64_t np0, float* s1,
                                int64_t np1) {
  const __m128 sc = _mm_set1_ps(scale);
  const float* q[2] = {q0, q1};
  const int64_t bytes = D * int64_t(sizeof(T));
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const T* kj[2];
    for (int u = 0; u < 2; ++u) {
      if (j + u + kPrefetchKeys < n) prefetch_row(k + slots[j + u + kPrefetchKeys] * row, bytes);
      kj[u] = k + slots[j + u] * row;
    }
    __m256 acc[2][GG][2];
    for (int u = 0; u < 2; ++u) {
      const __m256 kc = load8(kj[u]);
      for (int r = 0; r < 2; ++r)
        for (int g = 0; g < GG; ++g) acc[r][g][u] = _mm256_mul_ps(_mm256_loadu_ps(q[r] + g * D), kc);
    }
    for (int64_t c = 8; c < D; c += 8)
      for (int u = 0; u < 2; ++u) {
        const __m256 kc = load8(kj[u] + c);
        for (int r = 0; r < 2; ++r)
          for (int g = 0; g < GG; ++g)
            acc[r][g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + g * D + c), kc, acc[r][g][u]);
      }
    for (int g = 0; g < GG; ++g) {  // lanes: row 0's two keys, then row 1's
      const __m128 s = _mm_mul_ps(hsum4(acc[0][g][0], acc[0][g][1], acc[1][g][0], acc[1][g][1]), sc);
      _mm_storel_pi(reinterpret_cast<__m64*>(s0 + g * np0 + j), s);
      _mm_storeh_pi(reinterpret_cast<__m64*>(s1 + g * np1 + j), s);
    }
  }
  if (j < n) {  // a last key alone, by the same tree
    score_heads<GG>(q0, D, k, slots + j, n - j, row, scale, s0 + j, np0);
    score_heads<GG>(q1, D, k, slots + j, n - j, row, scale, s1 + j, np1);
  }
}

// weighted_heads for two rows over the same keys (p0 / p1 their probabilities, out0 / out1 their sums): each V
// piece loaded once for both and 2 GG CC independent sums (12 at most) in flight, where one row's 6 wait on the
// FMA's latency. Every sum is still one FMA per key in key order, so each row gets weighted_heads' bits.
// Always inlined: GCC 12 compiled it out of line (called from weighted_heads2_all) with every sum also stored to
// the stack on every key, 12 stores a key that bounded the loop (two rows took longer than two single-row calls);
// inlined, the sums stay in registers. Its own body, not weighted_heads' made a template over the row count: that
// form ran 2-16 tree rows 0.95-0.99x of this one (alternating calls, Zen 3).
template <int GG, int CC, typename T>
__attribute__((always_inline)) static inline void weighted_heads2(const float* p0, int64_t np0, const float* p1,
                                                                  int64_t np1, const T* v, const int64_t* slots,
                                                                  int64_t n, int64_t row, float* out0, float* out1,
                                                                  int64_t stride, bool init) {
  __m256 a0[GG][CC], a1[GG][CC];
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < CC; ++c) {
      a0[g][c] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(out0 + g * stride + 8 * c);
      a1[g][c] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(out1 + g * stride + 8 * c);
    }
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v + slots[j] * row;
    if (j + kPrefetchKeys < n) prefetch_row(v + slots[j + kPrefetchKeys] * row, 8 * CC * int64_t(sizeof(T)));
    __m256 x[CC];
    for (int c = 0; c < CC; ++c) x[c] = load8(vj + 8 * c);
    for (int g = 0; g < GG; ++g) {
      const __m256 pj = _mm256_broadcast_ss(p0 + g * np0 + j);
      for (int c = 0; c < CC; ++c) a0[g][c] = _mm256_fmadd_ps(x[c], pj, a0[g][c]);
    }
    for (int g = 0; g < GG; ++g) {
      const __m256 pj = _mm256_broadcast_ss(p1 + g * np1 + j);
      for (int c = 0; c < CC; ++c) a1[g][c] = _mm256_fmadd_ps(x[c], pj, a1[g][c]);
    }
  }
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < CC; ++c) {
      _mm256_storeu_ps(out0 + g * stride + 8 * c, a0[g][c]);
      _mm256_storeu_ps(out1 + g * stride + 8 * c, a1[g][c]);
    }
}

// weighted_heads2 over all of D (a multiple of 8): 16 elements a pass, 8 for an odd last one
template <int GG, typename T>
static inline void weighted_heads2_all(const float* p0, int64_t np0, const float* p1, int64_t np1, const T* v,
                                       const int64_t* slots, int64_t n, int64_t row, int64_t D, float* out0,
                                       float* out1, int64_t stride, bool init) {
  int64_t c = 0;
  for (; c + 16 <= D; c += 16)
    weighted_heads2<GG, 2>(p0, np0, p1, np1, v + c, slots, n, row, out0 + c, out1 + c, stride, init);
  if (c < D) weighted_heads2<GG, 1>(p0, np0, p1, np1, v + c, slots, n, row, out0 + c, out1 + c, stride, init);
}
#endif
