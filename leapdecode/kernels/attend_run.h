// One task of a few-row attention call (plan_row_tasks in attention_rows.h): a run of rows over one KV head and
// one chunk, wherever their K/V rows are. The float caches' kernel (attention_rows.cpp) reads the cache in place;
// the int8 cache's (attention_rows_i8.cpp) dequantises the run's keys into a scratch first, once for all rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_rows.h"

// What every task of one attention call reads and writes.
struct RowsCall {
  const float* q;          // [T, H, D]
  const void *k, *v;       // caches [num_slots, Hkv, D] of the element type attend_run reads (float caches only)
  const int64_t *rows, *span, *slots;
  int64_t H, G, D, Hkv;
  float scale;
  float* out;    // [T, H, D]
  float* parts;  // chunked rows' partial results (merge_chunks)
  const int64_t* first_part;
};

// where row r's record for KV head h and chunk c of a chunked call goes: G records [m, s, o[0 .. D)] (merge_chunks)
static inline float* chunk_record(const RowsCall& x, int64_t r, int64_t h, int64_t c) {
  return x.parts + (x.first_part[r] + h * ((x.first_part[r + 1] - x.first_part[r]) / x.Hkv) + c) * x.G * (x.D + 2);
}

// The keys of a run: each row i reads positions [a, b_i) of its slot list (its chunk, or all of it), the first
// [a, s) shared by every row of the run; meta per row: b_i, its padded score count, the offset of its scores in buf
struct RunKeys {
  int64_t a, s;
};

static inline RunKeys run_keys(const RowsCall& x, const RowTask& task, std::vector<float>& buf,
                               std::vector<int64_t>& meta) {
  const int64_t nr = task.r1 - task.r0;
  meta.resize(3 * nr);
  int64_t a = 0, bmin = INT64_MAX, total = 0;
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t r = task.r0 + i, n = x.span[2 * r + 1] - x.span[2 * r];
    int64_t b = n;
    if (task.chunk >= 0) {
      const Chunking ch = chunking(n);
      a = task.chunk * ch.len;
      b = std::min(a + ch.len, n);
    }
    const int64_t np = (b - a + 15) / 16 * 16;  // scores padded to whole vectors
    meta[3 * i] = b, meta[3 * i + 1] = np, meta[3 * i + 2] = total;
    total += x.G * np;
    bmin = std::min(bmin, b);
  }
  if (int64_t(buf.size()) < total) buf.resize(total);
  // the keys [a, s) every row of the run sees: whole groups of four from a, so each row scores them as it would
  // alone
  return {a, nr > 1 && task.shared > a ? a + (std::min(task.shared, bmin) - a) / 4 * 4 : a};
}

// Attention for query rows that each see an explicit list of positions (decode tokens, drafts, tree nodes): one
// task (KV head h, chunk c or the whole row) of the rows [r0, r1), its keys given by run_keys. K and V rows of
// the head are at kh + idx * row and vh + idx * row: the shared keys' idx at shared[0 .. s - a), row i's own
// keys' at own(i)[0 .. b_i - s). Each row's result depends only on its own query and visible K/V, in one fixed
// order: scores four keys at a time from the start of its range (score_keys), the softmax over all of them
// (float32, max subtracted), then the weighted sum of V in key order. A run reads its shared keys block by block
// (16 KB of one head's rows, in L1) for every row before the next block, two rows a pass where the AVX2 loops
// take the shape (each K and V piece loaded once for both; 2-16 tree rows at 1,024 positions 1.08-1.16x, Zen 3):
// every sum's order stays the row's own (a score's lanes are summed by one tree however its keys are grouped),
// the accumulators pass through memory unchanged, so the bits are the same as the row's alone, decoded, batched
// or in a tree.
template <typename T, class Own>
static void attend_keys(const RowsCall& x, const RowTask& task, RunKeys keys, const std::vector<int64_t>& meta,
                        const T* kh, const T* vh, int64_t row, const int64_t* shared, Own own,
                        std::vector<float>& buf) {
  const int64_t G = x.G, D = x.D, h = task.head, c = task.chunk, nr = task.r1 - task.r0, a = keys.a, s = keys.s;
  const int64_t block = std::max<int64_t>(4, 4096 / D / 4 * 4);
  auto query = [&](int64_t i) { return x.q + x.rows[task.r0 + i] * x.H * D + h * G * D; };
  auto scores = [&](int64_t i, int64_t j) { return buf.data() + meta[3 * i + 2] + (j - a); };
  auto common = [&](int64_t j) { return shared + (j - a); };  // the shared key j's index
  // each pass's first rows are fetched before it (the passes fetch kPrefetchKeys ahead of themselves); a run's
  // shared blocks, the next block while the rows score this one
  const int64_t bytes = D * int64_t(sizeof(T));  // one head's row, fetched ahead by each pass
  prefetch_rows(kh, common(a), std::min(block, s - a), row, bytes);
  for (int64_t j = a; j < s; j += block) {
    prefetch_rows(kh, common(j + block), std::min(block, s - j - block), row, bytes);
    const int64_t nb = std::min(block, s - j);
    int64_t i = 0;
    for (; i + 2 <= nr; i += 2)  // two rows a pass: each key piece loaded once for both
      score_keys2(query(i), query(i + 1), kh, common(j), nb, row, G, D, x.scale, scores(i, j), meta[3 * i + 1],
                  scores(i + 1, j), meta[3 * (i + 1) + 1]);
    if (i < nr) score_keys(query(i), kh, common(j), nb, row, G, D, x.scale, scores(i, j), meta[3 * i + 1]);
  }
  for (int64_t i = 0; i < nr; ++i) {
    prefetch_rows(kh, own(i), meta[3 * i] - s, row, bytes);
    score_keys(query(i), kh, own(i), meta[3 * i] - s, row, G, D, x.scale, scores(i, s), meta[3 * i + 1]);
  }
  // the V passes' first rows start coming while the softmax runs
  if (s > a) prefetch_rows(vh, common(a), std::min(block, s - a), row, bytes);
  for (int64_t i = 0; i < nr; ++i) prefetch_rows(vh, own(i), meta[3 * i] - s, row, bytes);
  // row i's chunk record (G of [m, s, o]; chunked rows) and where its weighted sums go: its output, or the record
  auto part = [&](int64_t i) { return chunk_record(x, task.r0 + i, h, c); };
  auto dst = [&](int64_t i) { return c < 0 ? x.out + x.rows[task.r0 + i] * x.H * D + h * G * D : part(i) + 2; };
  const int64_t stride = c < 0 ? D : D + 2;
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t m = meta[3 * i] - a, np = meta[3 * i + 1];
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores(i, a) + g * np;
      if (c < 0) {
        float mx;
        const float inv = 1.f / exp_scores(sg, m, np, &mx);
        for (int64_t j = 0; j < m; ++j) sg[j] *= inv;
      } else {
        float* rec = part(i) + g * (D + 2);
        rec[1] = exp_scores(sg, m, np, &rec[0]);
      }
    }
  }
  for (int64_t j = a; j < s; j += block) {
    prefetch_rows(vh, common(j + block), std::min(block, s - j - block), row, bytes);
    const int64_t nb = std::min(block, s - j);
    int64_t i = 0;
    for (; i + 2 <= nr; i += 2)
      weighted_sum_heads2(scores(i, j), meta[3 * i + 1], scores(i + 1, j), meta[3 * (i + 1) + 1], vh, common(j),
                          nb, row, G, D, dst(i), dst(i + 1), stride, j == a);
    if (i < nr)
      weighted_sum_heads(scores(i, j), meta[3 * i + 1], vh, common(j), nb, row, G, D, dst(i), stride, j == a);
  }
  for (int64_t i = 0; i < nr; ++i)
    if (meta[3 * i] > s)
      weighted_sum_heads(scores(i, s), meta[3 * i + 1], vh, own(i), meta[3 * i] - s, row, G, D, dst(i), stride,
                         s == a);
}
