// The small per-layer operations of a decode step, for CPU float32. At one token per step each of these does a few
// thousand flops, and what torch charges per call (dispatch, allocation, OpenMP fork for RMSNorm's five ops) is
// 10-70 us; a step has ~60 norms and 30 attentions, which was ~40% of a batch-1 step once the projections read
// Q4 blocks (see kernels/small_gemm.cpp). Row results never depend on the other rows of the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "ops.h"

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

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
  a += b;
  v4f c, d;
  __builtin_memcpy(&c, &a, 16);
  __builtin_memcpy(&d, reinterpret_cast<const char*>(&a) + 16, 16);
  c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
#endif
}

// q . k over d floats in a fixed order (16 lanes, then the lanes summed): vectorised without -ffast-math
static inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  int64_t i = 0;
  float tail = 0.f;
  if (d >= 16) {
    v16f acc = v16f{};
    for (; i + 16 <= d; i += 16) {
      v16f x, y;
      __builtin_memcpy(&x, a + i, 64);
      __builtin_memcpy(&y, b + i, 64);
      acc += x * y;
    }
    tail = hsum(acc);
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

// out[0 .. 16C) = sum_j p[j] * V[slots[j]] (V rows at v + slots[j] * row), summed over j in order
template <int C>
static inline void weighted_rows(const float* p, const float* v, const int64_t* slots, int64_t n, int64_t row,
                                 float* out) {
  v16f acc[C];
  for (int c = 0; c < C; ++c) acc[c] = v16f{};
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + slots[j] * row;
    for (int c = 0; c < C; ++c) {
      v16f x;
      __builtin_memcpy(&x, vj + 16 * c, 64);
      acc[c] += x * p[j];
    }
  }
  for (int c = 0; c < C; ++c) __builtin_memcpy(out + 16 * c, &acc[c], 64);
}

typedef int32_t v16i __attribute__((vector_size(64)));

// e^x for 16 floats (Cephes' expf: range reduction by ln 2 in two parts, degree-6 polynomial; ~1 ulp), since
// scalar std::exp was most of a decode attention's time. Inputs here are scores minus their max (<= 0).
static inline v16f exp16(v16f x) {
  const v16f lo = v16f{} - 87.3f, hi = v16f{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  v16f t = x * 1.44269504088896341f + 0.5f;
  v16f fx = __builtin_convertvector(__builtin_convertvector(t, v16i), v16f);
  fx = fx + __builtin_convertvector(fx > t, v16f);  // truncation -> floor (the mask is -1 where fx > t)
  x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
  v16f y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x +
            1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  v16i e = (__builtin_convertvector(fx, v16i) + 127) << 23;
  return y * (v16f)e;
}

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                  w.is_contiguous(),
              "rms_norm: contiguous float32 tensors");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(w.numel() == d, "rms_norm: weight size");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * d;
      float* yr = yp + r * d;
      const float inv = float(1.0 / std::sqrt(double(dot(xr, xr, d)) / d + eps));
      for (int64_t i = 0; i < d; ++i) yr[i] = (xr[i] * inv) * wp[i];
    }
  };
  if (rows >= 64) at::parallel_for(0, rows, 16, body);  // a prefill chunk
  else body(0, rows);  // a decode step: threads would cost more than the work
  return y;
}

// out[0 .. D) = sum_j p[j] * V[slots[j]] for any head width: in registers for the common widths (no
// store-to-load chain through the output), axpy otherwise
static inline void weighted_sum(const float* p, const float* v, const int64_t* slots, int64_t n, int64_t row,
                                int64_t D, float* out) {
  switch (D) {
    case 32: weighted_rows<2>(p, v, slots, n, row, out); break;
    case 64: weighted_rows<4>(p, v, slots, n, row, out); break;
    case 128: weighted_rows<8>(p, v, slots, n, row, out); break;
    default:
      for (int64_t i = 0; i < D; ++i) out[i] = 0.f;
      for (int64_t j = 0; j < n; ++j) axpy(p[j], v + slots[j] * row, out, D);
  }
}

// weighted_rows<C> for NG query heads at once (probabilities p[g * np + j]; head g's sum to out + g * stride):
// each V row is loaded once for all heads and NG * C independent sums hide the FMA latency that bounds a single
// head's C sums. Every head's sums run in weighted_rows' order, so the results are the same bits.
template <int NG, int C>
static inline void weighted_rows_heads(const float* p, int64_t np, const float* v, const int64_t* slots, int64_t n,
                                       int64_t row, float* out, int64_t stride) {
  v16f acc[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = v16f{};
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + slots[j] * row;
    if (j + 16 < n)
      for (int c = 0; c < C; ++c) __builtin_prefetch(v + slots[j + 16] * row + 16 * c);
    v16f x[C];
    for (int c = 0; c < C; ++c) __builtin_memcpy(&x[c], vj + 16 * c, 64);
    for (int g = 0; g < NG; ++g) {
      const float pj = p[g * np + j];
      for (int c = 0; c < C; ++c) acc[g][c] += x[c] * pj;
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) __builtin_memcpy(out + g * stride + 16 * c, &acc[g][c], 64);
}

// the G query heads' weighted sums over one KV head's V rows (v already offset to the head), head g's to
// out + g * stride: all heads in one pass for the common shapes, weighted_sum per head otherwise (same bits)
static inline void weighted_sum_heads(const float* p, int64_t np, const float* v, const int64_t* slots, int64_t n,
                                      int64_t row, int64_t G, int64_t D, float* out, int64_t stride) {
  if (D == 64 && G == 3) {  // SmolLM2's shape (9 query heads on 3 KV heads)
    weighted_rows_heads<3, 4>(p, np, v, slots, n, row, out, stride);
  } else if (D == 64 && G == 2) {
    weighted_rows_heads<2, 4>(p, np, v, slots, n, row, out, stride);
  } else {
    for (int64_t g = 0; g < G; ++g) weighted_sum(p + g * np, v, slots, n, row, D, out + g * stride);
  }
}

// Scores sg[0 .. n) (padded to np, a multiple of 16) become e^(s - m) with m their max, stored in *m_out; the
// padding becomes 0. Returns their sum. One fixed order, whatever the caller.
static inline float exp_scores(float* sg, int64_t n, int64_t np, float* m_out) {
  // the max is exact in any order, so 16 lanes at a time (a serial chain of n compares was a visible cost)
  float m = sg[0];
  int64_t j = 0;
  if (n >= 16) {
    v16f mv;
    __builtin_memcpy(&mv, sg, 64);
    for (j = 16; j + 16 <= n; j += 16) {
      v16f x;
      __builtin_memcpy(&x, sg + j, 64);
      mv = mv > x ? mv : x;
    }
    for (int l = 0; l < 16; ++l) m = std::max(m, mv[l]);
  }
  for (; j < n; ++j) m = std::max(m, sg[j]);
  for (int64_t j = n; j < np; ++j) sg[j] = m;
  for (int64_t j = 0; j < np; j += 16) {
    v16f e;
    __builtin_memcpy(&e, sg + j, 64);
    e = exp16(e - m);
    __builtin_memcpy(sg + j, &e, 64);
  }
  for (int64_t j = n; j < np; ++j) sg[j] = 0.f;  // padding
  v16f acc = v16f{};
  for (int64_t j = 0; j < np; j += 16) {
    v16f e;
    __builtin_memcpy(&e, sg + j, 64);
    acc += e;
  }
  *m_out = m;
  return hsum(acc);
}

#if defined(__AVX512F__)
// the lane sums of four vectors as four floats, by one fixed tree (14 shuffles and adds for 4 sums, against ~8
// per sum for one vector at a time)
static inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  z = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));  // 128-bit quarter i holds vector i's partial sums
  z = _mm512_add_ps(z, _mm512_permute_ps(z, 0x4E));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                         0, 0, 0), z));
}

// scores sh[g * np + j] = scale * q_g . K[slots[j]] for the G query heads of one KV head (k at the head's
// offset, rows `row` floats apart), D = 16 NG: four keys at a time, each key's lines fetched 16 keys ahead
template <int NG, int G>
static void score_rows(const float* q, const float* k, const int64_t* slots, int64_t n, int64_t row, float scale,
                       float* sh, int64_t np) {
  constexpr int64_t D = 16 * NG;
  __m512 qv[G][NG];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NG; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  auto score = [&](const float* kj, int g) {
    __m512 a = _mm512_mul_ps(qv[g][0], _mm512_loadu_ps(kj));
    for (int c = 1; c < NG; ++c) a = _mm512_fmadd_ps(qv[g][c], _mm512_loadu_ps(kj + 16 * c), a);
    return a;
  };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 acc[G][4];
    for (int u = 0; u < 4; ++u) {
      if (j + u + 16 < n)
        for (int c = 0; c < NG; ++c) __builtin_prefetch(k + slots[j + u + 16] * row + 16 * c);
      const float* kj = k + slots[j + u] * row;
      for (int g = 0; g < G; ++g) acc[g][u] = score(kj, g);
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(sh + g * np + j, _mm_mul_ps(hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
  }
  for (; j < n; ++j)
    for (int g = 0; g < G; ++g) sh[g * np + j] = _mm512_reduce_add_ps(score(k + slots[j] * row, g)) * scale;
}

// the instantiation Pick<NG, G>::fn of a kernel for head width D = 16 NG and G query heads per KV head, for the
// shapes instantiated here (D 64 with G 1-4, D 128 with G 1-2), or nullptr (then: the callers' general loops)
template <template <int, int> class Pick>
static auto for_shape(int64_t D, int64_t G) -> decltype(Pick<4, 1>::fn) {
  if (D == 64) {
    switch (G) {
      case 1: return Pick<4, 1>::fn;
      case 2: return Pick<4, 2>::fn;
      case 3: return Pick<4, 3>::fn;
      case 4: return Pick<4, 4>::fn;
    }
  } else if (D == 128) {
    switch (G) {
      case 1: return Pick<8, 1>::fn;
      case 2: return Pick<8, 2>::fn;
    }
  }
  return nullptr;
}

template <int NG, int G>
struct ScorePick {
  static constexpr auto fn = score_rows<NG, G>;
};
typedef void (*ScoreFn)(const float*, const float*, const int64_t*, int64_t, int64_t, float, float*, int64_t);
static ScoreFn score_rows_for(int64_t D, int64_t G) { return for_shape<ScorePick>(D, G); }
#else
typedef void (*ScoreFn)(const float*, const float*, const int64_t*, int64_t, int64_t, float, float*, int64_t);
static ScoreFn score_rows_for(int64_t, int64_t) { return nullptr; }
#endif

// sh[g * np + j] = scale * q_g . K[slots[j]] for the G query heads q [G, D] of one KV head (k at that head's
// offset, rows `row` floats apart): score_rows for the common shapes, one dot product per key and head otherwise
static void score_keys(const float* q, const float* k, const int64_t* slots, int64_t n, int64_t row, int64_t G,
                       int64_t D, float scale, float* sh, int64_t np) {
  if (const ScoreFn fn = score_rows_for(D, G)) {
    fn(q, k, slots, n, row, scale, sh, np);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + slots[j] * row;
    if (j + 8 < n) __builtin_prefetch(k + slots[j + 8] * row);
    for (int64_t g = 0; g < G; ++g) sh[g * np + j] = dot(q + g * D, kj, D) * scale;
  }
}

// Attention for query rows that each see an explicit list of cache slots (decode tokens, drafts, tree nodes), in
// place over the paged cache. q: [T, H, D]; k_cache, v_cache: [num_slots, Hkv, D]; row t = rows[r] attends to
// slots[spans[r, 0] .. spans[r, 1]) (in position order) and its [H, D] result is written to out[t].
// Each (row, KV head) is computed alone, in one fixed order, so a token's result depends only on its own query
// and visible K/V: the same whether it is decoded alone, batched, or verified among drafts or tree candidates.
// Softmax in float32 with the max subtracted.
static void attend(const float* q, const float* kp, const float* vp, const int64_t* slots, int64_t n, int64_t h,
                   int64_t G, int64_t D, int64_t row, float scale, float* o, std::vector<float>& buf) {
  const int64_t np = (n + 15) / 16 * 16;  // scores padded to whole vectors
  if (int64_t(buf.size()) < G * np) buf.resize(G * np);
  float* sh = buf.data();
  score_keys(q + h * G * D, kp + h * D, slots, n, row, G, D, scale, sh, np);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = sh + g * np;
    float m;
    const float inv = 1.f / exp_scores(sg, n, np, &m);
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  weighted_sum_heads(sh, np, vp + h * D, slots, n, row, G, D, o + h * G * D, D);
}

// A row that sees more than kLongRow positions is attended in kLongRow-slot chunks by separate tasks, each keeping
// its own max m_c, exp-sum s_c and unnormalised sum o_c = sum_j e^(score_j - m_c) v_j, merged in chunk order
// (FlashDecoding's log-sum-exp reduction): one (row, KV head) task would read the whole context on one core, and a
// single core cannot stream it at the memory's rate (6k context: 1.6 ms per layer vs 0.7 ms for torch's SDPA).
// The split depends only on the row's own length, so a token's result still does not depend on the batch.
constexpr int64_t kLongRow = 1024;

// q: the G query heads of one KV head [G, D]; k, v: that KV head's rows at k + slots[j] * row (so a float cache
// passes kp + h * D with row = Hkv * D, and a dequantised int8 chunk its own [n, D] scratch with row = D)
static void attend_chunk(const float* q, const float* k, const float* v, const int64_t* slots, int64_t n, int64_t G,
                         int64_t D, int64_t row, float scale, float* part, std::vector<float>& buf) {
  // part: G records of [m, s, o[0..D)]
  const int64_t np = (n + 15) / 16 * 16;
  if (int64_t(buf.size()) < G * np) buf.resize(G * np);
  float* sh = buf.data();
  score_keys(q, k, slots, n, row, G, D, scale, sh, np);
  for (int64_t g = 0; g < G; ++g) {
    float* rec = part + g * (D + 2);
    rec[1] = exp_scores(sh + g * np, n, np, &rec[0]);
  }
  weighted_sum_heads(sh, np, v, slots, n, row, G, D, part + 2, D + 2);
}

// out[t] for every row whose partial results sit in parts (G records of [m, s, o] per (row, KV head, chunk), at
// parts[(first_part[r] + h * chunks + c) * G * (D + 2)]): out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c,
// chunks in order. Rows with no parts (first_part[r] == first_part[r + 1]) are left alone.
static void merge_chunks(const std::vector<float>& parts, const std::vector<int64_t>& first_part, const int64_t* rp,
                         int64_t R, int64_t Hkv, int64_t G, int64_t D, float* outp) {
  const int64_t H = Hkv * G, stride = G * (D + 2);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t chunks = (first_part[r + 1] - first_part[r]) / Hkv, t = rp[r];
    if (chunks == 0) continue;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const float* first = parts.data() + (first_part[r] + h * chunks) * stride + g * (D + 2);
        float m = first[0];
        for (int64_t c = 1; c < chunks; ++c) m = std::max(m, first[c * stride]);
        float* og = outp + t * H * D + (h * G + g) * D;
        for (int64_t i = 0; i < D; ++i) og[i] = 0.f;
        float total = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {
          const float* rec = first + c * stride;
          const float w = std::exp(rec[0] - m);
          total += w * rec[1];
          axpy(w, rec + 2, og, D);
        }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < D; ++i) og[i] *= inv;
      }
  }
}

// The tasks of one attention call. A row over more than kLongRow positions (or every row, with chunk_all) is
// split into kLongRow-slot chunks, one task per (row, KV head, chunk), whose partial results go to
// parts[(first_part[r] + h * chunks(r) + c) * G * (D + 2)]; other rows are one task per (row, KV head), chunk -1.
struct RowTasks {
  std::vector<int64_t> first_part, row, head, chunk;
};

static inline int64_t num_chunks(int64_t n, bool chunk_all) {
  return n > kLongRow || chunk_all ? (n + kLongRow - 1) / kLongRow : 0;
}

static RowTasks plan_row_tasks(const int64_t* span, int64_t R, int64_t Hkv, bool chunk_all) {
  RowTasks t;
  t.first_part.assign(R + 1, 0);
  // chunk-major: the KV heads of one chunk are neighbouring tasks, so a thread usually takes all of them in a row
  // and the 2nd and 3rd head find the chunk's cache lines (rows hold every head: [slot, Hkv, D]) still in L2
  for (int64_t r = 0; r < R; ++r) {
    const int64_t chunks = num_chunks(span[2 * r + 1] - span[2 * r], chunk_all);
    t.first_part[r + 1] = t.first_part[r] + Hkv * chunks;
    for (int64_t c = chunks ? 0 : -1; c < chunks; ++c)
      for (int64_t h = 0; h < Hkv; ++h) {
        t.row.push_back(r);
        t.head.push_back(h);
        t.chunk.push_back(c);
      }
  }
  return t;
}

// rows [R], spans [R, 2], slots: int64, contiguous; row r sees slots[spans[r, 0] .. spans[r, 1]) (spans may overlap:
// a prompt's causal rows share one slot list, each a longer prefix of it). Every row in [0, T) with at least one
// slot, every slot in [0, num_slots) -- checked once per call, so the kernels can index without bounds checks.
// Returns the total number of (row, slot) pairs.
static int64_t check_rows(const torch::Tensor& rows, const torch::Tensor& spans, const torch::Tensor& slots, int64_t T,
                          int64_t num_slots, const char* what) {
  TORCH_CHECK(rows.scalar_type() == torch::kLong && spans.scalar_type() == torch::kLong &&
                  slots.scalar_type() == torch::kLong && rows.is_contiguous() && spans.is_contiguous() &&
                  slots.is_contiguous() && spans.dim() == 2 && spans.size(1) == 2 && spans.size(0) == rows.numel(),
              what, ": int64 rows [R], spans [R, 2], slots");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* span = spans.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  int64_t pairs = 0;
  for (int64_t r = 0; r < rows.numel(); ++r) {
    TORCH_CHECK(rp[r] >= 0 && rp[r] < T && span[2 * r] >= 0 && span[2 * r] < span[2 * r + 1] &&
                    span[2 * r + 1] <= slots.numel(),
                what, ": row ", r, " is out of range or sees no position");
    pairs += span[2 * r + 1] - span[2 * r];
  }
  for (int64_t i = 0; i < slots.numel(); ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, what, ": slot out of range");
  return pairs;
}

void attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor rows,
                    torch::Tensor spans, torch::Tensor slots, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32, "attention_rows: q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat32,
              "attention_rows: out");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "attention_rows: contiguous float32 caches [slots, Hkv, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), G = H / Hkv;
  const int64_t R = rows.numel(), num_slots = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "attention_rows: head shapes");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* span = spans.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t pairs = check_rows(rows, spans, slots, T, num_slots, "attention_rows");
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const RowTasks tasks = plan_row_tasks(span, R, Hkv, false);
  std::vector<float> parts(tasks.first_part[R] * G * (D + 2));
  const int64_t num_tasks = int64_t(tasks.row.size());
  const int64_t work = pairs * H;  // score count: one thread unless waking a second one pays
  at::parallel_for(0, num_tasks, work >= 16384 ? 1 : num_tasks, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = tasks.row[task], h = tasks.head[task], c = tasks.chunk[task], t = rp[r];
      const int64_t n = span[2 * r + 1] - span[2 * r];
      if (c < 0) {
        attend(qp + t * H * D, kp, vp, sp + span[2 * r], n, h, G, D, Hkv * D, float(scale), outp + t * H * D, buf);
      } else {
        const int64_t j0 = c * kLongRow;
        float* part = parts.data() + (tasks.first_part[r] + h * num_chunks(n, false) + c) * G * (D + 2);
        attend_chunk(qp + t * H * D + h * G * D, kp + h * D, vp + h * D, sp + span[2 * r] + j0, std::min(kLongRow, n - j0),
                     G, D, Hkv * D, float(scale), part, buf);
      }
    }
  });
  merge_chunks(parts, tasks.first_part, rp, R, Hkv, G, D, outp);  // long rows only
}

// ---------------------------------------------------------------------------------------------- int8 KV cache
// The cache of layers/kv_quant.py: rows int8 [slots, Hkv, D], one float16 scale per 16 channels [slots, Hkv, D/16],
// in a rotated (keys: shifted and smoothed) basis that the caller maps queries into and outputs out of. Attention
// reads each chunk of a row's slots as int8 and rebuilds the rows in registers (attend_chunk_i8; other head shapes
// dequantise the chunk into an L2-resident scratch and run the float chunk routine): the long context is read from
// memory as int8 (~3.6x fewer bytes than float32), every row goes through chunks + merge (one chunk for short
// rows), and nothing depends on the other rows of the call.

static inline void half4_to_float(const at::Half* h, int64_t n, float* out) {
#if defined(__F16C__)
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128 f = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + i)));
    _mm_storeu_ps(out + i, f);
  }
  for (; i < n; ++i) out[i] = _cvtsh_ss(h[i].x);
#else
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(h[i]);
#endif
}

// 16 int8 values times s into out[0 .. 16)
static inline void dequant16(const int8_t* q, float s, float* out) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  _mm512_storeu_ps(out, _mm512_mul_ps(f, _mm512_set1_ps(s)));
#elif defined(__AVX2__)
  const __m256 sv = _mm256_set1_ps(s);
  for (int half = 0; half < 2; ++half) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * half));
    _mm256_storeu_ps(out + 8 * half, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sv));
  }
#else
  for (int i = 0; i < 16; ++i) out[i] = float(q[i]) * s;
#endif
}

// rows slots[0 .. n) of KV head h, dequantised into out [n, D]
static void dequant_rows(const int8_t* data, const at::Half* scale, const int64_t* slots, int64_t n, int64_t Hkv,
                         int64_t h, int64_t D, float* out) {
  const int64_t NG = D / 16;
  float sc[16];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t base = slots[j] * Hkv + h;
    if (j + 4 < n) __builtin_prefetch(data + (slots[j + 4] * Hkv + h) * D);
    half4_to_float(scale + base * NG, NG, sc);
    for (int64_t c = 0; c < NG; ++c) dequant16(data + base * D + 16 * c, sc[c], out + j * D + 16 * c);
  }
}

static void check_int8_plane(const torch::Tensor& data, const torch::Tensor& scale, const char* what) {
  TORCH_CHECK(data.dim() == 3 && data.scalar_type() == torch::kChar && data.is_contiguous() && data.size(2) % 16 == 0,
              what, ": int8 data must be contiguous [slots, Hkv, D] with D a multiple of 16");
  TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == torch::kHalf && scale.is_contiguous() &&
                  scale.size(0) == data.size(0) && scale.size(1) == data.size(1) && scale.size(2) * 16 == data.size(2),
              what, ": scales must be contiguous float16 [slots, Hkv, D/16]");
}

#if defined(__AVX512F__)
constexpr int64_t kAhead = 32;  // rows prefetched ahead: ~15 cycles per row against ~300 for a line from DRAM

// one int8 row (NG groups of 16 channels, one float16 scale each) as NG float vectors
template <int NG>
static inline void load_row_i8(const int8_t* codes, const at::Half* scales, __m512* out) {
  float sc[NG];
  if (NG == 4) {
    _mm_storeu_ps(sc, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales))));
  } else {
    for (int c = 0; c < NG; ++c) sc[c] = _cvtsh_ss(scales[c].x);
  }
  for (int c = 0; c < NG; ++c)
    out[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c)))),
                           _mm512_set1_ps(sc[c]));
}

// attend_chunk straight from the int8 cache (no dequantised scratch): G query heads q [G, D] of KV head h over
// the rows slots[0 .. n), D = 16 NG. Scores four keys at a time (hsum4), then the same exp_scores, then each V row
// rebuilt once in registers for all G heads. part: G records [m, s, o[0 .. D)], as attend_chunk's.
template <int NG, int G>
static void attend_chunk_i8(const float* q, const int8_t* kd, const at::Half* ks, const int8_t* vd,
                            const at::Half* vs, const int64_t* slots, int64_t n, int64_t Hkv, int64_t h,
                            float scale, float* part, std::vector<float>& buf) {
  constexpr int64_t D = 16 * NG;
  const int64_t np = (n + 15) / 16 * 16;
  if (int64_t(buf.size()) < G * np) buf.resize(G * np);
  float* sh = buf.data();
  __m512 qv[G][NG];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NG; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  auto row_of = [&](int64_t j) { return slots[j] * Hkv + h; };
  auto score = [&](const __m512* kf, int g) {  // q_g . k, as 16 lane sums
    __m512 a = _mm512_mul_ps(qv[g][0], kf[0]);
    for (int c = 1; c < NG; ++c) a = _mm512_fmadd_ps(qv[g][c], kf[c], a);
    return a;
  };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 acc[G][4];
    for (int u = 0; u < 4; ++u) {
      if (j + u + kAhead < n) {
        __builtin_prefetch(kd + row_of(j + u + kAhead) * D);
        __builtin_prefetch(ks + row_of(j + u + kAhead) * NG);
      }
      __m512 kf[NG];
      load_row_i8<NG>(kd + row_of(j + u) * D, ks + row_of(j + u) * NG, kf);
      for (int g = 0; g < G; ++g) acc[g][u] = score(kf, g);
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(sh + g * np + j, _mm_mul_ps(hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
  }
  for (; j < n; ++j) {  // the last n % 4 keys: the same products, summed lane by lane
    __m512 kf[NG];
    load_row_i8<NG>(kd + row_of(j) * D, ks + row_of(j) * NG, kf);
    for (int g = 0; g < G; ++g) sh[g * np + j] = _mm512_reduce_add_ps(score(kf, g)) * scale;
  }
  for (int g = 0; g < G; ++g) {
    float* rec = part + g * (D + 2);
    rec[1] = exp_scores(sh + g * np, n, np, &rec[0]);
  }
  __m512 o[G][NG];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NG; ++c) o[g][c] = _mm512_setzero_ps();
  for (j = 0; j < n; ++j) {
    if (j + kAhead < n) {
      __builtin_prefetch(vd + row_of(j + kAhead) * D);
      __builtin_prefetch(vs + row_of(j + kAhead) * NG);
    }
    __m512 vf[NG];
    load_row_i8<NG>(vd + row_of(j) * D, vs + row_of(j) * NG, vf);
    for (int g = 0; g < G; ++g) {
      const __m512 pj = _mm512_set1_ps(sh[g * np + j]);
      for (int c = 0; c < NG; ++c) o[g][c] = _mm512_fmadd_ps(vf[c], pj, o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NG; ++c) _mm512_storeu_ps(part + g * (D + 2) + 2 + 16 * c, o[g][c]);
}

// the fused chunk routine for this shape, or nullptr (then: dequantise into a scratch and attend_chunk)
template <int NG, int G>
struct ChunkI8Pick {
  static constexpr auto fn = attend_chunk_i8<NG, G>;
};
typedef void (*ChunkI8Fn)(const float*, const int8_t*, const at::Half*, const int8_t*, const at::Half*,
                          const int64_t*, int64_t, int64_t, int64_t, float, float*, std::vector<float>&);
static ChunkI8Fn chunk_i8_for(int64_t D, int64_t G) { return for_shape<ChunkI8Pick>(D, G); }
#else
typedef void (*ChunkI8Fn)(const float*, const int8_t*, const at::Half*, const int8_t*, const at::Half*,
                          const int64_t*, int64_t, int64_t, int64_t, float, float*, std::vector<float>&);
static ChunkI8Fn chunk_i8_for(int64_t, int64_t) { return nullptr; }
#endif

void attention_rows_i8(torch::Tensor q, torch::Tensor k_data, torch::Tensor k_scale, torch::Tensor v_data,
                       torch::Tensor v_scale, torch::Tensor rows, torch::Tensor spans, torch::Tensor slots,
                       double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32, "attention_rows_i8: q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat32,
              "attention_rows_i8: out");
  check_int8_plane(k_data, k_scale, "attention_rows_i8: keys");
  check_int8_plane(v_data, v_scale, "attention_rows_i8: values");
  TORCH_CHECK(v_data.sizes() == k_data.sizes(), "attention_rows_i8: K and V planes differ in shape");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_data.size(1), G = H / Hkv;
  TORCH_CHECK(k_data.size(2) == D && H % Hkv == 0, "attention_rows_i8: head shapes");
  const int64_t R = rows.numel(), num_slots = k_data.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* span = spans.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t pairs = check_rows(rows, spans, slots, T, num_slots, "attention_rows_i8");
  const RowTasks tasks = plan_row_tasks(span, R, Hkv, true);
  std::vector<float> parts(tasks.first_part[R] * G * (D + 2));
  std::vector<int64_t> identity(std::min(kLongRow, pairs + 1));
  std::iota(identity.begin(), identity.end(), 0);
  const float* qp = q.data_ptr<float>();
  const int8_t* kd = k_data.data_ptr<int8_t>();
  const int8_t* vd = v_data.data_ptr<int8_t>();
  const at::Half* ks = k_scale.data_ptr<at::Half>();
  const at::Half* vs = v_scale.data_ptr<at::Half>();
  const int64_t num_tasks = int64_t(tasks.row.size()), work = pairs * H;
  const ChunkI8Fn fused = chunk_i8_for(D, G);  // the common shapes read the int8 rows in registers
  at::parallel_for(0, num_tasks, work >= 16384 ? 1 : num_tasks, [&](int64_t begin, int64_t end) {
    std::vector<float> buf, kbuf, vbuf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = tasks.row[task], h = tasks.head[task], c = tasks.chunk[task], t = rp[r];
      const int64_t n = span[2 * r + 1] - span[2 * r], chunks = num_chunks(n, true), j0 = c * kLongRow;
      const int64_t m = std::min(kLongRow, n - j0);
      float* part = parts.data() + (tasks.first_part[r] + h * chunks + c) * G * (D + 2);
      if (fused != nullptr) {
        fused(qp + t * H * D + h * G * D, kd, ks, vd, vs, sp + span[2 * r] + j0, m, Hkv, h, float(scale), part, buf);
        continue;
      }
      if (int64_t(kbuf.size()) < m * D) {
        kbuf.resize(m * D);
        vbuf.resize(m * D);
      }
      dequant_rows(kd, ks, sp + span[2 * r] + j0, m, Hkv, h, D, kbuf.data());
      dequant_rows(vd, vs, sp + span[2 * r] + j0, m, Hkv, h, D, vbuf.data());
      attend_chunk(qp + t * H * D + h * G * D, kbuf.data(), vbuf.data(), identity.data(), m, G, D, D, float(scale),
                   part, buf);
    }
  });
  merge_chunks(parts, tasks.first_part, rp, R, Hkv, G, D, out.data_ptr<float>());
}

// z[0 .. D) = y @ R (R row-major [D, D]): rows of R weighted by y and summed in i order; the int8 KV write and
// rotate_rows share it, so keys and queries change basis with the same rounding
static inline void row_times(const float* y, const float* R, float* z, int64_t D) {
  for (int64_t e = 0; e < D; ++e) z[e] = 0.f;
  for (int64_t i = 0; i < D; ++i) axpy(y[i], R + i * D, z, D);
}

// Quantize-on-write of kv_quant.QuantizedKV in one call: row x[t, h] becomes y = ((x - shift[h]) / smooth[h]) @ R,
// then per 16 channels scale = float16(absmax / 127), q = round-half-even(y / scale) in [-127, 127], stored at
// slots[t]. shift / smooth / rotation may be empty (identity).
void quantize_kv_rows(torch::Tensor x, torch::Tensor shift, torch::Tensor smooth, torch::Tensor rotation,
                      torch::Tensor slots, torch::Tensor data, torch::Tensor scale) {
  check_int8_plane(data, scale, "quantize_kv_rows");
  const int64_t T = x.size(0), Hkv = data.size(1), D = data.size(2), NG = D / 16;
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == torch::kFloat32 && x.size(1) == Hkv &&
                  x.size(2) == D, "quantize_kv_rows: x must be contiguous float32 [T, Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T,
              "quantize_kv_rows: int64 slots [T]");
  for (const auto* t : {&shift, &smooth})
    TORCH_CHECK(t->numel() == 0 || (t->is_contiguous() && t->scalar_type() == torch::kFloat32 && t->numel() == Hkv * D),
                "quantize_kv_rows: shift / smooth must be empty or contiguous float32 [Hkv, D]");
  TORCH_CHECK(rotation.numel() == 0 || (rotation.is_contiguous() && rotation.scalar_type() == torch::kFloat32 &&
                                        rotation.numel() == D * D), "quantize_kv_rows: rotation must be [D, D]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < data.size(0), "quantize_kv_rows: slot out of range");
  const float* xp = x.data_ptr<float>();
  const float* mu = shift.numel() ? shift.data_ptr<float>() : nullptr;
  const float* sm = smooth.numel() ? smooth.data_ptr<float>() : nullptr;
  const float* rot = rotation.numel() ? rotation.data_ptr<float>() : nullptr;
  int8_t* dp = data.data_ptr<int8_t>();
  at::Half* scp = scale.data_ptr<at::Half>();
  std::vector<float> y(D), z(D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* xr = xp + (t * Hkv + h) * D;
      for (int64_t i = 0; i < D; ++i) {
        float v = xr[i];
        if (mu) v -= mu[h * D + i];
        if (sm) v /= sm[h * D + i];
        y[i] = v;
      }
      if (rot) {
        row_times(y.data(), rot, z.data(), D);
      } else {
        z = y;
      }
      const int64_t base = sp[t] * Hkv + h;
      for (int64_t c = 0; c < NG; ++c) {
        float amax = 0.f;
        for (int64_t i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(z[16 * c + i]));
        const at::Half sh = at::Half(std::min(amax / 127.f, 65504.f));
        scp[base * NG + c] = sh;
        const float sf = std::max(static_cast<float>(sh), 1e-12f);
        for (int64_t i = 0; i < 16; ++i) {
          const float qv = std::nearbyint(z[16 * c + i] / sf);
          dp[base * D + 16 * c + i] = int8_t(std::max(-127.f, std::min(127.f, qv)));
        }
      }
    }
}

// RoPE in place: each of the first num_heads heads (d wide) of every row of qkv [T, W] becomes
// x * cos + roll(x, d/2) * sin_signed, with cos / sin_signed [T, d] (the sign of the rotate-half folded into sin).
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32, "rope_: qkv");
  const int64_t T = qkv.size(0), W = qkv.size(1), d = cos.size(-1), half = d / 2;
  TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() && cos.numel() == T * d &&
                  sin_signed.numel() == T * d && num_heads * d <= W && d % 2 == 0,
              "rope_: tables must be contiguous [T, d]");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  std::vector<float> tmp(d);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < num_heads; ++h) {
      float* x = xp + t * W + h * d;
      const float* c = cp + t * d;
      const float* s = sp + t * d;
      for (int64_t i = 0; i < d; ++i) tmp[i] = x[i];
      for (int64_t i = 0; i < d; ++i) x[i] = tmp[i] * c[i] + tmp[i < half ? i + half : i - half] * s[i];
    }
}

// silu(gate) * up for gate_up [T, 2I] -> [T, I]; silu(g) = g / (1 + e^-g)
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == torch::kFloat32 &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: contiguous float32 [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gp + t * 2 * I;
    const float* u = g + I;
    float* o = op + t * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
      v16f gv, uv;
      __builtin_memcpy(&gv, g + i, 64);
      __builtin_memcpy(&uv, u + i, 64);
      v16f r = gv / (1.0f + exp16(v16f{} - gv)) * uv;
      __builtin_memcpy(o + i, &r, 64);
    }
    for (; i < I; ++i) {  // same formula lane by lane (exp16 on a broadcast) so no row depends on its width
      v16f e = exp16(v16f{} - g[i]);
      o[i] = g[i] / (1.0f + e[0]) * u[i];
    }
  }
  return out;
}


// A whole decoder layer for a step whose rows are all few-token rows (decode, drafts, trees): the same kernels
// the per-op path calls (so results are bitwise equal to it), minus ~10 Python-level calls per layer.
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
  auto h = x + packed_linear(attn, w[2]);
  return h + packed_linear(silu_mul(packed_linear(rms_norm(h, w[3], eps), w[4])), w[5]);
}

torch::Tensor decoder_layer(torch::Tensor x, std::vector<torch::Tensor> w, std::optional<torch::Tensor> qkv_bias,
                            torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slot_mapping, torch::Tensor rows, torch::Tensor spans, torch::Tensor slots,
                            int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  TORCH_CHECK(w.size() == 6, "decoder_layer: 6 weights");
  const int64_t T = x.size(0), d = k_cache.size(2);
  auto qkv = layer_qkv(x, w, qkv_bias, cos, sin_signed, num_heads + num_kv_heads, eps);
  auto q = qkv.narrow(1, 0, num_heads * d).contiguous().view({T, num_heads, d});
  k_cache.index_copy_(0, slot_mapping, qkv.narrow(1, num_heads * d, num_kv_heads * d).view({T, num_kv_heads, d}));
  v_cache.index_copy_(0, slot_mapping,
                      qkv.narrow(1, (num_heads + num_kv_heads) * d, num_kv_heads * d).view({T, num_kv_heads, d}));
  auto o = torch::empty_like(q);
  attention_rows(q, k_cache, v_cache, rows, spans, slots, scale, o);
  return layer_out(x, o.view({T, num_heads * d}), w, eps);
}

// Rows x [T, H, D] into / out of an int8 plane's basis in one call: y = (x * s) @ R, or y = x @ R^T with
// `transpose` (s: [Hkv, D] per KV head, the H = Hkv * G query heads sharing it in groups; empty = 1; R: [D, D],
// empty = identity). Each row sums over i = 0 .. D-1 in order, so a row's result does not depend on the others;
// kv_quant.QuantizedKV's query_to_cache_basis / unrotate and decoder_layer_i8 all go through it (one rounding).
torch::Tensor rotate_rows(torch::Tensor x, torch::Tensor smooth, torch::Tensor rot, bool transpose) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32, "rotate_rows: x must be float32 [T, H, D]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(smooth.numel() == 0 || (smooth.scalar_type() == torch::kFloat32 && smooth.dim() == 2 &&
                                      smooth.size(1) == D && H % smooth.size(0) == 0),
              "rotate_rows: smooth must be empty or float32 [Hkv, D]");
  TORCH_CHECK(rot.numel() == 0 || (rot.scalar_type() == torch::kFloat32 && rot.dim() == 2 && rot.size(0) == D &&
                                   rot.size(1) == D), "rotate_rows: rotation must be empty or float32 [D, D]");
  auto xc = x.contiguous();
  if (rot.numel() == 0 && smooth.numel() == 0) return xc;
  auto y = torch::empty({T, H, D}, x.options());
  const auto r = rot.numel() ? (transpose ? rot.t().contiguous() : rot.contiguous()) : rot;
  const auto sm = smooth.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* rp = r.numel() ? r.data_ptr<float>() : nullptr;
  const float* sp = sm.numel() ? sm.data_ptr<float>() : nullptr;
  const int64_t G = sm.numel() ? H / sm.size(0) : 1;
  float* yp = y.data_ptr<float>();
  std::vector<float> xs(D);
  for (int64_t row = 0; row < T * H; ++row) {
    const float* xr = xp + row * D;
    const float* s = sp ? sp + ((row % H) / G) * D : nullptr;
    for (int64_t i = 0; i < D; ++i) xs[i] = s ? xr[i] * s[i] : xr[i];
    float* yr = yp + row * D;
    if (rp) {
      row_times(xs.data(), rp, yr, D);
    } else {
      for (int64_t j = 0; j < D; ++j) yr[j] = xs[j];
    }
  }
  return y;
}

// decoder_layer over an int8 KV cache (layers/kv_quant.py QuantizedKV planes): the same steps as the per-op path
// of models/llama.py with attention.paged_attention on int8 planes -- queries into the cache's basis ((q s) @ R),
// keys and values quantized on write, the int8 rows kernel, outputs back out of the value basis (@ R^T) -- with
// the same C++ routines (rotate_rows, quantize_kv_rows, attention_rows_i8), so both paths give the same bits.
// planes: k_data, k_scale, v_data, v_scale; transform: k_shift, k_smooth, k_rotation, v_rotation (each may be
// empty = identity).
torch::Tensor decoder_layer_i8(torch::Tensor x, std::vector<torch::Tensor> w, std::optional<torch::Tensor> qkv_bias,
                               torch::Tensor cos, torch::Tensor sin_signed, std::vector<torch::Tensor> planes,
                               std::vector<torch::Tensor> transform, torch::Tensor slot_mapping, torch::Tensor rows,
                               torch::Tensor spans, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads,
                               double eps, double scale) {
  TORCH_CHECK(w.size() == 6 && planes.size() == 4 && transform.size() == 4,
              "decoder_layer_i8: 6 weights, 4 planes, 4 transforms");
  const torch::Tensor &k_shift = transform[0], &k_smooth = transform[1], &k_rot = transform[2],
                      &v_rot = transform[3];
  const int64_t T = x.size(0), d = planes[0].size(2);
  auto qkv = layer_qkv(x, w, qkv_bias, cos, sin_signed, num_heads + num_kv_heads, eps);
  const auto q = rotate_rows(qkv.narrow(1, 0, num_heads * d).view({T, num_heads, d}), k_smooth, k_rot, false);
  auto k = qkv.narrow(1, num_heads * d, num_kv_heads * d).contiguous().view({T, num_kv_heads, d});
  auto v = qkv.narrow(1, (num_heads + num_kv_heads) * d, num_kv_heads * d).contiguous().view({T, num_kv_heads, d});
  const auto empty = x.new_empty({0});
  quantize_kv_rows(k, k_shift, k_smooth, k_rot, slot_mapping, planes[0], planes[1]);
  quantize_kv_rows(v, empty, empty, v_rot, slot_mapping, planes[2], planes[3]);
  auto o = torch::empty_like(q);
  attention_rows_i8(q.contiguous(), planes[0], planes[1], planes[2], planes[3], rows, spans, slots, scale, o);
  return layer_out(x, rotate_rows(o, empty, v_rot, true).view({T, num_heads * d}), w, eps);
}

// A run of decoder layers for one step in one call: decoder_layer (float32 cache) or decoder_layer_i8 (int8
// cache) per layer, in order -- the same routines, so bitwise the per-layer result -- without a Python-level call
// per layer (~30 of them per decode step, ~10% of a 12 ms step on a 2-core CPU). The caller builds the flat
// argument lists once (models/llama.py LlamaForCausalLM._layer_stack). Per layer: 6 weights (as decoder_layer),
// 1 bias (empty = none), 2 caches (K, V float32) or 4 (int8 planes k_data, k_scale, v_data, v_scale), and with
// int8 planes 4 transforms (k_shift, k_smooth, k_rotation, v_rotation).
torch::Tensor decoder_stack(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> biases,
                            torch::Tensor cos, torch::Tensor sin_signed, std::vector<torch::Tensor> caches,
                            std::vector<torch::Tensor> transforms, torch::Tensor slot_mapping, torch::Tensor rows,
                            torch::Tensor spans, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads,
                            double eps, double scale) {
  const size_t n = biases.size();
  const bool int8 = !transforms.empty();
  TORCH_CHECK(weights.size() == 6 * n && caches.size() == (int8 ? 4 : 2) * n && (!int8 || transforms.size() == 4 * n),
              "decoder_stack: per layer 6 weights, 1 bias, 2 float32 caches or 4 int8 planes + 4 transforms");
  for (size_t i = 0; i < n; ++i) {
    std::vector<torch::Tensor> w(weights.begin() + 6 * i, weights.begin() + 6 * (i + 1));
    const auto bias = biases[i].numel() ? std::optional<torch::Tensor>(biases[i]) : std::nullopt;
    if (int8) {
      x = decoder_layer_i8(x, w, bias, cos, sin_signed, {caches.begin() + 4 * i, caches.begin() + 4 * (i + 1)},
                           {transforms.begin() + 4 * i, transforms.begin() + 4 * (i + 1)}, slot_mapping, rows, spans,
                           slots, num_heads, num_kv_heads, eps, scale);
    } else {
      x = decoder_layer(x, w, bias, cos, sin_signed, caches[2 * i], caches[2 * i + 1], slot_mapping, rows, spans,
                        slots, num_heads, num_kv_heads, eps, scale);
    }
  }
  return x;
}
