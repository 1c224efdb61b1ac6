// x [M, K] rounded to int8 per row and block of 32 inputs, the activations of linear_kernel="packed-int8act":
// codes round(x * (127 / max|x|)) in float32 (0 for an all-zero block), scale max|x| / 127, and the sums the
// kernels' integer steps need (int8_records.h's QuantizedRows). Every form below gives the same values, so a
// row's codes do not depend on how many rows are rounded with it.
#include "tensor_api.h"

#include <algorithm>
#include <cmath>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "few_rows.h"
#include "int8_records.h"

// block b of x (32 inputs) rounded to int8: its codes, scale, sums and their product
static inline void quantize_block(const float* x, int64_t b, QuantizedRows& r) {
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
  r.half[2 * b] = _mm512_reduce_add_epi32(q0), r.half[2 * b + 1] = _mm512_reduce_add_epi32(q1);
  const int32_t acc = r.half[2 * b] + r.half[2 * b + 1];
  r.d[b] = d, r.sum[b] = acc, r.s[b] = d * static_cast<float>(acc);
#elif defined(__AVX2__)
  // the same, 8 lanes at a time (the scalar loop was ~12% of a 16-row step's one thread on Zen 3)
  __m256 vv[4];
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    vv[i] = _mm256_loadu_ps(v + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.f), vv[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 0x55)));
  const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(vv[i], _mm256_set1_ps(id)));
  // int32 -> int8 (no saturation: |q| <= 127); the packs interleave 4-value groups, the permute restores order
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + b * 32), bytes);
  auto sum8 = [](__m256i a) {
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i h2 = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    return _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 1)));
  };
  r.half[2 * b] = sum8(_mm256_add_epi32(q[0], q[1])), r.half[2 * b + 1] = sum8(_mm256_add_epi32(q[2], q[3]));
  const int32_t acc = r.half[2 * b] + r.half[2 * b + 1];
  r.d[b] = d, r.sum[b] = acc, r.s[b] = d * static_cast<float>(acc);
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t acc = 0;
  r.half[2 * b] = r.half[2 * b + 1] = 0;
  for (int i = 0; i < 32; ++i) {
    const int32_t qi = std::max(-127, std::min(127, static_cast<int32_t>(std::nearbyint(v[i] * id))));
    r.q[b * 32 + i] = static_cast<int8_t>(qi);
    r.half[2 * b + i / 16] += qi;
    acc += qi;
  }
  r.d[b] = d, r.sum[b] = acc, r.s[b] = d * static_cast<float>(acc);
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// lane j: the maximum of a[j]'s 16 lanes, by a transposing tree of 15 pairwise steps (16 blocks' reductions in 45
// shuffles and maxima instead of 16 x 8 dependent ones; a maximum is exact in any order)
static inline __m512 lane_max16(const __m512* a) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a[2i] at positions 0, 2 and a[2i + 1] at 1, 3
    t[i] = _mm512_max_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: a[4i + p] at position p, reduced over that lane
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // lanes 0, 1 of u[2i] joined, then 2, 3, then u[2i + 1]'s
    w[i] = _mm512_max_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_max_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// blocks b .. b + 15 (512 consecutive inputs) at once, with the values quantize_block gives them: the 16 maxima by
// lane_max16, the scales by two vector divisions, the codes packed two blocks to a 64-byte store, and the half
// sums from those bytes (vpsadbw of 8 codes + 128 at a time) rather than a horizontal sum per half. 2.4x
// quantize_block's speed on one Zen 4 thread; int8 steps of the bundled model 1.03-1.13x faster at 4-32 rows (a
// few rows are rounded on the calling thread while the other waits), prompts level (kernel_ab).
static inline void quantize_16_blocks(const float* x, int64_t b, QuantizedRows& r) {
  const float* v = x + b * 32;
  __m512 m[16];
  for (int j = 0; j < 16; ++j)
    m[j] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v + 32 * j)),
                         _mm512_abs_ps(_mm512_loadu_ps(v + 32 * j + 16)));
  const __m512 amax = lane_max16(m), k127 = _mm512_set1_ps(127.f);
  const __m512 d = _mm512_div_ps(amax, k127);
  alignas(64) float id[16];  // 0 where the block is all zeros
  _mm512_store_ps(id, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ), k127, amax));
  // packs_epi32 then packs_epi16 leave each 128-bit lane's 4-code groups interleaved; this puts them back
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i sad[8];  // blocks 2i, 2i + 1: sums of 8 codes + 128 each, in input order
  for (int j = 0; j < 16; j += 2) {
    const __m512 s0 = _mm512_set1_ps(id[j]), s1 = _mm512_set1_ps(id[j + 1]);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 32 * j), s0));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 32 * j + 16), s0));
    const __m512i q2 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 32 * j + 32), s1));
    const __m512i q3 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 32 * j + 48), s1));
    const __m512i codes = _mm512_permutexvar_epi32(  // no saturation: |q| <= 127
        order, _mm512_packs_epi16(_mm512_packs_epi32(q0, q1), _mm512_packs_epi32(q2, q3)));
    _mm512_storeu_si512(r.q.data() + (b + j) * 32, codes);
    sad[j / 2] = _mm512_sad_epu8(_mm512_xor_si512(codes, _mm512_set1_epi8(-128)), _mm512_setzero_si512());
  }
  __m256i halves[4];  // halves 8i .. 8i + 7 of these blocks, in the order 0 4 1 5 2 6 3 7 (+ 16 x 128 each)
  for (int i = 0; i < 4; ++i)
    halves[i] = _mm512_cvtepi64_epi32(_mm512_add_epi64(_mm512_unpacklo_epi64(sad[2 * i], sad[2 * i + 1]),
                                                       _mm512_unpackhi_epi64(sad[2 * i], sad[2 * i + 1])));
  const __m512i in_order = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  const __m512i bias = _mm512_set1_epi32(16 * 128);
  const __m512i h0 = _mm512_sub_epi32(
      _mm512_permutexvar_epi32(in_order, _mm512_inserti64x4(_mm512_castsi256_si512(halves[0]), halves[1], 1)), bias);
  const __m512i h1 = _mm512_sub_epi32(
      _mm512_permutexvar_epi32(in_order, _mm512_inserti64x4(_mm512_castsi256_si512(halves[2]), halves[3], 1)), bias);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(_mm512_permutex2var_epi32(h0, even, h1), _mm512_permutex2var_epi32(h0, odd, h1));
  _mm512_storeu_si512(r.half.data() + 2 * b, h0);
  _mm512_storeu_si512(r.half.data() + 2 * b + 16, h1);
  _mm512_storeu_si512(r.sum.data() + b, sum);
  _mm512_storeu_ps(r.d.data() + b, d);
  _mm512_storeu_ps(r.s.data() + b, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)));
}
#elif defined(__AVX2__)
// lane j: the maximum of a[j]'s 8 lanes (a transposing tree of 7 pairwise steps)
static inline __m256 lane_max8(const __m256* a) {
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: a[2i] at positions 0, 2 and a[2i + 1] at 1, 3
    t[i] = _mm256_max_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {  // per 128-bit lane: a[4i + p] at position p, reduced over that lane
    const __m256d x = _mm256_castps_pd(t[2 * i]), y = _mm256_castps_pd(t[2 * i + 1]);
    u[i] = _mm256_max_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_max_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
// blocks b .. b + 7 at once, quantize_16_blocks' way in 256-bit registers (2.0x quantize_block's speed, one Zen 4
// thread with the AVX2 build)
static inline void quantize_8_blocks(const float* x, int64_t b, QuantizedRows& r) {
  const float* v = x + b * 32;
  const __m256 sign = _mm256_set1_ps(-0.f);
  auto magnitude = [&](const float* w) { return _mm256_andnot_ps(sign, _mm256_loadu_ps(w)); };
  __m256 m[8];
  for (int j = 0; j < 8; ++j) {
    const float* w = v + 32 * j;
    m[j] = _mm256_max_ps(_mm256_max_ps(magnitude(w), magnitude(w + 8)),
                         _mm256_max_ps(magnitude(w + 16), magnitude(w + 24)));
  }
  const __m256 amax = lane_max8(m), k127 = _mm256_set1_ps(127.f);
  const __m256 d = _mm256_div_ps(amax, k127);
  alignas(32) float id[8];  // 127 / 0 is masked to 0
  _mm256_store_ps(id, _mm256_and_ps(_mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_div_ps(k127, amax)));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' interleaving
  __m256i sad[8];  // block j: sums of 8 codes + 128 each, in input order
  for (int j = 0; j < 8; ++j) {
    const __m256 s = _mm256_set1_ps(id[j]);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 32 * j + 8 * i), s));
    const __m256i codes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + (b + j) * 32), codes);
    sad[j] = _mm256_sad_epu8(_mm256_xor_si256(codes, _mm256_set1_epi8(-128)), _mm256_setzero_si256());
  }
  __m256 t[4];  // 128-bit lane h: [block 2i's half h, block 2i + 1's half h] as 64-bit sums
  for (int i = 0; i < 4; ++i)
    t[i] = _mm256_castsi256_ps(_mm256_add_epi64(_mm256_unpacklo_epi64(sad[2 * i], sad[2 * i + 1]),
                                                _mm256_unpackhi_epi64(sad[2 * i], sad[2 * i + 1])));
  // 128-bit lane h: half h of blocks 4i .. 4i + 3 (the low 32 bits of each 64-bit sum)
  const __m256i bias = _mm256_set1_epi32(16 * 128);
  const __m256i h03 = _mm256_sub_epi32(_mm256_castps_si256(_mm256_shuffle_ps(t[0], t[1], 0x88)), bias);
  const __m256i h47 = _mm256_sub_epi32(_mm256_castps_si256(_mm256_shuffle_ps(t[2], t[3], 0x88)), bias);
  const __m256i sum =
      _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20), _mm256_permute2x128_si256(h03, h47, 0x31));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.half.data() + 2 * b), _mm256_permutevar8x32_epi32(h03, order));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.half.data() + 2 * b + 8), _mm256_permutevar8x32_epi32(h47, order));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.sum.data() + b), sum);
  _mm256_storeu_ps(r.d.data() + b, d);
  _mm256_storeu_ps(r.s.data() + b, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sum)));
}
#endif

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  QuantizedRows r{RowBuffer<int8_t>(M * K), RowBuffer<float>(M * nb), RowBuffer<float>(M * nb),
                  RowBuffer<int32_t>(M * nb), RowBuffer<int32_t>(2 * M * nb)};
  auto body = [&](int64_t row0, int64_t row1) {
    int64_t b = row0 * nb;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
    for (; b + 16 <= row1 * nb; b += 16) quantize_16_blocks(x, b, r);
#elif defined(__AVX2__)
    for (; b + 8 <= row1 * nb; b += 8) quantize_8_blocks(x, b, r);
#endif
    for (; b < row1 * nb; ++b) quantize_block(x, b, r);
  };
  // (a prompt's rows on every thread: a 1,000-token prefill's projections of the bundled model 0.89x the time,
  // A/B on Zen 4)
  over_rows(M, body);
  return r;
}
