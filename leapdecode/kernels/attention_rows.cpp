// Attention of few query rows over the paged float32, bfloat16 or float16 KV cache (decode tokens, drafts, tree
// nodes; a half cache's rows widened to float32 as they are read); the pieces it shares with the int8 cache's
// kernel are in attention_rows.h.
#include "tensor_api.h"

#include <algorithm>
#include <vector>

#include "attend_run.h"
#include "attention_rows.h"
#include "ops.h"
#include "row_buffer.h"

// One task of the call (attend_keys) over the float cache in place: a row's keys are its slots, KV head h's rows
// at k + h * D, Hkv * D elements apart
template <typename T>
static void attend_run(const RowsCall& x, const RowTask& task, std::vector<float>& buf, std::vector<int64_t>& meta) {
  const RunKeys keys = run_keys(x, task, buf, meta);
  const int64_t D = x.D, row = x.Hkv * D;
  const T *kh = static_cast<const T*>(x.k) + task.head * D, *vh = static_cast<const T*>(x.v) + task.head * D;
  auto own = [&](int64_t i) { return x.slots + x.span[2 * (task.r0 + i)] + keys.s; };
  attend_keys(x, task, keys, meta, kh, vh, row, x.slots + x.span[2 * task.r0] + keys.a, own, buf);
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
  const RowTasks tasks = plan_row_tasks(span, sp, R, Hkv, false);
  RowBuffer<float> parts(tasks.first_part[R] * G * (D + 2));  // every record is written by its task
  const RowsCall call{qp, kp, vp, rp, span, sp, H, G, D, Hkv, float(scale), outp, parts.data(),
                      tasks.first_part.data()};
  const int64_t work = pairs * H;  // score count
  std::vector<std::vector<float>> buf(at::get_num_threads());  // per thread: scores, and the run's meta
  std::vector<std::vector<int64_t>> meta(at::get_num_threads());
  over_row_tasks(int64_t(tasks.tasks.size()), work >= kParallelScores, [&](int64_t begin, int64_t end) {
    const int th = at::get_thread_num();
    for (int64_t task = begin; task < end; ++task) run(call, tasks.tasks[task], buf[th], meta[th]);
  });
  merge_chunks(parts.data(), tasks.first_part, rp, R, Hkv, G, D, outp);  // long rows only
}
