// y = x @ W^T with x rounded to int8 per 32 inputs (linear_kernel="packed-int8act"; see the section comment below).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "few_rows.h"
#include "ops.h"

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
