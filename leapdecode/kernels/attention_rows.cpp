// Attention of few query rows over the paged float32, bfloat16 or float16 KV cache (decode tokens, drafts, tree
// nodes; a half cache's rows widened to float32 as they are read); the pieces it shares with the int8 cache's
// kernel are in attention_rows.h.
#include "tensor_api.h"

#include <algorithm>
#include <vector>

#include "attention_rows.h"
#include "ops.h"

// What every task of one float-cache attention call reads and writes.
struct RowsCall {
  const float* q;          // [T, H, D]
  const void *k, *v;       // caches [num_slots, Hkv, D] of the element type attend_run reads
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
// every row before the next block, two rows a pass where the AVX2 loops take the shape (each K and V piece loaded
// once for both; 2-16 tree rows at 1,024 positions 1.08-1.16x, Zen 3): every sum's order stays the row's own (a
// score's lanes are summed by one tree however its keys are grouped), the accumulators pass through memory
// unchanged, so the bits are the same as the row's alone, decoded, batched or in a tree.
template <typename T>
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
  const T *kh = static_cast<const T*>(x.k) + h * D, *vh = static_cast<const T*>(x.v) + h * D;
  const int64_t* common = x.slots + x.span[2 * task.r0];
  auto query = [&](int64_t i) { return x.q + x.rows[task.r0 + i] * x.H * D + h * G * D; };
  auto own = [&](int64_t i) { return x.slots + x.span[2 * (task.r0 + i)]; };
  auto scores = [&](int64_t i, int64_t j) { return buf.data() + meta[3 * i + 2] + (j - a); };
  // each pass's first rows are fetched before it (the passes fetch kPrefetchKeys ahead of themselves); a run's
  // shared blocks, the next block while the rows score this one
  const int64_t bytes = D * int64_t(sizeof(T));  // one head's row, fetched ahead by each pass
  prefetch_rows(kh, common + a, std::min(block, s - a), row, bytes);
  for (int64_t j = a; j < s; j += block) {
    prefetch_rows(kh, common + j + block, std::min(block, s - j - block), row, bytes);
    const int64_t nb = std::min(block, s - j);
    int64_t i = 0;
    for (; i + 2 <= nr; i += 2)  // two rows a pass: each key piece loaded once for both
      score_keys2(query(i), query(i + 1), kh, common + j, nb, row, G, D, x.scale, scores(i, j), meta[3 * i + 1],
                  scores(i + 1, j), meta[3 * (i + 1) + 1]);
    if (i < nr) score_keys(query(i), kh, common + j, nb, row, G, D, x.scale, scores(i, j), meta[3 * i + 1]);
  }
  for (int64_t i = 0; i < nr; ++i) {
    prefetch_rows(kh, own(i) + s, meta[3 * i] - s, row, bytes);
    score_keys(query(i), kh, own(i) + s, meta[3 * i] - s, row, G, D, x.scale, scores(i, s), meta[3 * i + 1]);
  }
  // the V passes' first rows start coming while the softmax runs
  if (s > a) prefetch_rows(vh, common + a, std::min(block, s - a), row, bytes);
  for (int64_t i = 0; i < nr; ++i) prefetch_rows(vh, own(i) + s, meta[3 * i] - s, row, bytes);
  // row i's chunk record (G of [m, s, o]; chunked rows) and where its weighted sums go: its output, or the record
  auto part = [&](int64_t i) {
    const int64_t r = task.r0 + i;
    return x.parts + (x.first_part[r] + h * ((x.first_part[r + 1] - x.first_part[r]) / x.Hkv) + c) * G * (D + 2);
  };
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
    prefetch_rows(vh, common + j + block, std::min(block, s - j - block), row, bytes);
    const int64_t nb = std::min(block, s - j);
    int64_t i = 0;
    for (; i + 2 <= nr; i += 2)
      weighted_sum_heads2(scores(i, j), meta[3 * i + 1], scores(i + 1, j), meta[3 * (i + 1) + 1], vh, common + j,
                          nb, row, G, D, dst(i), dst(i + 1), stride, j == a);
    if (i < nr)
      weighted_sum_heads(scores(i, j), meta[3 * i + 1], vh, common + j, nb, row, G, D, dst(i), stride, j == a);
  }
  for (int64_t i = 0; i < nr; ++i)
    if (meta[3 * i] > s)
      weighted_sum_heads(scores(i, s), meta[3 * i + 1], vh, own(i) + s, meta[3 * i] - s, row, G, D, dst(i), stride,
                         s == a);
}

// q: [T, H, D]; k_cache, v_cache: [num_slots, Hkv, D]; row t = rows[r] attends to slots[spans[r, 0] .. spans[r, 1])
// (in position order) and its [H, D] result is written to out[t]; other rows of out are left alone.
void attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor rows,
                    torch::Tensor spans, torch::Tensor slots, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat, "attention_rows: q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat,
              "attention_rows: out");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == dtype &&
                  (dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf) &&
                  k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "attention_rows: contiguous float32, bfloat16 or float16 caches [slots, Hkv, D], both of one type");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), G = H / Hkv;
  const int64_t R = rows.numel(), num_slots = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0 && D <= kMaxHeadDim, "attention_rows: head shapes");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* span = spans.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t pairs = check_rows(rows, spans, slots, T, num_slots, "attention_rows");
  const float* qp = q.data_ptr<float>();
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  const auto run = dtype == torch::kFloat ? attend_run<float>
                   : dtype == torch::kBFloat16 ? attend_run<c10::BFloat16> : attend_run<c10::Half>;
  float* outp = out.data_ptr<float>();
  const RowTasks tasks = plan_row_tasks(span, sp, R, Hkv, false, true);
  std::vector<float> parts(tasks.first_part[R] * G * (D + 2));
  const RowsCall call{qp, kp, vp, rp, span, sp, H, G, D, Hkv, float(scale), outp, parts.data(),
                      tasks.first_part.data()};
  const int64_t num_tasks = int64_t(tasks.tasks.size());
  const int64_t work = pairs * H;  // score count
  at::parallel_for(0, num_tasks, work >= kParallelScores ? 1 : num_tasks, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    std::vector<int64_t> meta;
    for (int64_t task = begin; task < end; ++task) run(call, tasks.tasks[task], buf, meta);
  });
  merge_chunks(parts, tasks.first_part, rp, R, Hkv, G, D, outp);  // long rows only
}
