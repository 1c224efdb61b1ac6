// The int8-activation records (linear_kernel="packed-int8act") and the quantised rows that multiply them: what
// int8_gemm.cpp (VNNI / AVX2 / portable kernels), amx_int8.cpp (AMX tiles) and quantize_rows.cpp (the rows) share.
#pragma once
#include <cstdint>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "block_formats.h"
#include "few_rows.h"
#include "row_buffer.h"

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
// bitwise the result of its Q4 records. Two more keep a file's own form instead of a wider one:
//   Q4H (5 lines; Q4_0 / Q4_1): d[16] f16 | m[16] f16 (the file's fp16 scale and minimum) | 4 code lines as Q4
//   Q6K (53 lines; Q6_K's super-block of 256): d[16] f32 | sc[16][16] int8 (one scale per 16 inputs, as the
//     file) | per sub-block of 32: 4 lines of the codes' low nibbles as Q4 | 2 lines of their top 2 bits, line h
//     holding inputs 16h .. 16h + 15: bits 2s, 2s + 1 of byte (j, t) = top(j, k0 + 16h + 4s + t)
// A Q6K code u = q + 32 is 0..63; each half-block's integer sum is  sum(u * qx) - 32 * sum(qx)  times its int8
// scale, both halves added as integers, so one float step per block remains: y += (d * dx) * that sum.
constexpr int64_t A8_Q4_LINES = 6, A8_Q8_LINES = 9, A8_Q4K_LINES = 38, A8_Q6K_LINES = 53, A8_Q4H_LINES = 5;
enum A8Kind : int { A8_Q4 = 0, A8_Q8 = 1, A8_Q4K = 2, A8_Q6K = 3, A8_Q4H = 4 };
constexpr bool a8_super(int A) { return A == A8_Q4K || A == A8_Q6K; }  // records of a 256-input super-block
constexpr int64_t a8_lines(int A) {
  return A == A8_Q4 ? A8_Q4_LINES : A == A8_Q8 ? A8_Q8_LINES : A == A8_Q4K ? A8_Q4K_LINES
       : A == A8_Q6K ? A8_Q6K_LINES : A8_Q4H_LINES;
}

// Block b (32 inputs) of one panel's int8-activation records: where its code lines start, and the record (and
// sub-block) whose scales it takes
template <int A>
struct A8Block {
  static constexpr bool Q4 = A == A8_Q4 || A == A8_Q4K || A == A8_Q4H;  // nibble codes and a minimum
  const uint8_t* rec;
  int sb;
  A8Block(const uint8_t* base, int64_t b)
      : rec(base + (a8_super(A) ? b / 8 : b) * a8_lines(A) * 64), sb(a8_super(A) ? int(b % 8) : 0) {}
  const uint8_t* codes() const {
    return rec + (A == A8_Q4K ? 384 + 256 * sb : A == A8_Q6K ? 320 + 384 * sb : A == A8_Q4 ? 128 : 64);
  }
  int64_t code_bytes() const { return A == A8_Q8 ? 512 : A == A8_Q6K ? 384 : 256; }
  // fetch this block ahead of its use (the kernels call it PREFETCH_RECORDS blocks ahead): its code lines and the
  // header lines it reads (Q6K: the super-block's 320-byte header once, with its first sub-block)
  void prefetch() const {
    if constexpr (A == A8_Q6K) {  // in asm: the builtin's calls here were deleted (few_rows.h)
      for (int64_t line = 0; line < code_bytes(); line += 64) prefetch_weights_kept(codes() + line);
      if (sb == 0)
        for (int64_t line = 0; line < 320; line += 64) prefetch_weights_kept(rec + line);
    } else {
      for (int64_t line = 0; line < code_bytes(); line += 64) prefetch_weights(codes() + line);
      prefetch_weights(rec), prefetch_weights(rec + 64);
    }
  }
  // row j's scale and minimum (scalar form; the vector kernels compute the same products lane by lane); Q6K:
  // the super-block's d, whose int8 sub-block scales multiply the integer sums instead
  float scale(int j) const {
    if constexpr (A == A8_Q4H) return half_bits_to_float(field<uint16_t>(2 * j));
    const float d = field<float>(4 * j);
    return A == A8_Q4K ? d * float(rec[128 + 16 * sb + j]) : d;
  }
  float minimum(int j) const {
    if constexpr (A == A8_Q4H) return half_bits_to_float(field<uint16_t>(32 + 2 * j));
    const float m = field<float>(64 + 4 * j);
    return A == A8_Q4K ? -(m * float(rec[256 + 16 * sb + j])) : m;
  }
  int sub_scale(int j, int h) const { return static_cast<int8_t>(rec[64 + 16 * (2 * sb + h) + j]); }  // Q6K
  template <typename T>
  T field(int64_t off) const {
    T v;
    __builtin_memcpy(&v, rec + off, sizeof(T));
    return v;
  }
};

// Q6K code u = q + 32 (0..63) of row j, input t of a sub-block's code lines
inline int a8_q6k_code(const uint8_t* codes, int j, int t) {
  const uint8_t pair = codes[64 * (t / 8) + 4 * j + t % 4];
  const int low = (t % 8) < 4 ? (pair & 15) : (pair >> 4);
  return low | (((codes[256 + 64 * (t / 16) + 4 * j + t % 4] >> (2 * ((t % 16) / 4))) & 3) << 4);
}

struct QuantizedRows {  // x [M, K] as int8 codes with per-32 scales
  RowBuffer<int8_t> q;
  RowBuffer<float> d, s;      // dx and dx * sum(qx) per (row, block)
  RowBuffer<int32_t> sum;     // sum(qx) per (row, block)
  RowBuffer<int32_t> half;    // sum(qx) per (row, block, half of 16 inputs)
};

// x [M, K] (float32, K a multiple of 32) rounded to int8 per row and block of 32 inputs (quantize_rows.cpp)
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K);
// amx_int8.cpp: whether AMX-INT8 tiles are usable here, and y = x @ W^T of a whole call on them (false, nothing
// written, where they are not): kind an A8Kind, wp the [panels, panel_bytes] records, y [M, N]
bool a8_amx_available();
bool a8_amx_linear(int kind, const QuantizedRows& xr, int64_t M, const uint8_t* wp, int64_t panels,
                   int64_t panel_bytes, float* y, int64_t K, int64_t N);

#if defined(__AVX512F__)
// Q6K: half h of a block's codes (inputs 16h .. 16h + 15) as four groups u = q + 32 of 4 inputs, u[i] holding
// inputs 16h + 4i .. 16h + 4i + 3 of the 16 outputs: each code's top 2 bits moved to bits 4-5 of its byte and
// joined to its low nibble (the VNNI kernels' and the AMX tiles' B rows)
static inline void a8_q6k_half(const uint8_t* codes, int h, __m512i* u) {
  const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30);
  const __m512i H = _mm512_loadu_si512(codes + 256 + 64 * h);
  const __m512i top[4] = {_mm512_and_si512(_mm512_slli_epi16(H, 4), top2),
                          _mm512_and_si512(_mm512_slli_epi16(H, 2), top2), _mm512_and_si512(H, top2),
                          _mm512_and_si512(_mm512_srli_epi16(H, 2), top2)};
  for (int gg = 0; gg < 2; ++gg) {
    const __m512i L = _mm512_loadu_si512(codes + 64 * (2 * h + gg));
    u[2 * gg] = _mm512_or_si512(_mm512_and_si512(L, low4), top[2 * gg]);
    u[2 * gg + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), low4), top[2 * gg + 1]);
  }
}

// the 16 rows' scale and minimum of one block, as A8Block's scalar forms compute them
template <int A>
static inline __m512 a8_scale(const A8Block<A>& blk) {
  if constexpr (A == A8_Q4H) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.rec)));
  const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk.rec));
  if constexpr (A != A8_Q4K) return d;
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 128 + 16 * blk.sb)))));
}
template <int A>
static inline __m512 a8_minimum(const A8Block<A>& blk) {
  if constexpr (A == A8_Q4H)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.rec + 32)));
  const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(blk.rec + 64));
  if constexpr (A != A8_Q4K) return m;
  const __m512 mq = _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 256 + 16 * blk.sb))));
  return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(m, mq));
}
#endif
