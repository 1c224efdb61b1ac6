// The pieces of few-row attention over the paged KV cache that the float32 cache (attention_rows.cpp) and the int8
// cache (attention_rows_i8.cpp) share: scores, softmax, weighted sums of V, the long rows' chunks and their merge,
// and the plan of one call's tasks. Each row attends to an explicit list of slots, alone and in one fixed order, so
// its result never depends on the other rows of the call.
#pragma once

#include "tensor_api.h"
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "few_rows.h"
#include "kv_prefetch.h"
#include "vec_math.h"

// A K or V row's 16 elements as float32: a float32 cache's as stored, a bfloat16 or float16 cache's widened. Every
// bfloat16 and float16 value is exactly a float32 value, so one routine serves the three caches and a half cache's
// rows give the float32 routine's bits for the same stored values.
static inline v16f load16(const float* p) {
  v16f x;
  __builtin_memcpy(&x, p, 64);
  return x;
}

static inline v16f load16(const c10::BFloat16* p) {
  typedef uint16_t v16u16 __attribute__((vector_size(32)));
  typedef uint32_t v16u32 __attribute__((vector_size(64)));
  v16u16 h;
  __builtin_memcpy(&h, p, 32);
  const v16u32 w = __builtin_convertvector(h, v16u32) << 16;  // bfloat16 is float32's upper half
  v16f x;
  __builtin_memcpy(&x, &w, 64);
  return x;
}

static inline v16f load16(const c10::Half* p) {
#if defined(__AVX512F__)
  return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  v16f x;
  __builtin_memcpy(&x, &lo, 32);
  __builtin_memcpy(reinterpret_cast<char*>(&x) + 32, &hi, 32);
  return x;
#else
  v16f x;
  for (int i = 0; i < 16; ++i) x[i] = float(p[i]);
  return x;
#endif
}

// The widest head the general head widths' loops take (they widen one row into a buffer of this many floats).
constexpr int64_t kMaxHeadDim = 1024;

// a row of d elements as float32: a float32 row itself, a half row widened into buf
static inline const float* widen(const float* p, int64_t, float*) { return p; }
template <typename T>
static inline const float* widen(const T* p, int64_t d, float* buf) {
  for (int64_t i = 0; i < d; ++i) buf[i] = float(p[i]);
  return buf;
}

#include "attention_avx2.h"

// out[0 .. 16C) = sum_j p[j] * V[slots[j]] (V rows at v + slots[j] * row), summed over j in order, onto the sum
// already in out (init: from zero). A sum continued over consecutive ranges of j is the same bits as one call over
// their union: the accumulators pass through memory unchanged.
template <int C, typename T>
static inline void weighted_rows(const float* p, const T* v, const int64_t* slots, int64_t n, int64_t row,
                                 float* out, bool init) {
  v16f acc[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = v16f{};
    if (!init) __builtin_memcpy(&acc[c], out + 16 * c, 64);
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v + slots[j] * row;
    for (int c = 0; c < C; ++c) acc[c] += load16(vj + 16 * c) * p[j];
  }
  for (int c = 0; c < C; ++c) __builtin_memcpy(out + 16 * c, &acc[c], 64);
}

// out[0 .. D) (+)= sum_j p[j] * V[slots[j]] for any head width: in registers for the common widths (no
// store-to-load chain through the output), axpy otherwise
template <typename T>
static inline void weighted_sum(const float* p, const T* v, const int64_t* slots, int64_t n, int64_t row,
                                int64_t D, float* out, bool init) {
  switch (D) {
    case 32: weighted_rows<2>(p, v, slots, n, row, out, init); break;
    case 64: weighted_rows<4>(p, v, slots, n, row, out, init); break;
    case 128: weighted_rows<8>(p, v, slots, n, row, out, init); break;
    default: {
      if (init)
        for (int64_t i = 0; i < D; ++i) out[i] = 0.f;
      float buf[kMaxHeadDim];
      for (int64_t j = 0; j < n; ++j) axpy(p[j], widen(v + slots[j] * row, D, buf), out, D);
    }
  }
}

// weighted_rows<C> for NG query heads at once (probabilities p[g * np + j]; head g's sum to out + g * stride):
// each V row is loaded once for all heads and NG * C independent sums hide the FMA latency that bounds a single
// head's C sums. Every head's sums run in weighted_rows' order, so the results are the same bits.
template <int NG, int C, typename T>
static inline void weighted_rows_heads(const float* p, int64_t np, const T* v, const int64_t* slots, int64_t n,
                                       int64_t row, float* out, int64_t stride, bool init) {
  v16f acc[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) {
      acc[g][c] = v16f{};
      if (!init) __builtin_memcpy(&acc[g][c], out + g * stride + 16 * c, 64);
    }
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v + slots[j] * row;
    if (j + kPrefetchKeys < n) prefetch_row(v + slots[j + kPrefetchKeys] * row, 16 * C * int64_t(sizeof(T)));
    v16f x[C];
    for (int c = 0; c < C; ++c) x[c] = load16(vj + 16 * c);
    for (int g = 0; g < NG; ++g) {
      const float pj = p[g * np + j];
      for (int c = 0; c < C; ++c) acc[g][c] += x[c] * pj;
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) __builtin_memcpy(out + g * stride + 16 * c, &acc[g][c], 64);
}

// the G query heads' weighted sums over one KV head's V rows (v already offset to the head), head g's to
// out + g * stride (init: from zero, else onto what is there): all heads in one pass for the common shapes,
// weighted_sum per head otherwise (same bits)
template <typename T>
static inline void weighted_sum_heads(const float* p, int64_t np, const T* v, const int64_t* slots, int64_t n,
                                      int64_t row, int64_t G, int64_t D, float* out, int64_t stride, bool init) {
#ifdef ATTENTION_AVX2
  if (D % 8 == 0) {
    by_three_heads(G, [&](auto GG, int64_t g) {
      weighted_heads_all<GG.value>(p + g * np, np, v, slots, n, row, D, out + g * stride, stride, init);
    });
    return;
  }
#endif
  if (D == 64 && G == 3) {  // SmolLM2's shape (9 query heads on 3 KV heads)
    weighted_rows_heads<3, 4>(p, np, v, slots, n, row, out, stride, init);
  } else if (D == 64 && G == 2) {
    weighted_rows_heads<2, 4>(p, np, v, slots, n, row, out, stride, init);
  } else {
    for (int64_t g = 0; g < G; ++g) weighted_sum(p + g * np, v, slots, n, row, D, out + g * stride, init);
  }
}

// weighted_sum_heads for two rows over the same keys (p0 / p1 their probabilities, out0 / out1 their sums): both
// rows in one pass where the AVX2 loops take the shape, two calls otherwise; the same bits either way
template <typename T>
static inline void weighted_sum_heads2(const float* p0, int64_t np0, const float* p1, int64_t np1, const T* v,
                                       const int64_t* slots, int64_t n, int64_t row, int64_t G, int64_t D,
                                       float* out0, float* out1, int64_t stride, bool init) {
#ifdef ATTENTION_AVX2
  if (D % 8 == 0) {
    by_three_heads(G, [&](auto GG, int64_t g) {
      weighted_heads2_all<GG.value>(p0 + g * np0, np0, p1 + g * np1, np1, v, slots, n, row, D, out0 + g * stride,
                                    out1 + g * stride, stride, init);
    });
    return;
  }
#endif
  weighted_sum_heads(p0, np0, v, slots, n, row, G, D, out0, stride, init);
  weighted_sum_heads(p1, np1, v, slots, n, row, G, D, out1, stride, init);
}

// Scores sg[0 .. n) (padded to np, a multiple of 16) become e^(s - m) with m their max, stored in *m_out; the
// padding becomes 0. Returns their sum. One fixed order, whatever the caller: e^x lane by lane and the sum in 16
// lanes then hsum's tree, held as 16 / kRowLanes registers (on AVX2 two of 8: GCC lowered the 16-lane compares,
// selects and conversions through memory there; the code around the score and weighted-sum loops, this among it,
// was 40% of a one-row call's samples)
static inline float exp_scores(float* sg, int64_t n, int64_t np, float* m_out) {
  constexpr int kParts = 16 / kRowLanes;
  auto load = [&](int64_t j) {
    vrf x;
    __builtin_memcpy(&x, sg + j, sizeof(vrf));
    return x;
  };
  // the max is exact in any order, so a register's lanes at a time (a serial chain of n compares was a visible cost)
  float m = sg[0];
  int64_t j = 0;
  if (n >= kRowLanes) {
    vrf mv = load(0);
    for (j = kRowLanes; j + kRowLanes <= n; j += kRowLanes) {
      const vrf x = load(j);
      mv = mv > x ? mv : x;
    }
    for (int l = 0; l < kRowLanes; ++l) m = std::max(m, mv[l]);
  }
  for (; j < n; ++j) m = std::max(m, sg[j]);
  for (j = n; j < np; ++j) sg[j] = m;
  vrf acc[kParts] = {};
  for (j = 0; j < np; j += 16)
    for (int u = 0; u < kParts; ++u) {
      vrf e = exp_row_lanes(load(j + u * kRowLanes) - m);
      if (j + 16 > n)  // the padding becomes 0 (the last vectors only)
        for (int l = 0; l < kRowLanes; ++l)
          if (j + u * kRowLanes + l >= n) e[l] = 0.f;
      __builtin_memcpy(sg + j + u * kRowLanes, &e, sizeof(vrf));
      acc[u] += e;
    }
  *m_out = m;
  v16f total;
  __builtin_memcpy(&total, acc, 64);
  return hsum(total);
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
// offset, rows `row` elements apart), D = 16 NG: four keys at a time, each key's lines fetched kPrefetchKeys keys ahead
template <typename T, int NG, int G>
static inline void score_rows(const float* q, const T* k, const int64_t* slots, int64_t n, int64_t row, float scale,
                       float* sh, int64_t np) {
  constexpr int64_t D = 16 * NG;
  __m512 qv[G][NG];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NG; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  auto score = [&](const T* kj, int g) {
    __m512 a = _mm512_mul_ps(qv[g][0], (__m512)load16(kj));
    for (int c = 1; c < NG; ++c) a = _mm512_fmadd_ps(qv[g][c], (__m512)load16(kj + 16 * c), a);
    return a;
  };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 acc[G][4];
    for (int u = 0; u < 4; ++u) {
      if (j + u + kPrefetchKeys < n) prefetch_row(k + slots[j + u + kPrefetchKeys] * row, D * int64_t(sizeof(T)));
      const T* kj = k + slots[j + u] * row;
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

template <typename T>
struct ScoreRows {
  template <int NG, int G>
  struct Pick {
    static constexpr auto fn = score_rows<T, NG, G>;
  };
};
template <typename T>
using ScoreFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, float, float*, int64_t);
template <typename T>
static inline ScoreFn<T> score_rows_for(int64_t D, int64_t G) {
  return for_shape<ScoreRows<T>::template Pick>(D, G);
}
#else
template <typename T>
using ScoreFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, float, float*, int64_t);
template <typename T>
static inline ScoreFn<T> score_rows_for(int64_t, int64_t) { return nullptr; }
#endif

// sh[g * np + j] = scale * q_g . K[slots[j]] for the G query heads q [G, D] of one KV head (k at that head's
// offset, rows `row` elements apart): score_rows for the common shapes, one dot product per key and head otherwise
template <typename T>
static inline void score_keys(const float* q, const T* k, const int64_t* slots, int64_t n, int64_t row, int64_t G,
                       int64_t D, float scale, float* sh, int64_t np) {
  if (const ScoreFn<T> fn = score_rows_for<T>(D, G)) {
    fn(q, k, slots, n, row, scale, sh, np);
    return;
  }
#ifdef ATTENTION_AVX2
  if (D % 8 == 0) {
    by_three_heads(G, [&](auto GG, int64_t g) {
      score_heads<GG.value>(q + g * D, D, k, slots, n, row, scale, sh + g * np, np);
    });
    return;
  }
#endif
  float buf[kMaxHeadDim];
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = widen(k + slots[j] * row, D, buf);
    if (j + 8 < n) __builtin_prefetch(k + slots[j + 8] * row);
    for (int64_t g = 0; g < G; ++g) sh[g * np + j] = dot(q + g * D, kj, D) * scale;
  }
}

// score_keys for two rows over the same keys (q0 / q1 their queries, s0 / s1 their scores): both rows in one pass
// where the AVX2 loops take the shape, two calls otherwise; the same bits either way
template <typename T>
static inline void score_keys2(const float* q0, const float* q1, const T* k, const int64_t* slots, int64_t n,
                               int64_t row, int64_t G, int64_t D, float scale, float* s0, int64_t np0, float* s1,
                               int64_t np1) {
#ifdef ATTENTION_AVX2
  if (D % 8 == 0) {
    by_three_heads(G, [&](auto GG, int64_t g) {
      score_heads2<GG.value>(q0 + g * D, q1 + g * D, D, k, slots, n, row, scale, s0 + g * np0, np0, s1 + g * np1,
                             np1);
    });
    return;
  }
#endif
  score_keys(q0, k, slots, n, row, G, D, scale, s0, np0);
  score_keys(q1, k, slots, n, row, G, D, scale, s1, np1);
}

// A row that sees more than kLongRow positions is attended in chunks of at most kLongRow slots by separate tasks,
// each keeping its own max m_c, exp-sum s_c and unnormalised sum o_c = sum_j e^(score_j - m_c) v_j, merged in chunk
// order (FlashDecoding's log-sum-exp reduction): one (row, KV head) task would read the whole context on one core,
// and a single core cannot stream it at the memory's rate (6k context: 1.6 ms per layer vs 0.7 ms for torch's
// SDPA). The chunks are of even length, so a row's tasks are of one size: a model with 3 KV heads gives a one-row
// step 3 tasks unchunked, 2 on one thread and 1 on the other, and 6 or 9 even ones chunked (one row, 30 layers,
// 1,000 positions: 2.49 -> 1.98 ms; 1,024 positions, once 2 uneven chunks, now 3 even ones: 3.99 -> 2.45 ms).
// The split depends only on the row's own length, so a token's result still does not depend on the batch.
constexpr int64_t kLongRow = 512;

// how a row of n positions is chunked: chunks of `len` slots (a multiple of 16), the last one shorter
struct Chunking {
  int64_t len, count;
};

static inline Chunking chunking(int64_t n) {
  const int64_t even = (n + kLongRow - 1) / kLongRow;  // fewest chunks of at most kLongRow
  const int64_t len = ((n + even - 1) / even + 15) / 16 * 16;  // <= kLongRow, a multiple of 16
  return {len, (n + len - 1) / len};
}

// out[t] for every row whose partial results sit in parts (G records of [m, s, o] per (row, KV head, chunk), at
// parts[(first_part[r] + h * chunks + c) * G * (D + 2)]): out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c,
// chunks in order. Rows with no parts (first_part[r] == first_part[r + 1]) are left alone.
static inline void merge_chunks(const float* parts, const std::vector<int64_t>& first_part,
                                const int64_t* rp, int64_t R, int64_t Hkv, int64_t G, int64_t D, float* outp) {
  const int64_t H = Hkv * G, stride = G * (D + 2);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t chunks = (first_part[r + 1] - first_part[r]) / Hkv, t = rp[r];
    if (chunks == 0) continue;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const float* first = parts + (first_part[r] + h * chunks) * stride + g * (D + 2);
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
// split into chunking(n)'s chunks, whose partial results go to parts[(first_part[r] + h * chunks(r) + c) * G *
// (D + 2)]; other rows are attended whole (chunk -1). A task is one KV head and one chunk of the rows [r0, r1):
// one row, or (fused) a run of neighbouring rows whose slot lists agree on their first `shared` entries and that
// are chunked alike (one sequence's tree or draft rows).
struct RowTask {
  int64_t r0, r1, shared, head, chunk;
};

// The fewest scores (query heads x visible positions, over a call's rows) whose tasks go to every thread. A
// decode step's other threads are awake (its projections just ran on them), so a split costs little: at 2048, one
// row stayed on one thread up to ~230 positions (9 heads). At 256 (one row over ~28 positions), one-row steps of
// the bundled model at 128 positions, the two settings alternating every 4 steps in one process: int8 5.68 / 7.62
// -> 5.55 / 7.38 ms, float32 13.10 / 13.67 -> 12.42 / 13.20 ms (two runs each, Zen 3).
constexpr int64_t kParallelScores = 256;

struct RowTasks {
  std::vector<int64_t> first_part;
  std::vector<RowTask> tasks;
};

static inline int64_t num_chunks(int64_t n, bool chunk_all) {
  return n > kLongRow || chunk_all ? chunking(n).count : 0;
}

// how many leading entries the slot lists a[0 .. n) and b agree on
static inline int64_t common_prefix(const int64_t* a, const int64_t* b, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n && std::memcmp(a + i, b + i, 64 * sizeof(int64_t)) == 0; i += 64) {
  }
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

static inline RowTasks plan_row_tasks(const int64_t* span, const int64_t* slots, int64_t R, int64_t Hkv,
                                      bool chunk_all) {
  auto length = [&](int64_t r) { return span[2 * r + 1] - span[2 * r]; };
  RowTasks t;
  t.first_part.assign(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) t.first_part[r + 1] = t.first_part[r] + Hkv * num_chunks(length(r), chunk_all);
  // a row's chunk length where it has several chunks, else 0: rows in one piece (attended whole, or one chunk of
  // any length, as chunk_all makes short rows) all read their keys from the start, so they go together. (With
  // each short row's own chunk length told apart, a prompt's rows over the int8 cache went in runs of 16 at most,
  // losing the head-by-head order below: its attention steps 0.91x on Zen 4.)
  auto geometry = [&](int64_t r) { return num_chunks(length(r), chunk_all) > 1 ? chunking(length(r)).len : 0; };
  const int64_t threads = at::get_num_threads();
  for (int64_t r0 = 0, r1; r0 < R; r0 = r1) {
    // Rows that start at the same slot (one sequence's tree or draft rows) read the same K/V. Fused, their
    // shared keys are read block by block for all of them (attend_run; 30 layers, 1,000 positions, K/V evicted
    // between calls as a model's weights evict them: 2 / 4 / 8 / 16 rows 3.26 / 4.14 / 5.96 / 10.35 -> 2.87 /
    // 3.63 / 5.58 / 9.58 ms against the unfused order below). Unfused (a prompt's causal rows), their tasks go
    // head by head, so one KV head's rows (~0.5 MB at 1,024 positions for a 64-wide head) stay in L2 while every
    // row of the run reads them, instead of each row pulling all heads' K/V through L3 (16 rows at 1,024
    // positions: 13.8 -> 10.7 ms). Other rows go chunk by chunk, the KV heads of one chunk neighbouring tasks, so
    // a thread usually takes all of them and the 2nd and 3rd head find the chunk's lines (rows hold every head:
    // [slot, Hkv, D]) still in L2.
    for (r1 = r0 + 1; r1 < R && slots[span[2 * r1]] == slots[span[2 * r0]] && geometry(r1) == geometry(r0); ++r1) {
    }
    const int64_t chunks = num_chunks(length(r0), chunk_all);
    int64_t shared = 0;
    if (r1 - r0 > 1) {
      shared = length(r0);
      for (int64_t r = r0 + 1; r < r1; ++r)
        shared = common_prefix(slots + span[2 * r0], slots + span[2 * r], std::min(shared, length(r)));
    }
    // fused where most of what the rows read is shared (not a prompt's causal rows, which share row 0's one slot)
    if (2 * shared >= length(r1 - 1) && shared >= 64) {
      // enough tasks for every thread: a run's rows split into slices, each reading the shared keys once
      const int64_t per_slice = Hkv * std::max<int64_t>(chunks, 1);
      const int64_t slices = std::clamp<int64_t>((2 * threads + per_slice - 1) / per_slice, 1, r1 - r0);
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t c = chunks ? 0 : -1; c < chunks; ++c)
          for (int64_t i = 0; i < slices; ++i)
            t.tasks.push_back({r0 + (r1 - r0) * i / slices, r0 + (r1 - r0) * (i + 1) / slices, shared, h, c});
    } else if (r1 - r0 > 1) {
      // a prompt's causal rows read ever more keys: taken first and last alternately, each thread's contiguous
      // share of the tasks reads about as many keys as the other's (in order, the later half of the rows read ~3x
      // the keys of the earlier; a 1,000-token prompt's attention took 0.95x the time this way, A/B on Zen 4).
      // Fused, neighbours whose spans start at one place in the slot list (row r's keys a prefix of row r + 1's)
      // and that are chunked alike go as a pair: attend_run reads their shared keys once for both (a fresh
      // prompt's attention, 30 layers, calls alternating with the unpaired build on Zen 3: 300 rows 1.12x, 1,000
      // rows 1.23x, same bits).
      auto pairs = [&](int64_t r) {
        return r + 1 < r1 && span[2 * r + 2] == span[2 * r] && length(r + 1) >= length(r) &&
               length(r) >= 64 && geometry(r + 1) == geometry(r) &&
               num_chunks(length(r + 1), chunk_all) == num_chunks(length(r), chunk_all);
      };
      std::vector<int64_t> units;  // each unit's first row; a unit is one row or a pair
      for (int64_t r = r0; r < r1; ++r) {
        units.push_back(r);
        if (pairs(r)) ++r;  // its neighbour goes with it
      }
      const int64_t nu = int64_t(units.size());
      auto unit_end = [&](int64_t u) { return u + 1 < nu ? units[u + 1] : r1; };
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t k = 0; k < nu; ++k) {
          const int64_t u = k % 2 == 0 ? k / 2 : nu - 1 - k / 2;
          const int64_t r = units[u], e = unit_end(u);
          const int64_t cr = num_chunks(length(r), chunk_all);
          for (int64_t c = cr ? 0 : -1; c < cr; ++c) t.tasks.push_back({r, e, e - r > 1 ? length(r) : 0, h, c});
        }
    } else {
      for (int64_t c = chunks ? 0 : -1; c < chunks; ++c)
        for (int64_t h = 0; h < Hkv; ++h) t.tasks.push_back({r0, r0 + 1, 0, h, c});
    }
  }
  return t;
}

// body(begin, end) over the tasks [0, n) of one call, on every thread where `parallel`: each thread works through
// its contiguous share of the list first (neighbouring tasks read the same K/V), then takes single tasks from the
// back of the other's (over_panels), so a thread whose tasks read more keys is helped instead of waited for.
// Split by count alone, a tree straddling a chunk boundary (two runs: 12 rows in one piece, 4 in two chunks) gave
// one thread 3x the other's keys. Any thread may run any task: each writes only its own rows' outputs or records;
// body finds its thread's scratch by at::get_thread_num().
template <class F>
static inline void over_row_tasks(int64_t n, bool parallel, F&& body) {
  if (parallel) {
    over_panels(n, 1, 1, body);
  } else {
    body(int64_t(0), n);
  }
}

// rows [R], spans [R, 2], slots: int64, contiguous; row r sees slots[spans[r, 0] .. spans[r, 1]) (spans may overlap:
// a prompt's causal rows share one slot list, each a longer prefix of it). Every row in [0, T) with at least one
// slot, every slot in [0, num_slots) -- checked once per call, so the kernels can index without bounds checks.
// Returns the total number of (row, slot) pairs.
static inline int64_t check_rows(const torch::Tensor& rows, const torch::Tensor& spans, const torch::Tensor& slots,
                                 int64_t T, int64_t num_slots, const char* what) {
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
