// y = x @ W^T with x rounded to int8 per 32 inputs (linear_kernel="packed-int8act"; the layout: int8_records.h;
// the rounding: quantize_rows.cpp).
#include "tensor_api.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "few_rows.h"
#include "int8_records.h"
#include "ops.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int R, int A>
static inline void rows_x_a8panel(const QuantizedRows& xr, int64_t r0, const uint8_t* __restrict base,
                                  float* __restrict y, int64_t K, int64_t N) {
  constexpr bool Q4 = A8Block<A>::Q4;
  const int64_t nb = K / 32;
  const int8_t* xq = xr.q.data() + r0 * K;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const A8Block<A> blk(base, b);
    A8Block<A>(base, b + PREFETCH_RECORDS).prefetch();
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
// Q6K (see the layout above): the top 2 bits of 4 input groups share a line; each is moved to bits 4-5 of its
// byte and joined to its low nibble, giving u = q + 32 (a8_q6k_half). Each half of 16 inputs has its own int8
// scale, so each row keeps one integer sum per half: sum(u * qx) - 32 sum(qx), times the half's scale, both added
// as integers, then one float step per block. Integer sums are exact in any order, so the two forms below give the
// same bits (and the AMX and portable paths' too):
// - up to 6 rows: a half's lines unpacked and used by every row before the next half's, every row's two sums kept;
// - 7-8 rows: the block's 8 groups unpacked at once into registers, then each row's two sums and its float step in
//   one go (keeping every row's sums across the unpacking spilled them to the stack from 7 rows). A/B on Zen 4:
//   8 rows 1.12-1.15x faster this way, 3-6 rows 0.82-0.98x.
template <int R>
static inline void rows_x_a8q6k(const QuantizedRows& xr, int64_t r0, const uint8_t* __restrict base,
                                float* __restrict y, int64_t K, int64_t N) {
  const int64_t nb = K / 32;
  const int8_t* xq = xr.q.data() + r0 * K;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const A8Block<A8_Q6K> blk(base, b);
    A8Block<A8_Q6K>(base, b + PREFETCH_RECORDS).prefetch();
    const uint8_t* codes = blk.codes();
    const int8_t* xb = xq + b * 32;
    const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 64 + 32 * blk.sb)));
    const __m512i sc1 =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 80 + 32 * blk.sb)));
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk.rec));
    auto word = [&](int r, int v) {  // row r's inputs 4v .. 4v+3 of this block, in every lane
      int32_t w;
      __builtin_memcpy(&w, xb + r * K + 4 * v, 4);
      return _mm512_set1_epi32(w);
    };
    auto finish = [&](int r, __m512i s0, __m512i s1) {  // row r's float step from its two half sums
      const int64_t i = (r0 + r) * nb + b;
      const __m512i c0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * xr.half[2 * i]));
      const __m512i c1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * xr.half[2 * i + 1]));
      const __m512i tot = _mm512_add_epi32(_mm512_mullo_epi32(c0, sc0), _mm512_mullo_epi32(c1, sc1));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(d, _mm512_set1_ps(xr.d[i])), acc[r]);
    };
    if constexpr (R >= 7) {
      __m512i u[8];  // u[v]: inputs 4v .. 4v+3 of the 16 outputs; v < 4 is the first half, v >= 4 the second
      a8_q6k_half(codes, 0, u);
      a8_q6k_half(codes, 1, u + 4);
      for (int r = 0; r < R; ++r) {
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int v = 0; v < 4; ++v) {
          s0 = _mm512_dpbusd_epi32(s0, u[v], word(r, v));
          s1 = _mm512_dpbusd_epi32(s1, u[v + 4], word(r, v + 4));
        }
        finish(r, s0, s1);
      }
    } else {
      __m512i ih[2][R];
      for (int h = 0; h < 2; ++h) {
        __m512i u[4];  // inputs 16h + 4i .. 16h + 4i + 3
        a8_q6k_half(codes, h, u);
        for (int r = 0; r < R; ++r) ih[h][r] = _mm512_setzero_si512();
        for (int v = 0; v < 4; v += 2)  // each line's two groups for every row before the next line's
          for (int r = 0; r < R; ++r) {
            ih[h][r] = _mm512_dpbusd_epi32(ih[h][r], u[v], word(r, 4 * h + v));
            ih[h][r] = _mm512_dpbusd_epi32(ih[h][r], u[v + 1], word(r, 4 * h + v + 1));
          }
      }
      for (int r = 0; r < R; ++r) finish(r, ih[0][r], ih[1][r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}
constexpr const char* A8_ISA = "avx512-vnni";
#elif defined(__AVX2__) && defined(__F16C__)
// AVX2 (no VNNI: AMD Zen 1-3, most client x86): vpmaddubsw + vpmaddwd make the same 4-product integer sums per
// 32-bit lane as vpdpbusd, over 8 outputs per 256-bit half of a line. vpmaddubsw saturates pairs at int16, which
// Q4 codes (<= 15 x 127 x 2) never reach but Q8's offset codes (<= 255 x 127 x 2) would: Q8 multiplies |q| by
// x carrying q's sign instead (<= 128 x 127 x 2), the same integer sum(q * x) the offset form makes. Where the
// int16 pair sums of several groups stay within int16 (a Q4 block's 8 groups, two Q6_K groups), they are added
// as int16 and widened by one vpmaddwd: a third fewer multiply-port ops, 6-18% faster Q4_1, Q4_K and Q6_K
// projections at 1-16 rows (A/B of the two builds in one process, Zen 3). The sums are exact either way and the
// float steps are the VNNI loop's, lane for lane, so results are bit-identical to it.
// 8 rows' (half h of a block's 16) scale and minimum, as A8Block's scalar forms compute them
template <int A>
static inline __m256 a8_scale8(const A8Block<A>& blk, int h) {
  if constexpr (A == A8_Q4H)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 16 * h)));
  const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(blk.rec) + 8 * h);
  if constexpr (A != A8_Q4K) return d;
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.rec + 128 + 16 * blk.sb + 8 * h)))));
}
template <int A>
static inline __m256 a8_minimum8(const A8Block<A>& blk, int h) {
  if constexpr (A == A8_Q4H)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 32 + 16 * h)));
  const __m256 m = _mm256_loadu_ps(reinterpret_cast<const float*>(blk.rec + 64) + 8 * h);
  if constexpr (A != A8_Q4K) return m;
  const __m256 mq = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.rec + 256 + 16 * blk.sb + 8 * h))));
  return _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(m, mq));
}

// a row's two running sums are in registers here, updated in this order: integer adds are exact, so GCC may
// reassociate them, and did: it made all of a block's products first and spilled them to the stack to sum later
// (Q4_1, 64 rows, one Zen 3 thread: 40 G multiply-adds/s that way, 53 G with the group loop unrolled and the sums
// pinned; the results are the same integers either way). One row is left to the compiler: pinned, its
// projections ran 0.94-0.98x (two rows pinned: 1.07-1.09x)
static inline void pin(__m256i& a, __m256i& b) { __asm__("" : "+x"(a), "+x"(b)); }

// Per block: each group of four inputs' weights made in registers once (nibbles masked, or Q8's codes and their
// magnitudes) and used by every row of the chunk, whose integer sums stay in registers across the block (2 x R of
// AVX2's 16), then the float steps per row. Unpacking a block into a stack buffer for the rows to reload (the
// earlier form) cost a 16-row int8 step of the bundled model ~8% (in-process A/B on Zen 3); the sums are exact in
// any order, so the bits are the same.
template <int R, int A>
static inline void rows_x_a8panel(const QuantizedRows& xr, int64_t r0, const uint8_t* __restrict base,
                                  float* __restrict y, int64_t K, int64_t N) {
  constexpr bool Q4 = A8Block<A>::Q4;
  const int64_t nb = K / 32;
  const int8_t* xq = xr.q.data() + r0 * K;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8(-128);
  alignas(32) float acc[R][2][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const A8Block<A> blk(base, b);
    A8Block<A>(base, b + PREFETCH_RECORDS).prefetch();
    const uint8_t* codes = blk.codes();
    __m256i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    auto xword = [&](int r, int v) {  // row r's inputs 4v .. 4v+3 of this block, in every lane
      int32_t word;
      __builtin_memcpy(&word, xq + r * K + b * 32 + 4 * v, 4);
      return _mm256_set1_epi32(word);
    };
    if constexpr (Q4) {
      // line g: low nibbles are inputs 8g .. 8g+3, high ones 8g+4 .. 8g+7; each nibble set made once and used
      // by every row before the next (a rolled loop over the 8 groups, branching on the nibble half, kept a sum
      // on the stack)
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const __m256i* line = reinterpret_cast<const __m256i*>(codes + 64 * g);
        const __m256i lo0 = _mm256_and_si256(_mm256_loadu_si256(line), low4);
        const __m256i lo1 = _mm256_and_si256(_mm256_loadu_si256(line + 1), low4);
        for (int r = 0; r < R; ++r) {  // int16 pair sums, widened once per block (below)
          const __m256i xv = xword(r, 2 * g);
          s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(lo0, xv));
          s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(lo1, xv));
          if constexpr (R > 1) pin(s[r][0], s[r][1]);
        }
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(line), 4), low4);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(line + 1), 4), low4);
        for (int r = 0; r < R; ++r) {
          const __m256i xv = xword(r, 2 * g + 1);
          s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(hi0, xv));
          s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(hi1, xv));
          if constexpr (R > 1) pin(s[r][0], s[r][1]);
        }
      }
    } else {
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {  // line v: inputs 4v .. 4v+3, stored as q + 128
        const __m256i* line = reinterpret_cast<const __m256i*>(codes + 64 * v);
        const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(line), bias);
        const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256(line + 1), bias);
        const __m256i w0 = _mm256_abs_epi8(q0), w1 = _mm256_abs_epi8(q1);
        for (int r = 0; r < R; ++r) {  // x carries q's sign onto |q|
          const __m256i xv = xword(r, v);
          const __m256i p0 = _mm256_maddubs_epi16(w0, _mm256_sign_epi8(xv, q0));
          const __m256i p1 = _mm256_maddubs_epi16(w1, _mm256_sign_epi8(xv, q1));
          s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(p0, ones));
          s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(p1, ones));
          if constexpr (R > 1) pin(s[r][0], s[r][1]);
        }
      }
    }
    if constexpr (Q4)  // a Q4 block's 8 pair sums per lane: |sum| <= 8 x 2 x 15 x 127 = 30,480, within int16
      for (int r = 0; r < R; ++r) {
        s[r][0] = _mm256_madd_epi16(s[r][0], ones);
        s[r][1] = _mm256_madd_epi16(s[r][1], ones);
      }
    const __m256 d0 = a8_scale8(blk, 0), d1 = a8_scale8(blk, 1);
    const __m256 m0 = Q4 ? a8_minimum8(blk, 0) : _mm256_setzero_ps();
    const __m256 m1 = Q4 ? a8_minimum8(blk, 1) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const __m256 xd = _mm256_set1_ps(xr.d[i]);
      __m256 a0 = _mm256_load_ps(acc[r][0]), a1 = _mm256_load_ps(acc[r][1]);
      a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(d0, xd), a0);
      a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(d1, xd), a1);
      if (Q4) {
        const __m256 xs = _mm256_set1_ps(xr.s[i]);
        a0 = _mm256_fmadd_ps(m0, xs, a0);
        a1 = _mm256_fmadd_ps(m1, xs, a1);
      }
      _mm256_store_ps(acc[r][0], a0);
      _mm256_store_ps(acc[r][1], a1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * N, _mm256_load_ps(acc[r][0]));
    _mm256_storeu_ps(y + r * N + 8, _mm256_load_ps(acc[r][1]));
  }
}
template <int R>
static inline void rows_x_a8q6k(const QuantizedRows& xr, int64_t r0, const uint8_t* __restrict base,
                                float* __restrict y, int64_t K, int64_t N) {
  const int64_t nb = K / 32;
  const int8_t* xq = xr.q.data() + r0 * K;
  const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  alignas(32) uint8_t wu[8][2][32];  // u = q + 32 of input group v (inputs 4v .. 4v+3) per half line
  for (int64_t b = 0; b < nb; ++b) {
    const A8Block<A8_Q6K> blk(base, b);
    A8Block<A8_Q6K>(base, b + PREFETCH_RECORDS).prefetch();
    const uint8_t* codes = blk.codes();
    for (int hh = 0; hh < 2; ++hh)
      for (int h = 0; h < 2; ++h) {
        const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 256 + 64 * h + 32 * hh));
        const __m256i top[4] = {_mm256_and_si256(_mm256_slli_epi16(H, 4), top2),
                                _mm256_and_si256(_mm256_slli_epi16(H, 2), top2), _mm256_and_si256(H, top2),
                                _mm256_and_si256(_mm256_srli_epi16(H, 2), top2)};
        for (int gg = 0; gg < 2; ++gg) {
          const int g = 2 * h + gg;
          const __m256i L = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * g + 32 * hh));
          _mm256_store_si256(reinterpret_cast<__m256i*>(wu[2 * g][hh]),
                             _mm256_or_si256(_mm256_and_si256(L, low4), top[2 * gg]));
          _mm256_store_si256(reinterpret_cast<__m256i*>(wu[2 * g + 1][hh]),
                             _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L, 4), low4), top[2 * gg + 1]));
        }
      }
    __m256i sc[2][2];
    for (int h = 0; h < 2; ++h)
      for (int hh = 0; hh < 2; ++hh)
        sc[h][hh] = _mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.rec + 64 + 16 * (2 * blk.sb + h) + 8 * hh)));
    const __m256 d[2] = {_mm256_loadu_ps(reinterpret_cast<const float*>(blk.rec)),
                         _mm256_loadu_ps(reinterpret_cast<const float*>(blk.rec) + 8)};
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + b * 32;
      __m256i s[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()},
                         {_mm256_setzero_si256(), _mm256_setzero_si256()}};
      for (int v = 0; v < 8; v += 2) {  // two groups' int16 pair sums added before widening: u <= 63, so
        int32_t w0, w1;                   // |sum| <= 2 x 2 x 63 x 127 = 32,004, within int16
        __builtin_memcpy(&w0, xb + 4 * v, 4);
        __builtin_memcpy(&w1, xb + 4 * v + 4, 4);
        const __m256i x0 = _mm256_set1_epi32(w0), x1 = _mm256_set1_epi32(w1);
        for (int hh = 0; hh < 2; ++hh) {
          const __m256i p = _mm256_add_epi16(
              _mm256_maddubs_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(wu[v][hh])), x0),
              _mm256_maddubs_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(wu[v + 1][hh])), x1));
          s[v / 4][hh] = _mm256_add_epi32(s[v / 4][hh], _mm256_madd_epi16(p, ones));
        }
      }
      const int64_t i = (r0 + r) * nb + b;
      const __m256i off0 = _mm256_set1_epi32(32 * xr.half[2 * i]), off1 = _mm256_set1_epi32(32 * xr.half[2 * i + 1]);
      const __m256 xd = _mm256_set1_ps(xr.d[i]);
      for (int hh = 0; hh < 2; ++hh) {
        const __m256i tot = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_sub_epi32(s[0][hh], off0), sc[0][hh]),
                                             _mm256_mullo_epi32(_mm256_sub_epi32(s[1][hh], off1), sc[1][hh]));
        acc[r][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(d[hh], xd), acc[r][hh]);
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
  constexpr bool Q4 = A8Block<A>::Q4;
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
template <int R>
static inline void rows_x_a8q6k(const QuantizedRows& xr, int64_t r0, const uint8_t* __restrict base,
                                float* __restrict y, int64_t K, int64_t N) {
  const int64_t nb = K / 32;
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = xr.q.data() + (r0 + r) * K;
    float acc[16] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const A8Block<A8_Q6K> blk(base, b);
      const int64_t i = (r0 + r) * nb + b;
      for (int j = 0; j < 16; ++j) {
        int32_t tot = 0;
        for (int h = 0; h < 2; ++h) {
          int32_t isum = -32 * xr.half[2 * i + h];
          for (int t = 16 * h; t < 16 * h + 16; ++t) isum += a8_q6k_code(blk.codes(), j, t) * xq[b * 32 + t];
          tot += isum * blk.sub_scale(j, h);
        }
        acc[j] = std::fma(static_cast<float>(tot), blk.scale(j) * xr.d[i], acc[j]);
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
  with_rows(rows, [&](auto R) {
    if constexpr (A == A8_Q6K) rows_x_a8q6k<R.value>(xr, r0, rec, y, K, N);
    else rows_x_a8panel<R.value, A>(xr, r0, rec, y, K, N);
  });
}

// the fewest rows a8_linear gives to AMX tiles (0: never), set by the kernel plan from its start-up measurement;
// until then 32, from where tiles measured faster than the VNNI loop for every record kind here (Xeon, 2 vCPUs)
static std::atomic<int64_t> amx_min_rows{32};
void set_a8_amx_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "set_a8_amx_rows: rows must be >= 0 (0: never use AMX)");
  amx_min_rows = rows;
}
int64_t a8_amx_rows() { return a8_amx_available() ? amx_min_rows.load() : 0; }

torch::Tensor a8_linear(torch::Tensor x, torch::Tensor packed, int64_t amx_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "a8_linear: x must be a contiguous [M, K] float32 tensor");
  const int64_t lines = packed.dim() == 4 ? packed.size(2) : 0;
  const int kind = lines == A8_Q4_LINES ? A8_Q4 : lines == A8_Q8_LINES ? A8_Q8 : lines == A8_Q4K_LINES ? A8_Q4K
                 : lines == A8_Q6K_LINES ? A8_Q6K : lines == A8_Q4H_LINES ? A8_Q4H : -1;
  TORCH_CHECK(kind >= 0 && packed.size(3) == 64 && packed.scalar_type() == torch::kByte && packed.is_contiguous(),
              "a8_linear: packed weight must be a contiguous uint8 [N/16, K/32, 5, 6 or 9, 64] or "
              "[N/16, K/256, 38 or 53, 64] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * (a8_super(kind) ? 256 : 32) == K, "a8_linear: K mismatch");
  // any number of rows: at this precision a prompt's rows must be computed exactly as a decoded token's would
  // be, or a prefix-cache hit (which prefills fewer rows) would change the result; each panel stays in L1/L2
  // while its chunks of 8 rows pass over it
  TORCH_CHECK(M >= 1, "a8_linear: at least one row");
  const QuantizedRows xr = quantize_rows(x.data_ptr<float>(), M, K);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t panel_bytes = packed.size(1) * packed.size(2) * 64;
  const int64_t min_rows = amx_rows < 0 ? amx_min_rows.load() : amx_rows;
  // AMX tiles give the same integer sums and float steps (amx_int8.cpp), so the choice changes no result
  if (min_rows > 0 && M >= min_rows && a8_amx_linear(kind, xr, M, wp, N / 16, panel_bytes, yp, K, N)) return y;
  auto panels = [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int64_t rows = std::min<int64_t>(ROW_CHUNK, M - r0);
        const uint8_t* panel = wp + p * panel_bytes;
        float* out = yp + r0 * N + p * 16;
        switch (kind) {
          case A8_Q4: rows_x_a8panel_any<A8_Q4>(rows, xr, r0, panel, out, K, N); break;
          case A8_Q8: rows_x_a8panel_any<A8_Q8>(rows, xr, r0, panel, out, K, N); break;
          case A8_Q4K: rows_x_a8panel_any<A8_Q4K>(rows, xr, r0, panel, out, K, N); break;
          case A8_Q6K: rows_x_a8panel_any<A8_Q6K>(rows, xr, r0, panel, out, K, N); break;
          default: rows_x_a8panel_any<A8_Q4H>(rows, xr, r0, panel, out, K, N);
        }
      }
  };
  over_panels(N / 16, 8, 4, panels);
  return y;
}

std::string a8_isa() { return A8_ISA; }
