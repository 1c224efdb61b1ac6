// Attention of few query rows over the paged int8 KV cache of layers/kv_quant.py; the pieces it shares with the
// float32 cache's kernel are in attention_rows.h.
#include "tensor_api.h"

#include <immintrin.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "attend_run.h"
#include "attention_rows.h"
#include "ops.h"
#include "row_buffer.h"

// ---------------------------------------------------------------------------------------------- int8 KV cache
// The cache of layers/kv_quant.py: rows int8 [slots, Hkv, D], one float16 scale per 16 channels [slots, Hkv, D/16],
// in a rotated (keys: shifted and smoothed) basis that the caller maps queries into and outputs out of. Attention
// reads each chunk of a row's slots as int8: a row alone, on AVX-512 and a common head shape, rebuilds the rows in
// registers (attend_chunk_i8); every other task dequantises its keys into an L2-resident scratch and runs the float
// cache's routines there (attend_run_i8), a tree's shared keys once for all its rows. The long context is read from
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
    for (int64_t c0 = 0; c0 < NG; c0 += 16) {  // 16 scales (256 channels) at a time
      const int64_t nc = std::min<int64_t>(16, NG - c0);
      half4_to_float(scale + base * NG + c0, nc, sc);
      for (int64_t c = 0; c < nc; ++c)
        dequant16(data + base * D + 16 * (c0 + c), sc[c], out + j * D + 16 * (c0 + c));
    }
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

// One row's chunk straight from the int8 cache (no dequantised scratch): G query heads q [G, D] of KV head h over
// the rows slots[0 .. n), D = 16 NG. Scores four keys at a time (hsum4), then the same exp_scores, then each V row
// rebuilt once in registers for all G heads. part: G records [m, s, o[0 .. D)], as a chunked row's in attend_keys.
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

// the in-register chunk routine for this shape, or nullptr (then: attend_run_i8 through a scratch)
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

// the fewest rows of a fused run (a tree's, or a prompt's neighbours) for which attend_run_i8's shared scratch
// pays where the rows could each read their keys in registers instead (16-row trees at 512 / 1,024 positions
// 1.04x / 1.08x; fused from 2 rows: 2 rows 0.88x, 4 rows 0.97x; whole int8 steps on Zen 4)
constexpr int64_t kRunRowsI8 = 8;

// The int8 planes one call reads
struct Int8Planes {
  const int8_t *kd, *vd;
  const at::Half *ks, *vs;
};

// A thread's buffers across its tasks: scores, the run's meta, the dequantised K and V rows, their indices
struct ScratchI8 {
  std::vector<float> buf;
  RowBuffer<float> k, v;
  std::vector<int64_t> meta, index, own_at;
};

// One task over the int8 cache: the run's keys dequantised into [n, D] scratches, the shared ones once for every
// row of the run and then each row's own, and attended there by the float cache's routines (attend_keys). The
// values attended are those the int8 rows stand for, in the same order as a row alone, so the bits are the same
// as the row's alone.
static void attend_run_i8(const RowsCall& x, const RowTask& task, const Int8Planes& p, ScratchI8& sc) {
  const RunKeys keys = run_keys(x, task, sc.buf, sc.meta);
  const int64_t nr = task.r1 - task.r0, D = x.D, h = task.head, Hkv = x.Hkv;
  auto own_slots = [&](int64_t i) { return x.slots + x.span[2 * (task.r0 + i)] + keys.s; };
  sc.own_at.resize(nr);
  int64_t n = keys.s - keys.a;
  for (int64_t i = 0; i < nr; ++i) {
    sc.own_at[i] = n;
    n += sc.meta[3 * i] - keys.s;
  }
  if (int64_t(sc.k.size()) < n * D) {
    sc.k.resize(n * D);
    sc.v.resize(n * D);
  }
  if (int64_t(sc.index.size()) < n) {
    sc.index.resize(n);
    std::iota(sc.index.begin(), sc.index.end(), 0);
  }
  const int64_t* shared = x.slots + x.span[2 * task.r0] + keys.a;
  dequant_rows(p.kd, p.ks, shared, keys.s - keys.a, Hkv, h, D, sc.k.data());
  dequant_rows(p.vd, p.vs, shared, keys.s - keys.a, Hkv, h, D, sc.v.data());
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t m = sc.meta[3 * i] - keys.s;
    dequant_rows(p.kd, p.ks, own_slots(i), m, Hkv, h, D, sc.k.data() + sc.own_at[i] * D);
    dequant_rows(p.vd, p.vs, own_slots(i), m, Hkv, h, D, sc.v.data() + sc.own_at[i] * D);
  }
  const int64_t* index = sc.index.data();
  auto own = [&](int64_t i) { return index + sc.own_at[i]; };
  attend_keys(x, task, keys, sc.meta, sc.k.data(), sc.v.data(), D, index, own, sc.buf);
}

void attention_rows_i8(torch::Tensor q, torch::Tensor k_data, torch::Tensor k_scale, torch::Tensor v_data,
                       torch::Tensor v_scale, torch::Tensor rows, torch::Tensor spans, torch::Tensor slots,
                       double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat, "attention_rows_i8: q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat,
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
  // A tree's rows (or a prompt's causal neighbours) are fused: their shared keys dequantised into a scratch and
  // read once for all of them, as the float cache's runs read theirs in place. A row alone reads its keys in
  // registers where AVX-512 has the head's shape (no scratch to write and read back), else through the scratch.
  const ChunkI8Fn in_registers = chunk_i8_for(D, G);
  const RowTasks tasks = plan_row_tasks(span, sp, R, Hkv, true);
  RowBuffer<float> parts(tasks.first_part[R] * G * (D + 2));  // every record is written by its task
  const float* qp = q.data_ptr<float>();
  const Int8Planes planes{k_data.data_ptr<int8_t>(), v_data.data_ptr<int8_t>(), k_scale.data_ptr<at::Half>(),
                          v_scale.data_ptr<at::Half>()};
  const RowsCall call{qp, nullptr, nullptr, rp, span, sp, H, G, D, Hkv, float(scale), out.data_ptr<float>(),
                      parts.data(), tasks.first_part.data()};
  // one task: a fused run of enough rows through the scratch, else each row alone (in registers where it can)
  auto attend_task = [&](const RowTask& t, ScratchI8& sc) {
    if (in_registers == nullptr || t.r1 - t.r0 >= kRunRowsI8) {
      attend_run_i8(call, t, planes, sc);
      return;
    }
    for (int64_t r = t.r0; r < t.r1; ++r) {
      const int64_t n = span[2 * r + 1] - span[2 * r];
      const Chunking ch = chunking(n);
      const int64_t j0 = t.chunk * ch.len, m = std::min(ch.len, n - j0);
      in_registers(qp + rp[r] * H * D + t.head * G * D, planes.kd, planes.ks, planes.vd, planes.vs,
                   sp + span[2 * r] + j0, m, Hkv, t.head, float(scale), chunk_record(call, r, t.head, t.chunk),
                   sc.buf);
    }
  };
  std::vector<ScratchI8> scratch(at::get_num_threads());
  over_row_tasks(int64_t(tasks.tasks.size()), pairs * H >= kParallelScores, [&](int64_t begin, int64_t end) {
    ScratchI8& sc = scratch[at::get_thread_num()];
    for (int64_t task = begin; task < end; ++task) attend_task(tasks.tasks[task], sc);
  });
  merge_chunks(parts.data(), tasks.first_part, rp, R, Hkv, G, D, out.data_ptr<float>());
}
