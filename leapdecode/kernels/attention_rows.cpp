// Attention of few query rows over the paged KV cache (decode tokens, drafts, tree nodes), for a float32 cache and
// for the int8 cache of layers/kv_quant.py. Each row attends to an explicit list of slots, alone and in one fixed
// order, so its result never depends on the other rows of the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "ops.h"
#include "vec_math.h"

// out[0 .. 16C) = sum_j p[j] * V[slots[j]] (V rows at v + slots[j] * row), summed over j in order, onto the sum
// already in out (init: from zero). A sum continued over consecutive ranges of j is the same bits as one call over
// their union: the accumulators pass through memory unchanged.
template <int C>
static inline void weighted_rows(const float* p, const float* v, const int64_t* slots, int64_t n, int64_t row,
                                 float* out, bool init) {
  v16f acc[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = v16f{};
    if (!init) __builtin_memcpy(&acc[c], out + 16 * c, 64);
  }
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

// out[0 .. D) (+)= sum_j p[j] * V[slots[j]] for any head width: in registers for the common widths (no
// store-to-load chain through the output), axpy otherwise
static inline void weighted_sum(const float* p, const float* v, const int64_t* slots, int64_t n, int64_t row,
                                int64_t D, float* out, bool init) {
  switch (D) {
    case 32: weighted_rows<2>(p, v, slots, n, row, out, init); break;
    case 64: weighted_rows<4>(p, v, slots, n, row, out, init); break;
    case 128: weighted_rows<8>(p, v, slots, n, row, out, init); break;
    default:
      if (init)
        for (int64_t i = 0; i < D; ++i) out[i] = 0.f;
      for (int64_t j = 0; j < n; ++j) axpy(p[j], v + slots[j] * row, out, D);
  }
}

// weighted_rows<C> for NG query heads at once (probabilities p[g * np + j]; head g's sum to out + g * stride):
// each V row is loaded once for all heads and NG * C independent sums hide the FMA latency that bounds a single
// head's C sums. Every head's sums run in weighted_rows' order, so the results are the same bits.
template <int NG, int C>
static inline void weighted_rows_heads(const float* p, int64_t np, const float* v, const int64_t* slots, int64_t n,
                                       int64_t row, float* out, int64_t stride, bool init) {
  v16f acc[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) {
      acc[g][c] = v16f{};
      if (!init) __builtin_memcpy(&acc[g][c], out + g * stride + 16 * c, 64);
    }
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
// out + g * stride (init: from zero, else onto what is there): all heads in one pass for the common shapes,
// weighted_sum per head otherwise (same bits)
static inline void weighted_sum_heads(const float* p, int64_t np, const float* v, const int64_t* slots, int64_t n,
                                      int64_t row, int64_t G, int64_t D, float* out, int64_t stride, bool init) {
  if (D == 64 && G == 3) {  // SmolLM2's shape (9 query heads on 3 KV heads)
    weighted_rows_heads<3, 4>(p, np, v, slots, n, row, out, stride, init);
  } else if (D == 64 && G == 2) {
    weighted_rows_heads<2, 4>(p, np, v, slots, n, row, out, stride, init);
  } else {
    for (int64_t g = 0; g < G; ++g) weighted_sum(p + g * np, v, slots, n, row, D, out + g * stride, init);
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
  weighted_sum_heads(sh, np, v, slots, n, row, G, D, part + 2, D + 2, true);
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
// split into chunking(n)'s chunks, whose partial results go to parts[(first_part[r] + h * chunks(r) + c) * G *
// (D + 2)]; other rows are attended whole (chunk -1). A task is one KV head and one chunk of the rows [r0, r1):
// one row, or (fused) a run of neighbouring rows whose slot lists agree on their first `shared` entries and that
// are chunked alike (one sequence's tree or draft rows).
struct RowTask {
  int64_t r0, r1, shared, head, chunk;
};

struct RowTasks {
  std::vector<int64_t> first_part;
  std::vector<RowTask> tasks;
};

static inline int64_t num_chunks(int64_t n, bool chunk_all) {
  return n > kLongRow || chunk_all ? chunking(n).count : 0;
}

// how many leading entries the slot lists a[0 .. n) and b agree on
static int64_t common_prefix(const int64_t* a, const int64_t* b, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n && std::memcmp(a + i, b + i, 64 * sizeof(int64_t)) == 0; i += 64) {
  }
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

static RowTasks plan_row_tasks(const int64_t* span, const int64_t* slots, int64_t R, int64_t Hkv, bool chunk_all,
                               bool fuse) {
  RowTasks t;
  t.first_part.assign(R + 1, 0);
  for (int64_t r = 0; r < R; ++r)
    t.first_part[r + 1] = t.first_part[r] + Hkv * num_chunks(span[2 * r + 1] - span[2 * r], chunk_all);
  auto length = [&](int64_t r) { return span[2 * r + 1] - span[2 * r]; };
  auto geometry = [&](int64_t r) {  // chunk length, or 0 for a row attended whole
    return num_chunks(length(r), chunk_all) ? chunking(length(r)).len : 0;
  };
  const int64_t threads = at::get_num_threads();
  for (int64_t r0 = 0, r1; r0 < R; r0 = r1) {
    // Rows that start at the same slot (one sequence's tree or draft rows) read the same K/V. Fused, their
    // shared keys are read block by block for all of them (attend_run; 30 layers, 1,000 positions, K/V evicted
    // between calls as a model's weights evict them: 2 / 4 / 8 / 16 rows 3.26 / 4.14 / 5.96 / 10.35 -> 2.87 /
    // 3.63 / 5.58 / 9.58 ms against the unfused order below). Unfused (the int8 cache, prompts), their tasks go
    // head by head, so one KV head's rows (~0.5 MB at 1,024 positions for a 64-wide head) stay in L2 while every
    // row of the run reads them, instead of each row pulling all heads' K/V through L3 (16 rows at 1,024
    // positions: 13.8 -> 10.7 ms). Other rows go chunk by chunk, the KV heads of one chunk neighbouring tasks, so
    // a thread usually takes all of them and the 2nd and 3rd head find the chunk's lines (rows hold every head:
    // [slot, Hkv, D]) still in L2.
    for (r1 = r0 + 1; r1 < R && slots[span[2 * r1]] == slots[span[2 * r0]] &&
                      (!fuse || geometry(r1) == geometry(r0));
         ++r1) {
    }
    const int64_t chunks = num_chunks(length(r0), chunk_all);
    int64_t shared = 0;
    if (fuse && r1 - r0 > 1) {
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
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t cr = num_chunks(length(r), chunk_all);
          for (int64_t c = cr ? 0 : -1; c < cr; ++c) t.tasks.push_back({r, r + 1, 0, h, c});
        }
    } else {
      for (int64_t c = chunks ? 0 : -1; c < chunks; ++c)
        for (int64_t h = 0; h < Hkv; ++h) t.tasks.push_back({r0, r0 + 1, 0, h, c});
    }
  }
  return t;
}

// What every task of one float-cache attention call reads and writes.
struct RowsCall {
  const float *q, *k, *v;  // q [T, H, D]; caches [num_slots, Hkv, D]
  const int64_t *rows, *span, *slots;
  int64_t H, G, D, Hkv;
  float scale;
  float* out;    // [T, H, D]
  float* parts;  // chunked rows' partial results (merge_chunks)
  const int64_t* first_part;
};

// Attention for query rows that each see an explicit list of cache slots (decode tokens, drafts, tree nodes), in
// place over the paged cache: one task (KV head h, chunk c or the whole row) of the rows [r0, r1). Each row's
// result depends only on its own query and visible K/V, in one fixed order: scores four keys at a time from the
// start of its range (score_keys), the softmax over all of them (float32, max subtracted), then the weighted sum
// of V in key order. A run of rows reads its shared keys block by block (16 KB of one head's rows, in L1) for
// every row before the next block: the groups of four and the sums' order stay the row's own, the accumulators
// pass through memory unchanged, so the bits are the same as the row's alone, decoded, batched or in a tree.
static void attend_run(const RowsCall& x, const RowTask& task, std::vector<float>& buf, std::vector<int64_t>& meta) {
  const int64_t G = x.G, D = x.D, row = x.Hkv * D, h = task.head, c = task.chunk, nr = task.r1 - task.r0;
  meta.resize(3 * nr);  // per row: end of its range, padded score count, offset of its scores in buf
  int64_t a = 0, bmin = INT64_MAX, total = 0;
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t r = task.r0 + i, n = x.span[2 * r + 1] - x.span[2 * r];
    int64_t b = n;
    if (c >= 0) {
      const Chunking ch = chunking(n);
      a = c * ch.len;
      b = std::min(a + ch.len, n);
    }
    const int64_t np = (b - a + 15) / 16 * 16;  // scores padded to whole vectors
    meta[3 * i] = b, meta[3 * i + 1] = np, meta[3 * i + 2] = total;
    total += G * np;
    bmin = std::min(bmin, b);
  }
  if (int64_t(buf.size()) < total) buf.resize(total);
  // the keys [a, s) every row of the run sees: whole groups of four from a, so each row scores them as it would
  // alone; block by block while a block's rows are in L1
  const int64_t s = nr > 1 && task.shared > a ? a + (std::min(task.shared, bmin) - a) / 4 * 4 : a;
  const int64_t block = std::max<int64_t>(4, 4096 / D / 4 * 4);
  const float *kh = x.k + h * D, *vh = x.v + h * D;
  const int64_t* common = x.slots + x.span[2 * task.r0];
  auto query = [&](int64_t i) { return x.q + x.rows[task.r0 + i] * x.H * D + h * G * D; };
  auto own = [&](int64_t i) { return x.slots + x.span[2 * (task.r0 + i)]; };
  auto scores = [&](int64_t i, int64_t j) { return buf.data() + meta[3 * i + 2] + (j - a); };
  for (int64_t j = a; j < s; j += block)
    for (int64_t i = 0; i < nr; ++i)
      score_keys(query(i), kh, common + j, std::min(block, s - j), row, G, D, x.scale, scores(i, j), meta[3 * i + 1]);
  for (int64_t i = 0; i < nr; ++i)
    score_keys(query(i), kh, own(i) + s, meta[3 * i] - s, row, G, D, x.scale, scores(i, s), meta[3 * i + 1]);
  std::vector<float*> dst(nr);
  const int64_t stride = c < 0 ? D : D + 2;
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t r = task.r0 + i, m = meta[3 * i] - a, np = meta[3 * i + 1];
    float* part = nullptr;
    if (c < 0) {
      dst[i] = x.out + x.rows[r] * x.H * D + h * G * D;
    } else {
      part = x.parts + (x.first_part[r] + h * ((x.first_part[r + 1] - x.first_part[r]) / x.Hkv) + c) * G * (D + 2);
      dst[i] = part + 2;
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores(i, a) + g * np;
      if (c < 0) {
        float mx;
        const float inv = 1.f / exp_scores(sg, m, np, &mx);
        for (int64_t j = 0; j < m; ++j) sg[j] *= inv;
      } else {
        part[g * (D + 2) + 1] = exp_scores(sg, m, np, &part[g * (D + 2)]);
      }
    }
  }
  for (int64_t j = a; j < s; j += block)
    for (int64_t i = 0; i < nr; ++i)
      weighted_sum_heads(scores(i, j), meta[3 * i + 1], vh, common + j, std::min(block, s - j), row, G, D, dst[i],
                         stride, j == a);
  for (int64_t i = 0; i < nr; ++i)
    if (meta[3 * i] > s)
      weighted_sum_heads(scores(i, s), meta[3 * i + 1], vh, own(i) + s, meta[3 * i] - s, row, G, D, dst[i], stride,
                         s == a);
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
  const RowTasks tasks = plan_row_tasks(span, sp, R, Hkv, false, true);
  std::vector<float> parts(tasks.first_part[R] * G * (D + 2));
  const RowsCall call{qp, kp, vp, rp, span, sp, H, G, D, Hkv, float(scale), outp, parts.data(),
                      tasks.first_part.data()};
  const int64_t num_tasks = int64_t(tasks.tasks.size());
  const int64_t work = pairs * H;  // score count: one thread unless waking a second one pays
  at::parallel_for(0, num_tasks, work >= 2048 ? 1 : num_tasks, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    std::vector<int64_t> meta;
    for (int64_t task = begin; task < end; ++task) attend_run(call, tasks.tasks[task], buf, meta);
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
  const RowTasks tasks = plan_row_tasks(span, sp, R, Hkv, true, false);
  std::vector<float> parts(tasks.first_part[R] * G * (D + 2));
  std::vector<int64_t> identity(std::min(kLongRow, pairs + 1));
  std::iota(identity.begin(), identity.end(), 0);
  const float* qp = q.data_ptr<float>();
  const int8_t* kd = k_data.data_ptr<int8_t>();
  const int8_t* vd = v_data.data_ptr<int8_t>();
  const at::Half* ks = k_scale.data_ptr<at::Half>();
  const at::Half* vs = v_scale.data_ptr<at::Half>();
  const int64_t num_tasks = int64_t(tasks.tasks.size()), work = pairs * H;
  const ChunkI8Fn fused = chunk_i8_for(D, G);  // the common shapes read the int8 rows in registers
  at::parallel_for(0, num_tasks, work >= 2048 ? 1 : num_tasks, [&](int64_t begin, int64_t end) {
    std::vector<float> buf, kbuf, vbuf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = tasks.tasks[task].r0, h = tasks.tasks[task].head, c = tasks.tasks[task].chunk, t = rp[r];
      const int64_t n = span[2 * r + 1] - span[2 * r];
      const Chunking ch = chunking(n);
      const int64_t j0 = c * ch.len, m = std::min(ch.len, n - j0);
      float* part = parts.data() + (tasks.first_part[r] + h * ch.count + c) * G * (D + 2);
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
